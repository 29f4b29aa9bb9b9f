//! The greedy list scheduler the auto-scheduler starts from (the zero-bubble paper's
//! heuristic, section 4.1, generalised to any placement and per-stage costs).
//!
//! Time is simulated as the plan is built: every rank, when it becomes free, picks among
//! the actions whose inputs have arrived:
//! - an input-gradient backward `I` (someone upstream waits for it), unless [`Knobs::f_first`];
//! - a `W` when more than [`Knobs::keep`] are pending on the rank (ZB-H1 keeps `r`, ZB-H2 `2r`);
//! - a forward `F`, as long as the rank's memory and its warm-up depth ([`Knobs::depth`],
//!   micro-batches between their first F and last I on the rank) allow: "as many F as
//!   memory allows in warm-up", then 1F-1I once input-gradients flow;
//! - a pending `W` when nothing else is ready and the next known input is at least
//!   [`Knobs::gap`]` · T_W` away (or unknown), or when memory blocks a ready forward.
//!
//! On each stage, forwards and input-gradient backwards run in micro-batch order and W's
//! run in the order of their I's, which keeps the search space to the interleaving.
//!
//! Memory is the validator's accounting ([`crate::memory`]). A micro-batch *enters* a rank
//! with the forward of the rank's lowest stage; it may enter only if the rank can still
//! stash the forwards of every micro-batch already inside (on its other stages), and, when
//! an I keeps more for W than its forward held (recomputation, `m_w > m_b`), what every
//! I still to run will add: so a
//! rank never fills its memory with first-chunk forwards and starves the later chunks that
//! would free it, and the scheduler cannot deadlock once the limit holds one micro-batch's
//! forwards on every stage of a rank.
//!
//! Each action starts as soon as the rank is free and its inputs are there, which is how
//! the simulator times a rank's list: the plan's simulated timeline is the one built here.

use crate::action::{Action, ActionKind};
use crate::plan::Plan;
use crate::timeline::CostModel;

/// Not yet produced, or not known yet.
const UNKNOWN: f64 = f64::INFINITY;

/// The decisions the greedy scheduler leaves open; the search tries many.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Knobs {
    /// Per rank: most micro-batches inside the rank at once (its warm-up depth).
    pub depth: Vec<usize>,
    /// Per rank: pending W's a rank may hold back before one runs ahead of its next forward.
    pub keep: Vec<usize>,
    /// A W goes into an idle gap only if the next known input is this many T_W away.
    pub gap: f64,
    /// A ready forward goes before a ready input-gradient backward.
    pub f_first: bool,
    /// Among ready forwards of several stages, the deepest stage first (depth-first);
    /// otherwise the shallowest (breadth-first).
    pub deep_first: bool,
}

/// One rank's state while the plan is built.
struct Rank {
    /// The rank's stages, ascending; `stages[0]` is where micro-batches enter.
    stages: Vec<u32>,
    /// Per local stage: the next micro-batch to run F on, and I on.
    next_f: Vec<usize>,
    next_i: Vec<usize>,
    /// I's whose W has not run, oldest first (stage, micro-batch).
    pending_w: std::collections::VecDeque<(u32, u32)>,
    clock: f64,
    /// When the rank next decides (`UNKNOWN` while it waits for an input nobody produced).
    next_event: f64,
    held: f64,
    /// Micro-batches between their entry and their last I on this rank.
    inside: usize,
    /// Forwards still owed on this rank by the micro-batches inside.
    owed: usize,
    /// Forwards run on this rank whose I has not run yet.
    awaiting_i: usize,
    left: usize,
}

