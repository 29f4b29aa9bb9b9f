//! Rules 1 and 2: shape, placement, and "each action exactly once".
//!
//! These passes look at actions one by one, without executing anything; they leave a
//! [`Structure`] (which actions exist, per (stage, micro-batch)) that the execution pass
//! and lowering rely on, so those can index freely without bounds surprises.

use super::{bit, invalid};
use crate::action::{Action, ActionKind};
use crate::error::{Result, ScheduleError};
use crate::plan::Plan;

/// What the structural passes learned about a plan.
pub(crate) struct Structure {
    /// Micro-batches per stage: the stride of [`Structure::key`].
    pub m: usize,
    /// `seen[key]`: the [`bit`]s of the actions that exist for that (stage, micro-batch).
    pub seen: Vec<u8>,
    /// True when the plan holds any SEND/RECV (it is then held to the lowered rules).
    pub lowered: bool,
}

impl Structure {
    pub fn key(&self, stage: u32, microbatch: u32) -> usize {
        stage as usize * self.m + microbatch as usize
    }
}

/// Rule 1, and rule 2's "never twice": shape, ranges, placement, duplicates, and that
/// every SEND/RECV crosses ranks.
pub(crate) fn check_structure(plan: &Plan) -> Result<Structure> {
    check_shape(plan)?;
    check_placement(plan)?;
    let s_count = plan.stages;
    let m = plan.microbatches;
    let mut st = Structure {
        m,
        seen: vec![0; s_count * m],
        lowered: false,
    };
    for (rank, step, action) in plan.iter() {
        for part in action.parts() {
            let (s, mb) = (part.stage, part.microbatch);
            let owner = plan.stage_rank[s as usize];
            if owner != rank {
                return Err(invalid(
                    rank,
                    step,
                    format!("{action} runs stage {s}, which is placed on rank {owner}"),
                ));
            }
            if part.kind.is_comm() {
                check_link(plan, rank, step, &part)?;
                st.lowered = true;
            }
            let k = st.key(s, mb);
            let b = bit::of(part.kind);
            let seen = st.seen[k];
            if seen & b != 0 {
                return Err(invalid(
                    rank,
                    step,
                    format!(
                        "{action} repeats {} of stage {s}, micro-batch {mb} (each runs exactly once)",
                        describe(part.kind)
                    ),
                ));
            }
            // A backward is I + W or a full B, never both.
            let clash = match b {
                bit::I | bit::W => seen & bit::B,
                bit::B => seen & (bit::I | bit::W),
                _ => 0,
            };
            if clash != 0 {
                let other = if clash & bit::I != 0 {
                    "an I"
                } else if clash & bit::W != 0 {
                    "a W"
                } else {
                    "a full backward (B)"
                };
                return Err(invalid(
                    rank,
                    step,
                    format!(
                        "{action}: stage {s}, micro-batch {mb} already has {other}; \
                         a backward is I + W or one B, not both"
                    ),
                ));
            }
            st.seen[k] = seen | b;
        }
    }
    Ok(st)
}

fn describe(kind: ActionKind) -> &'static str {
    match kind {
        ActionKind::F => "the forward",
        ActionKind::I => "the input-gradient backward (I)",
        ActionKind::W => "the weight-gradient backward (W)",
        ActionKind::B | ActionKind::OverlapFB => "the full backward (B)",
        ActionKind::SendF => "the SEND_F",
        ActionKind::RecvF => "the RECV_F",
        ActionKind::SendB => "the SEND_B",
        ActionKind::RecvB => "the RECV_B",
    }
}

/// The plan's own tables: at least one rank, a stage → rank entry per stage, consistent
/// with the named placement.
fn check_shape(plan: &Plan) -> Result<()> {
    let ranks = plan.num_ranks();
    if ranks == 0 {
        return Err(ScheduleError::Plan("a plan needs at least one rank".into()));
    }
    if plan.stage_rank.len() != plan.stages {
        return Err(ScheduleError::Plan(format!(
            "the stage → rank table lists {} stages but the plan has {}",
            plan.stage_rank.len(),
            plan.stages
        )));
    }
    // Every (stage, micro-batch) needs a forward; when there are fewer actions than that,
    // say so before sizing per-(stage, micro-batch) tables by an absurd product.
    let actions: usize = plan.iter().map(|(_, _, a)| a.parts().count()).sum();
    let keys = plan.stages.checked_mul(plan.microbatches);
    if keys.is_none_or(|k| k > actions) {
        return Err(ScheduleError::Plan(format!(
            "{} stages × {} micro-batches need a forward each, but the plan holds only \
             {actions} actions",
            plan.stages, plan.microbatches
        )));
    }
    if let Err(reason) = plan.placement.check(ranks, plan.stages) {
        return Err(ScheduleError::Plan(format!(
            "placement {}: {reason}",
            plan.placement.name()
        )));
    }
    let expected = plan.placement.stage_ranks(ranks, plan.stages);
    if let Some(s) = (0..plan.stages).find(|&s| expected[s] != plan.stage_rank[s]) {
        return Err(ScheduleError::Plan(format!(
            "the stage → rank table puts stage {s} on rank {}, but the {} placement puts it on rank {}",
            plan.stage_rank[s],
            plan.placement.name(),
            expected[s]
        )));
    }
    Ok(())
}

