//! Lowering: turn a compute-only plan into one with explicit SEND/RECV actions.
//!
//! Semantics of the lowered plan (the validator and simulator use the same): a SEND is
//! buffered — it completes locally at once; a RECV blocks until its matching SEND (same
//! hand-over, same micro-batch) has executed. Stages on the same rank hand tensors over
//! locally, with no SEND/RECV.
//!
//! What is inserted, for every hand-over between stages on different ranks:
//! - `SEND_F(s,mb)` right after `F(s,mb)` on s's rank, `RECV_F(s+1,mb)` before `F(s+1,mb)`;
//! - `SEND_B(s,mb)` right after the I or B of (s,mb), `RECV_B(s−1,mb)` before the I or B of
//!   (s−1,mb); an OVERLAP_F_B gets both, for its forward and for its backward half.
//!
//! **Where the RECVs go.** PyTorch's `_add_send_recv` runs all ranks together in lockstep
//! and lets each SEND append its RECV wherever the receiver has got to. That order replays
//! a global execution, so it cannot hang, and on every link (sender → receiver) the RECVs
//! come in the order of the SENDs, which first-in first-out transports (NCCL, TCP streams)
//! need. But under *blocking* RECVs it adds waits the plan never asked for: on PyTorch's own
//! ZB1P file, rank 1 would receive micro-batch 1's activation before running micro-batch 0,
//! stretching the makespan from 49 to 65 steps with free links. So each RECV goes as
//! late as the two constraints allow: before its consumer, and before the next RECV of the
//! same link (RECVs of one link keep the SENDs' order). That position is never earlier
//! than the one the lockstep replay gives (which meets both constraints), and moving a
//! blocking RECV later cannot create a deadlock, so the result cannot hang either; and a RECV
//! only ever waits where a later RECV of the same link — sent later by the same rank — makes
//! the rank wait anyway, so lowering adds no wait to the compute-only plan's timing.
//! Before anything is placed, the compute-only plan is executed once (the validator's
//! global run of all ranks): a plan that cannot run gets that error, not a lowered plan.

use crate::action::{Action, ActionKind};
use crate::error::Result;
use crate::plan::Plan;
use crate::validate::{bit, check_executable};

/// A RECV to place on a receiver: where its consumer is, and where it ends up.
struct Recv {
    action: Action,
    from: usize,
    /// Index, in the receiver's compute list, of the action that consumes it.
    consumer: usize,
    /// Index it is placed before (≤ `consumer`).
    before: usize,
}