/// Builds a compute-only plan for `plan_shape` (an empty plan carrying the shape and the
/// placement) under `cost`, with at most `limit` activation memory per rank.
///
/// `None` if the scheduler gets stuck, which the memory precondition checked by the caller
/// rules out; the caller treats it as "these knobs give no plan".
pub(crate) fn schedule(
    plan_shape: &Plan,
    cost: &CostModel,
    limit: f64,
    knobs: &Knobs,
) -> Option<Plan> {
    let mut plan = plan_shape.clone();
    let (stages, m) = (plan.stages, plan.microbatches);
    let p = plan.num_ranks();
    let last = stages as u32 - 1;
    let idx = |s: u32, mb: usize| mb * stages + s as usize;
    let link = |a: u32, b: u32| {
        if plan_shape.rank_of(a) == plan_shape.rank_of(b) {
            0.0
        } else {
            cost.comm
        }
    };
    let mut f_end = vec![UNKNOWN; stages * m];
    let mut i_end = vec![UNKNOWN; stages * m];
    let mut ranks: Vec<Rank> = (0..p)
        .map(|r| {
            let own = plan_shape.stages_of(r);
            let v = own.len();
            Rank {
                next_f: vec![0; v],
                next_i: vec![0; v],
                pending_w: Default::default(),
                clock: 0.0,
                next_event: 0.0,
                held: 0.0,
                inside: 0,
                owed: 0,
                awaiting_i: 0,
                left: 3 * v * m,
                stages: own,
            }
        })
        .collect();
    // A tolerance for comparing times and memory sums built from the same numbers.
    let eps = 1e-9;
    // What an I adds to the memory held when it keeps more for W than the forward held
    // (recomputation): reserved when a micro-batch enters, with its forwards.
    let grow = (cost.m_w - cost.m_b).max(0.0);

    loop {
        let Some(r) = (0..p)
            .filter(|&r| ranks[r].left > 0)
            .min_by(|&a, &b| ranks[a].next_event.total_cmp(&ranks[b].next_event))
        else {
            return Some(plan);
        };
        let t = ranks[r].next_event;
        if t == UNKNOWN {
            return None;
        }
        let rank = &ranks[r];
        // When each local stage's next F and I could start (UNKNOWN if their input is not
        // produced yet), and whether the F is allowed by memory and depth.
        let mut ready_i: Option<(f64, usize)> = None;
        let mut ready_f: Option<(f64, usize)> = None;
        let mut f_blocked_by_memory = false;
        let mut next_known = UNKNOWN;
        for (c, &s) in rank.stages.iter().enumerate() {
            let mb = rank.next_i[c];
            if mb < rank.next_f[c] {
                let own = f_end[idx(s, mb)];
                let grad = if s == last {
                    0.0
                } else {
                    i_end[idx(s + 1, mb)] + link(s + 1, s)
                };
                let at = own.max(grad);
                next_known = next_known.min(at);
                // Ties go to the deepest stage: its gradient is the one upstream needs next.
                if at <= t + eps && ready_i.is_none_or(|(a, _)| at <= a + eps) {
                    ready_i = Some((at, c));
                }
            }
            let mb = rank.next_f[c];
            if mb < m {
                let at = if s == 0 {
                    0.0
                } else {
                    f_end[idx(s - 1, mb)] + link(s - 1, s)
                };
                let entry = c == 0;
                let room = if entry {
                    let v = rank.stages.len();
                    rank.held
                        + (cost.m_b + grow) * (v + rank.owed) as f64
                        + grow * rank.awaiting_i as f64
                        <= limit + eps
                } else {
                    true
                };
                let deep_enough = !entry || rank.inside < knobs.depth[r];
                if room && deep_enough {
                    next_known = next_known.min(at);
                    if at <= t + eps {
                        let better = match ready_f {
                            None => true,
                            Some(_) => knobs.deep_first,
                        };
                        if better {
                            ready_f = Some((at, c));
                        }
                    }
                } else if !room && at <= t + eps {
                    f_blocked_by_memory = true;
                }
            }
        }
        let w_forced = rank.pending_w.len() > knobs.keep[r];
        let has_w = !rank.pending_w.is_empty();
        let w_fits_gap = |next: f64| {
            rank.pending_w.front().is_some_and(|&(s, mb)| {
                let dur = cost.duration(r, &Action::w(s, mb));
                next == UNKNOWN || next - t >= knobs.gap * dur - eps
            })
        };
        let pick = match (ready_i, ready_f) {
            (_, Some((_, c))) if knobs.f_first && !w_forced => Some((ActionKind::F, c)),
            (Some((_, c)), _) => Some((ActionKind::I, c)),
            _ if w_forced => Some((ActionKind::W, 0)),
            (None, Some((_, c))) => Some((ActionKind::F, c)),
            (None, None) if has_w && (f_blocked_by_memory || w_fits_gap(next_known)) => {
                Some((ActionKind::W, 0))
            }
            (None, None) => None,
        };
        let Some((kind, c)) = pick else {
            ranks[r].next_event = next_known.max(ranks[r].clock);
            if ranks[r].next_event <= t {
                // Nothing runnable although an input is known: only memory can block it, and
                // no W is left to free any; the limit is too tight for these knobs.
                return None;
            }
            continue;
        };

        let rank = &mut ranks[r];
        let action = match kind {
            ActionKind::F => Action::f(rank.stages[c], rank.next_f[c] as u32),
            ActionKind::I => Action::i(rank.stages[c], rank.next_i[c] as u32),
            _ => {
                let (s, mb) = rank.pending_w.pop_front()?;
                Action::w(s, mb)
            }
        };
        let end = t + cost.duration(r, &action);
        let (s, mb) = (action.stage, action.microbatch as usize);
        let v = rank.stages.len();
        match kind {
            ActionKind::F => {
                rank.next_f[c] += 1;
                rank.held += cost.m_b;
                rank.awaiting_i += 1;
                if c == 0 {
                    rank.inside += 1;
                    rank.owed += v - 1;
                } else {
                    rank.owed -= 1;
                }
                f_end[idx(s, mb)] = end;
            }
            ActionKind::I => {
                rank.next_i[c] += 1;
                rank.held -= cost.m_b - cost.m_w;
                rank.awaiting_i -= 1;
                if c == 0 {
                    rank.inside -= 1;
                }
                rank.pending_w.push_back((s, mb as u32));
                i_end[idx(s, mb)] = end;
            }
            _ => rank.held -= cost.m_w,
        }
        rank.clock = end;
        rank.next_event = end;
        rank.left -= 1;
        plan.push(r, action);
        // Wake the neighbour that consumes what was produced, at its arrival.
        let consumer = match kind {
            ActionKind::F if s < last => Some((s + 1, end + link(s, s + 1))),
            ActionKind::I if s > 0 => Some((s - 1, end + link(s, s - 1))),
            _ => None,
        };
        if let Some((to, arrival)) = consumer {
            let q = plan_shape.rank_of(to);
            if q != r {
                let other = &mut ranks[q];
                other.next_event = other.next_event.min(arrival.max(other.clock));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Placement;
    use crate::{peak_memory, simulate, validate::ValidateOptions};

    fn knobs(p: usize, depth: usize, keep: usize) -> Knobs {
        Knobs {
            depth: vec![depth; p],
            keep: vec![keep; p],
            gap: 1.0,
            f_first: false,
            deep_first: true,
        }
    }

    #[test]
    fn builds_valid_plans_within_the_limit_for_every_placement() {
        let cost = CostModel::uniform(1.0, 1.2, 0.8, 0.1);
        for (placement, v) in [
            (Placement::Contiguous, 1),
            (Placement::Looped, 2),
            (Placement::VShape, 2),
            (Placement::Looped, 3),
        ] {
            for limit in [v as f64, 4.0, 8.0] {
                let shape = Plan::new(4, 4 * v, 8, placement.clone());
                let plan = schedule(&shape, &cost, limit, &knobs(4, usize::MAX, usize::MAX))
                    .unwrap_or_else(|| panic!("{placement:?} v={v} limit={limit}: stuck"));
                let opts = ValidateOptions {
                    cost: cost.clone(),
                    memory_limit: Some(limit),
                };
                crate::validate(&plan, &opts)
                    .unwrap_or_else(|e| panic!("{placement:?} v={v} limit={limit}: {e}"));
                assert!(peak_memory(&plan, &cost).iter().all(|&p| p <= limit));
            }
        }
    }

    #[test]
    fn one_microbatch_inside_is_one_f_one_i_per_rank() {
        // Depth 1 and no W held back: every rank runs F, I, W for one micro-batch at a time.
        let cost = CostModel::uniform(1.0, 1.0, 1.0, 0.0);
        let shape = Plan::new(2, 2, 2, Placement::Contiguous);
        let plan = schedule(&shape, &cost, 10.0, &knobs(2, 1, 0)).unwrap();
        let text: Vec<String> = plan.ranks[0]
            .iter()
            .flatten()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(text, ["0F0", "0I0", "0W0", "0F1", "0I1", "0W1"]);
        // Rank 0: F0 [0,1), I0 [3,4) once rank 1's I0 is back, W0, F1 [5,6), I1 [8,9), W1
        // [9,10): micro-batch 1 cannot enter before micro-batch 0's I.
        assert_eq!(simulate(&plan, &cost).unwrap().makespan, 10.0);
    }
}