/// Every action names an existing stage and micro-batch, and each stage's actions are
/// all on one rank.
fn check_placement(plan: &Plan) -> Result<()> {
    const NONE: usize = usize::MAX;
    let mut first_rank = vec![NONE; plan.stages];
    for (rank, step, action) in plan.iter() {
        for part in action.parts() {
            let (s, mb) = (part.stage as usize, part.microbatch as usize);
            if s >= plan.stages {
                return Err(invalid(
                    rank,
                    step,
                    format!(
                        "{action} names stage {s}, but the plan has {} stages",
                        plan.stages
                    ),
                ));
            }
            if mb >= plan.microbatches {
                return Err(invalid(
                    rank,
                    step,
                    format!(
                        "{action} names micro-batch {mb}, but the plan has {} micro-batches",
                        plan.microbatches
                    ),
                ));
            }
            match first_rank[s] {
                NONE => first_rank[s] = rank,
                r if r != rank => {
                    return Err(ScheduleError::Plan(format!(
                        "stage {s} is placed on ranks {r} and {rank}"
                    )));
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// A SEND/RECV must connect its stage to a neighbour stage on another rank.
fn check_link(plan: &Plan, rank: usize, step: usize, a: &Action) -> Result<()> {
    let s = a.stage as usize;
    let (peer, dir) = match a.kind {
        ActionKind::SendF | ActionKind::RecvB => (s + 1, "next"),
        _ => (s.wrapping_sub(1), "previous"),
    };
    if peer >= plan.stages {
        return Err(invalid(
            rank,
            step,
            format!("{a}: stage {s} has no {dir} stage to exchange with"),
        ));
    }
    if plan.stage_rank[peer] == rank {
        return Err(invalid(
            rank,
            step,
            format!(
                "{a}: the {dir} stage {peer} is on the same rank, which hands tensors over \
                 locally (no SEND/RECV)"
            ),
        ));
    }
    Ok(())
}

/// Rule 2's "at least once": every (stage, micro-batch) has its forward and its backward,
/// and in a lowered plan every cross-rank hand-over has both its SEND and its RECV.
pub(crate) fn check_complete(plan: &Plan, st: &Structure) -> Result<()> {
    for s in 0..plan.stages as u32 {
        for mb in 0..plan.microbatches as u32 {
            let seen = st.seen[st.key(s, mb)];
            let missing = if seen & bit::F == 0 {
                "has no forward"
            } else if seen & bit::BWD == 0 {
                if seen & bit::W != 0 {
                    "has a W but no I"
                } else {
                    "has no backward (I and W, or B)"
                }
            } else if seen & bit::I != 0 && seen & bit::W == 0 {
                "has an I but no W"
            } else {
                continue;
            };
            return Err(ScheduleError::Plan(format!(
                "stage {s}, micro-batch {mb} {missing}"
            )));
        }
    }
    if st.lowered {
        check_comm_pairs(plan, st)?;
    }
    Ok(())
}

/// Each cross-rank hand-over (s → s+1 forward, s+1 → s backward) has its SEND and RECV.
fn check_comm_pairs(plan: &Plan, st: &Structure) -> Result<()> {
    for s in 0..plan.stages.saturating_sub(1) as u32 {
        let (lo, hi) = (plan.rank_of(s), plan.rank_of(s + 1));
        if lo == hi {
            continue;
        }
        for mb in 0..plan.microbatches as u32 {
            let (k_lo, k_hi) = (st.key(s, mb), st.key(s + 1, mb));
            let pairs = [
                (
                    Action::new(ActionKind::SendF, s, mb),
                    st.seen[k_lo] & bit::SEND_F != 0,
                    Action::new(ActionKind::RecvF, s + 1, mb),
                    st.seen[k_hi] & bit::RECV_F != 0,
                    "forward",
                ),
                (
                    Action::new(ActionKind::SendB, s + 1, mb),
                    st.seen[k_hi] & bit::SEND_B != 0,
                    Action::new(ActionKind::RecvB, s, mb),
                    st.seen[k_lo] & bit::RECV_B != 0,
                    "backward",
                ),
            ];
            for (send, has_send, recv, has_recv, dir) in pairs {
                let (from, to) = (plan.rank_of(send.stage), plan.rank_of(recv.stage));
                match (has_send, has_recv) {
                    (true, true) => {}
                    (true, false) => return Err(unmatched(plan, send, recv, to)),
                    (false, true) => return Err(unmatched(plan, recv, send, from)),
                    (false, false) => {
                        return Err(ScheduleError::Plan(format!(
                            "stage {}, micro-batch {mb}: the {dir} hand-over to stage {} \
                             (rank {from} → rank {to}) has no {send} / {recv}",
                            send.stage, recv.stage
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

/// "rank 0, step 5: 0SEND_F3 has no matching 1RECV_F3 on rank 1" (found by a rescan:
/// this is the error path only).
fn unmatched(plan: &Plan, present: Action, missing: Action, missing_rank: usize) -> ScheduleError {
    let rule = format!("{present} has no matching {missing} on rank {missing_rank}");
    match plan.iter().find(|(_, _, a)| **a == present) {
        Some((rank, step, _)) => invalid(rank, step, rule),
        None => ScheduleError::Plan(rule),
    }
}