/// Inserts SEND/RECV for every cross-rank hand-over (see the module docs for where);
/// idle steps are dropped, since the RECVs do the waiting. A plan that already holds
/// SEND/RECV is returned unchanged, so lowering is idempotent.
///
/// The plan must be valid apart from memory; otherwise this is the validator's error
/// (e.g. a deadlock, naming every waiting rank).
pub fn lower(plan: &Plan) -> Result<Plan> {
    let st = check_executable(plan)?;
    if st.lowered {
        return Ok(plan.clone());
    }
    let ranks = plan.num_ranks();
    let compute: Vec<Vec<Action>> = plan
        .ranks
        .iter()
        .map(|l| l.iter().flatten().copied().collect())
        .collect();

    // Where each (stage, mb)'s forward and backward (I or B) sit in their rank's list.
    let mut pos_f = vec![0u32; st.seen.len()];
    let mut pos_bwd = vec![0u32; st.seen.len()];
    for list in &compute {
        for (i, a) in list.iter().enumerate() {
            for p in a.parts() {
                let k = st.key(p.stage, p.microbatch);
                match bit::of(p.kind) {
                    bit::F => pos_f[k] = i as u32,
                    bit::I | bit::B => pos_bwd[k] = i as u32,
                    _ => {}
                }
            }
        }
    }

    // Every hand-over, in send order: senders in rank order, each in its list's order, so
    // each receiver's entries come grouped by sender and, per sender, in send order.
    let mut recvs: Vec<Vec<Recv>> = (0..ranks).map(|_| Vec::new()).collect();
    for (from, list) in compute.iter().enumerate() {
        for a in list {
            for (_, recv) in hand_overs(plan, from, a) {
                let to = plan.rank_of(recv.stage);
                let k = st.key(recv.stage, recv.microbatch);
                let consumer = match recv.kind {
                    ActionKind::RecvF => pos_f[k],
                    _ => pos_bwd[k],
                } as usize;
                recvs[to].push(Recv {
                    action: recv,
                    from,
                    consumer,
                    before: consumer,
                });
            }
        }
    }

    let mut out = Vec::with_capacity(ranks);
    for (rank, list) in compute.iter().enumerate() {
        let mut mine = std::mem::take(&mut recvs[rank]);
        // Latest positions: walking each link backwards, a RECV goes before its consumer
        // and before the next RECV of the same link.
        let mut next_on_link: Option<(usize, usize)> = None;
        for r in mine.iter_mut().rev() {
            r.before = match next_on_link {
                Some((from, before)) if from == r.from => r.consumer.min(before),
                _ => r.consumer,
            };
            next_on_link = Some((r.from, r.before));
        }
        // Stable bucket order by position: ties keep (sender, send order).
        let mut start = vec![0usize; list.len() + 1];
        for r in &mine {
            start[r.before + 1] += 1;
        }
        for i in 0..list.len() {
            start[i + 1] += start[i];
        }
        let mut placed: Vec<Option<Action>> = vec![None; mine.len()];
        let mut fill = start.clone();
        for r in mine.drain(..) {
            placed[fill[r.before]] = Some(r.action);
            fill[r.before] += 1;
        }
        let mut lowered = Vec::with_capacity(list.len() + 2 * placed.len());
        for (i, a) in list.iter().enumerate() {
            lowered.extend_from_slice(&placed[start[i]..start[i + 1]]);
            lowered.push(Some(*a));
            lowered.extend(hand_overs(plan, rank, a).map(|(send, _)| Some(send)));
        }
        out.push(lowered);
    }

    Ok(Plan {
        stages: plan.stages,
        microbatches: plan.microbatches,
        placement: plan.placement.clone(),
        stage_rank: plan.stage_rank.clone(),
        ranks: out,
    })
}

/// The cross-rank hand-overs `a` (run on `rank`) produces, as (SEND, matching RECV): a
/// forward feeds the next stage, an I or B the previous one; an overlap may do both.
fn hand_overs<'a>(
    plan: &'a Plan,
    rank: usize,
    a: &'a Action,
) -> impl Iterator<Item = (Action, Action)> + 'a {
    a.parts().filter_map(move |p| {
        let (s, mb) = (p.stage, p.microbatch);
        let (send, recv) = match p.kind {
            ActionKind::F if (s as usize) + 1 < plan.stages => {
                (ActionKind::SendF, Action::new(ActionKind::RecvF, s + 1, mb))
            }
            ActionKind::I | ActionKind::B if s > 0 => {
                (ActionKind::SendB, Action::new(ActionKind::RecvB, s - 1, mb))
            }
            _ => return None,
        };
        (plan.rank_of(recv.stage) != rank).then_some((Action::new(send, s, mb), recv))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Placement;
    use crate::validate::{ValidateOptions, validate};

    fn plan(placement: Placement, stages: usize, m: usize, rows: &[&str]) -> Plan {
        let mut p = Plan::new(rows.len(), stages, m, placement);
        for (r, row) in rows.iter().enumerate() {
            p.ranks[r] = row
                .split_whitespace()
                .map(|t| (t != "_").then(|| t.parse::<Action>().unwrap()))
                .collect();
        }
        p
    }

    fn text(list: &[Option<Action>]) -> String {
        let v: Vec<String> = list
            .iter()
            .map(|a| a.map_or("_".into(), |a| a.to_string()))
            .collect();
        v.join(" ")
    }

    /// Looped BFS: every forward in (stage, mb) order, then every backward in reverse
    /// stage order; correct for any placement.
    fn bfs(ranks: usize, stages: usize, m: usize, placement: Placement, split: bool) -> Plan {
        let mut p = Plan::new(ranks, stages, m, placement);
        for s in 0..stages as u32 {
            for mb in 0..m as u32 {
                p.push(p.rank_of(s), Action::f(s, mb));
            }
        }
        for s in (0..stages as u32).rev() {
            for mb in 0..m as u32 {
                let r = p.rank_of(s);
                if split {
                    p.push(r, Action::i(s, mb));
                    p.push(r, Action::w(s, mb));
                } else {
                    p.push(r, Action::b(s, mb));
                }
            }
        }
        p
    }

    fn count(p: &Plan, kind: ActionKind) -> usize {
        p.iter().filter(|(_, _, a)| a.kind == kind).count()
    }

    #[test]
    fn lowers_1f1b_like_pytorch() {
        let p = plan(
            Placement::Contiguous,
            2,
            2,
            &["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"],
        );
        let l = lower(&p).unwrap();
        assert_eq!(
            text(&l.ranks[0]),
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1"
        );
        assert_eq!(
            text(&l.ranks[1]),
            "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"
        );
        validate(&l, &ValidateOptions::default()).unwrap();
        assert_eq!(lower(&l).unwrap(), l, "lowering is idempotent");
    }

    #[test]
    fn same_rank_stages_hand_over_without_sends() {
        // Looped on 2 ranks: stages 0, 2 on rank 0 and 1, 3 on rank 1; every hand-over
        // crosses ranks, so each of the 3 links × 4 mb gets a SEND_F and a SEND_B.
        let looped = bfs(2, 4, 4, Placement::Looped, true);
        let l = lower(&looped).unwrap();
        assert_eq!(count(&l, ActionKind::SendF), 3 * 4);
        assert_eq!(count(&l, ActionKind::RecvB), 3 * 4);
        validate(&l, &ValidateOptions::default()).unwrap();
        // Contiguous with 2 stages per rank: 0 → 1 and 2 → 3 stay on their rank.
        let contiguous = bfs(2, 4, 4, Placement::Contiguous, false);
        let l = lower(&contiguous).unwrap();
        for (_, _, a) in l.iter().filter(|(_, _, a)| a.kind.is_comm()) {
            let s = a.stage;
            let edge = match a.kind {
                ActionKind::SendF | ActionKind::RecvB => (s, s + 1),
                _ => (s - 1, s),
            };
            assert_eq!(edge, (1, 2), "{a} exchanges between same-rank stages");
        }
        assert_eq!(count(&l, ActionKind::SendF), 4);
        validate(&l, &ValidateOptions::default()).unwrap();
        // One rank: nothing to send.
        let single = bfs(1, 2, 3, Placement::Contiguous, true);
        let l = lower(&single).unwrap();
        assert!(l.is_compute_only());
        assert_eq!(l, single);
    }

    #[test]
    fn sends_follow_their_producer_and_recvs_precede_their_consumer() {
        let p = bfs(3, 6, 5, Placement::VShape, true);
        let l = lower(&p).unwrap();
        validate(&l, &ValidateOptions::default()).unwrap();
        for list in &l.ranks {
            for (i, a) in list.iter().flatten().enumerate() {
                match a.kind {
                    ActionKind::SendF => {
                        assert_eq!(list[i - 1], Some(Action::f(a.stage, a.microbatch)))
                    }
                    ActionKind::SendB => {
                        assert_eq!(list[i - 1], Some(Action::i(a.stage, a.microbatch)))
                    }
                    ActionKind::RecvF => {
                        let f = Action::f(a.stage, a.microbatch);
                        assert!(list[i..].contains(&Some(f)), "{a} after its consumer");
                    }
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn recvs_on_each_link_come_in_send_order() {
        let p = bfs(4, 8, 6, Placement::Looped, false);
        let l = lower(&p).unwrap();
        for from in 0..4 {
            for to in 0..4 {
                let sent: Vec<(ActionKind, u32, u32)> = l.ranks[from]
                    .iter()
                    .flatten()
                    .filter(|a| matches!(a.kind, ActionKind::SendF | ActionKind::SendB))
                    .filter_map(|a| {
                        let (peer, kind) = match a.kind {
                            ActionKind::SendF => (a.stage + 1, ActionKind::RecvF),
                            _ => (a.stage - 1, ActionKind::RecvB),
                        };
                        (l.rank_of(peer) == to).then_some((kind, peer, a.microbatch))
                    })
                    .collect();
                let received: Vec<(ActionKind, u32, u32)> = l.ranks[to]
                    .iter()
                    .flatten()
                    .filter(|a| matches!(a.kind, ActionKind::RecvF | ActionKind::RecvB))
                    .filter(|a| {
                        let peer = match a.kind {
                            ActionKind::RecvF => a.stage - 1,
                            _ => a.stage + 1,
                        };
                        l.rank_of(peer) == from
                    })
                    .map(|a| (a.kind, a.stage, a.microbatch))
                    .collect();
                assert_eq!(sent, received, "link {from} → {to}");
            }
        }
    }

    #[test]
    fn overlap_gets_both_hand_overs() {
        // V-shape on 2 ranks: rank 0 holds 0 and 3, rank 1 holds 1 and 2.
        let p = plan(
            Placement::VShape,
            4,
            2,
            &[
                "0F0 0F1 3F0 3B0 (3F1;0B0)OVERLAP_F_B 3B1 0B1",
                "1F0 1F1 2F0 2F1 2B0 1B0 2B1 1B1",
            ],
        );
        validate(&p, &ValidateOptions::default()).unwrap();
        let l = lower(&p).unwrap();
        validate(&l, &ValidateOptions::default()).unwrap();
        let r0 = &l.ranks[0];
        let at = r0
            .iter()
            .position(|a| a.is_some_and(|a| a.kind == ActionKind::OverlapFB))
            .unwrap();
        // 3 is the last stage (no SEND_F); 0 is the first stage (no SEND_B); so the
        // overlap needs RECV_B 0/0 before it and sends nothing.
        assert!(r0[..at].contains(&Some(Action::new(ActionKind::RecvB, 0, 0))));
        assert!(
            !r0[at + 1..]
                .iter()
                .flatten()
                .any(|a| a.kind == ActionKind::SendF)
        );
        // A plan where both halves send: looped on 2 ranks, rank 1 overlaps 1F1 (whose
        // output goes to stage 2 on rank 0) with 3B0 (whose gradient goes to stage 2 too).
        let p = plan(
            Placement::Looped,
            4,
            2,
            &[
                "0F0 0F1 2F0 2F1 2B0 0B0 2B1 0B1",
                "1F0 3F0 (1F1;3B0)OVERLAP_F_B 3F1 3B1 1B0 1B1",
            ],
        );
        validate(&p, &ValidateOptions::default()).unwrap();
        let l = lower(&p).unwrap();
        validate(&l, &ValidateOptions::default()).unwrap();
        let r1 = text(&l.ranks[1]);
        assert!(
            r1.contains("(1F1;3B0)OVERLAP_F_B 1SEND_F1 3SEND_B0"),
            "{r1}"
        );
        let at = l.ranks[1]
            .iter()
            .position(|a| a.is_some_and(|a| a.kind == ActionKind::OverlapFB))
            .unwrap();
        assert!(l.ranks[1][..at].contains(&Some(Action::new(ActionKind::RecvF, 1, 1))));
    }

    #[test]
    fn a_plan_that_cannot_run_is_an_error_not_a_hang() {
        let p = plan(
            Placement::Contiguous,
            2,
            2,
            &["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"],
        );
        assert_eq!(
            lower(&p).unwrap_err().to_string(),
            "deadlock: rank 0 waits for RECV_B 1/0, rank 1 waits for RECV_F 0/1"
        );
        let p = plan(Placement::Contiguous, 2, 1, &["1F0 0F0 1B0 0B0"]);
        assert_eq!(
            lower(&p).unwrap_err().to_string(),
            "rank 0, step 0: 1F0 before 0F0 has run"
        );
    }
}
