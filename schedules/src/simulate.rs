//! The discrete-event simulator: times a plan under a cost model and builds its [`Timeline`].
//!
//! Each rank executes its list in order. A compute action starts when the rank is free and
//! its inputs are ready:
//! - `F(s, mb)` needs `F(s − 1, mb)`;
//! - a backward (`I` or `B`) of `(s, mb)` needs the backward of `(s + 1, mb)` (none on the
//!   last stage) and its own `F(s, mb)`;
//! - `W(s, mb)` needs its `I(s, mb)`;
//! - an overlapped F+B needs both halves' inputs and lasts `T_F + T_B`.
//!
//! An input produced on another rank arrives `cost.comm` after it was produced. In a lowered
//! plan a `SEND` costs nothing and stamps the message with the rank's clock; the matching
//! `RECV` advances the receiver's clock to that stamp plus `cost.comm`.
//!
//! The simulation is dataflow-driven, not a time-stepped loop: a rank runs forward until its
//! next action waits for an input nobody has produced yet, then parks; producing an input
//! wakes the (at most two) ranks that can consume it. Every action is handled a constant
//! number of times, so the cost is O(actions). A plan whose ranks all park before the end
//! cannot make progress and is reported as [`ScheduleError::Deadlock`], naming who waits for
//! what.

use std::collections::VecDeque;

use crate::action::{Action, ActionKind};
use crate::error::{Result, ScheduleError};
use crate::plan::Plan;
use crate::timeline::{CostModel, Span, Timeline};

/// Simulates `plan` (compute-only or lowered) under `cost`.
pub fn simulate(plan: &Plan, cost: &CostModel) -> Result<Timeline> {
    let spans = Sim::new(plan, cost)?.run()?;
    let peak = crate::peak_memory(plan, cost);
    Ok(Timeline::from_spans(plan.num_ranks(), spans, &peak))
}

/// Not yet produced.
const PENDING: f64 = f64::INFINITY;

/// An input a parked rank waits for.
#[derive(Clone, Copy, Debug)]
enum Need {
    Forward(u32, u32),
    Backward(u32, u32),
    SendF(u32, u32),
    SendB(u32, u32),
}

impl Need {
    fn key(self) -> (u32, u32) {
        match self {
            Need::Forward(s, mb)
            | Need::Backward(s, mb)
            | Need::SendF(s, mb)
            | Need::SendB(s, mb) => (s, mb),
        }
    }

    fn describe(self) -> String {
        match self {
            Need::Forward(s, mb) => format!("the forward {s}F{mb}"),
            Need::Backward(s, mb) => {
                format!("the backward (I or B) of stage {s}, micro-batch {mb}")
            }
            Need::SendF(s, mb) => format!("the message {s}SEND_F{mb}"),
            Need::SendB(s, mb) => format!("the message {s}SEND_B{mb}"),
        }
    }
}

struct Sim<'a> {
    plan: &'a Plan,
    cost: &'a CostModel,
    stages: usize,
    /// End time of each (stage, micro-batch)'s forward and backward (I or B), and the
    /// stamps of its SEND_F and SEND_B; [`PENDING`] until produced. The message tables stay
    /// empty until the first SEND (a compute-only plan never pays for them).
    f_end: Vec<f64>,
    b_end: Vec<f64>,
    send_f: Vec<f64>,
    send_b: Vec<f64>,
    pos: Vec<usize>,
    clock: Vec<f64>,
    /// What each parked rank waits for (`None` while runnable or finished).
    parked: Vec<Option<Need>>,
    queue: VecDeque<usize>,
    /// Start and end of every compute action, rank by rank in list order: rank `r`'s
    /// `k`-th compute action is at `first[r] + k` (`first` spaces ranks by their list
    /// lengths). Spans are built from it once at the end, already sorted by rank then start
    /// (so the timeline's sort is a single pass).
    starts: Vec<f64>,
    ends: Vec<f64>,
    first: Vec<usize>,
    done: Vec<usize>,
}

impl<'a> Sim<'a> {
    fn new(plan: &'a Plan, cost: &'a CostModel) -> Result<Self> {
        check_placement(plan)?;
        let cells = plan.stages * plan.microbatches;
        let p = plan.num_ranks();
        // Rank r's compute actions are at most its list's length: reserve that much of
        // `starts`/`ends` per rank (untouched slack costs address space, not memory).
        let mut first = Vec::with_capacity(p + 1);
        first.push(0);
        for list in &plan.ranks {
            first.push(first.last().copied().unwrap_or(0) + list.len());
        }
        Ok(Sim {
            plan,
            cost,
            stages: plan.stages,
            f_end: vec![PENDING; cells],
            b_end: vec![PENDING; cells],
            send_f: Vec::new(),
            send_b: Vec::new(),
            pos: vec![0; p],
            clock: vec![0.0; p],
            parked: vec![None; p],
            queue: (0..p).collect(),
            // Zeroed allocations: pages are only touched where a span is written.
            starts: vec![0.0; first[p]],
            ends: vec![0.0; first[p]],
            done: first[..p].to_vec(),
            first,
        })
    }

    /// Micro-batch-major: the stages of one micro-batch are adjacent, and the micro-batches
    /// in flight at any moment form a small window, so lookups stay in cache.
    fn idx(&self, stage: u32, mb: u32) -> usize {
        mb as usize * self.stages + stage as usize
    }

    /// Latency between the ranks of two stages: `comm` across ranks, nothing within one.
    fn link(&self, from: u32, to: u32) -> f64 {
        if self.plan.rank_of(from) == self.plan.rank_of(to) {
            0.0
        } else {
            self.cost.comm
        }
    }

    fn run(mut self) -> Result<Vec<Span>> {
        while let Some(r) = self.queue.pop_front() {
            self.advance(r)?;
        }
        let stuck: Vec<String> = (0..self.plan.num_ranks())
            .filter_map(|r| {
                let need = self.parked[r]?;
                let step = self.pos[r];
                let action = self.plan.ranks[r][step]?;
                Some(format!(
                    "rank {r} waits at step {step} ({action}) for {}",
                    need.describe()
                ))
            })
            .collect();
        if stuck.is_empty() {
            let total = (0..self.done.len())
                .map(|r| self.done[r] - self.first[r])
                .sum();
            let mut spans = Vec::with_capacity(total);
            for (rank, list) in self.plan.ranks.iter().enumerate() {
                let compute = list.iter().flatten().filter(|a| a.kind.is_compute());
                let at = self.first[rank];
                spans.extend(compute.enumerate().map(|(k, &action)| Span {
                    rank,
                    start: self.starts[at + k],
                    end: self.ends[at + k],
                    action,
                }));
            }
            return Ok(spans);
        }
        let shown = stuck.len().min(8);
        let more = match stuck.len() - shown {
            0 => String::new(),
            n => format!("; and {n} more rank(s)"),
        };
        Err(ScheduleError::Deadlock(format!(
            "no rank can make progress: {}{more}",
            stuck[..shown].join("; ")
        )))
    }

    /// Runs rank `r` until it finishes or parks on a missing input.
    fn advance(&mut self, r: usize) -> Result<()> {
        self.parked[r] = None;
        while let Some(cell) = self.plan.ranks[r].get(self.pos[r]) {
            let Some(action) = *cell else {
                self.pos[r] += 1; // an idle step: no time of its own in the simulation
                continue;
            };
            check_action(self.plan, r, self.pos[r], &action)?;
            match self.ready_at(&action) {
                Ok(ready) => self.execute(r, action, ready)?,
                Err(need) => {
                    self.parked[r] = Some(need);
                    return Ok(());
                }
            }
            self.pos[r] += 1;
        }
        Ok(())
    }

    /// When `action`'s inputs are all available, or the first input still missing.
    fn ready_at(&self, action: &Action) -> Result<f64, Need> {
        let (s, mb) = (action.stage, action.microbatch);
        let got = |table: &[f64], need: Need, lat: f64| {
            let (s, mb) = need.key();
            match table.get(self.idx(s, mb)) {
                Some(&t) if t != PENDING => Ok(t + lat),
                _ => Err(need),
            }
        };
        let last = self.plan.stages as u32 - 1;
        let compute_inputs = |a: Action| -> Result<f64, Need> {
            let (s, mb) = (a.stage, a.microbatch);
            match a.kind {
                ActionKind::F if s == 0 => Ok(0.0),
                ActionKind::F => got(&self.f_end, Need::Forward(s - 1, mb), self.link(s - 1, s)),
                ActionKind::I | ActionKind::B => {
                    let own = got(&self.f_end, Need::Forward(s, mb), 0.0)?;
                    if s == last {
                        return Ok(own);
                    }
                    let grad = got(&self.b_end, Need::Backward(s + 1, mb), self.link(s + 1, s))?;
                    Ok(own.max(grad))
                }
                ActionKind::W => got(&self.b_end, Need::Backward(s, mb), 0.0),
                _ => Ok(0.0),
            }
        };
        match action.kind {
            ActionKind::SendF => got(&self.f_end, Need::Forward(s, mb), 0.0),
            ActionKind::SendB => got(&self.b_end, Need::Backward(s, mb), 0.0),
            ActionKind::RecvF => got(&self.send_f, Need::SendF(s - 1, mb), self.link(s - 1, s)),
            ActionKind::RecvB => got(&self.send_b, Need::SendB(s + 1, mb), self.link(s + 1, s)),
            ActionKind::OverlapFB => action
                .parts()
                .try_fold(0.0f64, |t, part| Ok(t.max(compute_inputs(part)?))),
            _ => compute_inputs(*action),
        }
    }

    /// Runs `action` on rank `r`, its inputs available from `ready`, and wakes its consumers.
    fn execute(&mut self, r: usize, action: Action, ready: f64) -> Result<()> {
        let (s, mb) = (action.stage, action.microbatch);
        let start = self.clock[r].max(ready);
        self.check_time(r, &action, start)?;
        match action.kind {
            ActionKind::SendF | ActionKind::SendB => {
                let cells = self.stages * self.plan.microbatches;
                let at = self.idx(s, mb);
                let (table, to) = if action.kind == ActionKind::SendF {
                    (&mut self.send_f, s + 1)
                } else {
                    (&mut self.send_b, s.wrapping_sub(1))
                };
                if table.is_empty() {
                    table.resize(cells, PENDING);
                }
                record(table, at, start, r, &action)?;
                self.clock[r] = start;
                self.wake(to);
            }
            ActionKind::RecvF | ActionKind::RecvB => self.clock[r] = start,
            _ => {
                let end = start + self.cost.duration(r, &action);
                self.check_time(r, &action, end)?;
                for part in action.parts() {
                    let at = self.idx(part.stage, part.microbatch);
                    match part.kind {
                        ActionKind::F => {
                            record(&mut self.f_end, at, end, r, &action)?;
                            self.wake(part.stage + 1);
                        }
                        ActionKind::I | ActionKind::B => {
                            record(&mut self.b_end, at, end, r, &action)?;
                            self.wake(part.stage.wrapping_sub(1));
                        }
                        _ => {}
                    }
                }
                self.clock[r] = end;
                self.starts[self.done[r]] = start;
                self.ends[self.done[r]] = end;
                self.done[r] += 1;
            }
        }
        Ok(())
    }

    /// A time past the largest `f64` would read as "not produced yet" ([`PENDING`]) and
    /// the plan as deadlocked: it is an overflow of the costs, named as such.
    fn check_time(&self, r: usize, action: &Action, time: f64) -> Result<()> {
        if time.is_finite() {
            return Ok(());
        }
        Err(ScheduleError::TimeOverflow {
            rank: r,
            step: self.pos[r],
            action: action.to_string(),
        })
    }

    /// Makes the rank holding `stage` runnable again if it is parked (no-op for a stage
    /// outside the pipeline, e.g. "stage − 1" of stage 0).
    fn wake(&mut self, stage: u32) {
        if let Some(&r) = self.plan.stage_rank.get(stage as usize)
            && self.parked[r].is_some()
        {
            self.parked[r] = None;
            self.queue.push_back(r);
        }
    }
}

/// Stores a production time, refusing a second production of the same thing.
fn record(table: &mut [f64], at: usize, time: f64, rank: usize, action: &Action) -> Result<()> {
    if table[at] != PENDING {
        return Err(ScheduleError::Invalid {
            at: format!("rank {rank}, action {action}"),
            rule: "this (stage, micro-batch) was already produced by an earlier action".into(),
        });
    }
    table[at] = time;
    Ok(())
}

fn invalid(at: String, rule: String) -> Result<()> {
    Err(ScheduleError::Invalid { at, rule })
}

/// Rejects a stage → rank table that does not match the plan.
fn check_placement(plan: &Plan) -> Result<()> {
    let p = plan.num_ranks();
    if plan.stages == 0 || p == 0 {
        return invalid(
            "plan".into(),
            "needs at least one rank and one stage".into(),
        );
    }
    if plan.stage_rank.len() != plan.stages {
        return invalid(
            "plan".into(),
            format!(
                "stage → rank table lists {} stages but the plan has {}",
                plan.stage_rank.len(),
                plan.stages
            ),
        );
    }
    match plan.stage_rank.iter().enumerate().find(|(_, r)| **r >= p) {
        Some((s, r)) => invalid(
            format!("stage {s}"),
            format!("placed on rank {r}, but the plan has {p} ranks"),
        ),
        None => Ok(()),
    }
}

/// Rejects an action the simulation cannot interpret: a stage or micro-batch outside the
/// plan, a stage the rank does not hold, or a message with no neighbouring stage. Checked
/// as each action is reached, so a valid plan pays one pass of cheap comparisons.
fn check_action(plan: &Plan, r: usize, step: usize, action: &Action) -> Result<()> {
    let check = |part: Action| {
        let at = || format!("rank {r}, step {step} ({action})");
        if part.stage as usize >= plan.stages {
            return invalid(
                at(),
                format!("stage {} is outside 0..{}", part.stage, plan.stages),
            );
        }
        if part.microbatch as usize >= plan.microbatches {
            let m = plan.microbatches;
            return invalid(
                at(),
                format!("micro-batch {} is outside 0..{m}", part.microbatch),
            );
        }
        let holder = plan.rank_of(part.stage);
        if holder != r {
            return invalid(at(), format!("stage {} lives on rank {holder}", part.stage));
        }
        let has_neighbour = match part.kind {
            ActionKind::SendF | ActionKind::RecvB => part.stage as usize + 1 < plan.stages,
            ActionKind::RecvF | ActionKind::SendB => part.stage > 0,
            _ => true,
        };
        if !has_neighbour {
            return invalid(
                at(),
                "this message has no neighbouring stage to go to or come from".into(),
            );
        }
        Ok(())
    };
    match action.kind {
        ActionKind::OverlapFB => action.parts().try_for_each(check),
        _ => check(*action),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::StageMb;
    use crate::generators::{ScheduleKind, generate};
    use crate::plan::Placement;

    fn plan_of(ranks: usize, stages: usize, m: usize, lists: &[&[&str]]) -> Plan {
        let placement = if stages == ranks {
            Placement::Contiguous
        } else {
            Placement::Custom((0..stages).map(|s| s * ranks / stages).collect())
        };
        let mut plan = Plan::new(ranks, stages, m, placement);
        for (r, list) in lists.iter().enumerate() {
            plan.ranks[r] = list
                .iter()
                .map(|t| (!t.is_empty()).then(|| t.parse::<Action>().unwrap()))
                .collect();
        }
        plan
    }

    fn times(t: &Timeline, rank: usize) -> Vec<(String, f64, f64)> {
        t.spans
            .iter()
            .filter(|s| s.rank == rank)
            .map(|s| (s.action.to_string(), s.start, s.end))
            .collect()
    }

    #[test]
    fn one_f_one_b_two_ranks_exact_timeline() {
        let plan = generate(ScheduleKind::OneFOneB, 2, 3, 1).unwrap();
        let t = simulate(&plan, &CostModel::uniform(1.0, 1.0, 1.0, 0.0)).unwrap();
        let s = |a: &str, b, c| (a.to_string(), b, c);
        assert_eq!(
            times(&t, 0),
            [
                s("0F0", 0.0, 1.0),
                s("0F1", 1.0, 2.0),
                s("0B0", 4.0, 6.0),
                s("0F2", 6.0, 7.0),
                s("0B1", 7.0, 9.0),
                s("0B2", 10.0, 12.0),
            ]
        );
        assert_eq!(
            times(&t, 1),
            [
                s("1F0", 1.0, 2.0),
                s("1B0", 2.0, 4.0),
                s("1F1", 4.0, 5.0),
                s("1B1", 5.0, 7.0),
                s("1F2", 7.0, 8.0),
                s("1B2", 8.0, 10.0),
            ]
        );
        // (m + p − 1)(T_F + T_B) and 1F1B's peak: p − r micro-batches on rank r.
        assert_eq!(t.makespan, 12.0);
        assert_eq!(t.ranks[0].peak_memory, 2.0);
        assert_eq!(t.ranks[1].peak_memory, 1.0);
    }

    #[test]
    fn link_latency_delays_cross_rank_inputs_only() {
        let plan = plan_of(2, 2, 1, &[&["0F0", "0B0"], &["1F0", "1B0"]]);
        let t = simulate(&plan, &CostModel::uniform(1.0, 1.0, 1.0, 0.5)).unwrap();
        let starts: Vec<_> = t.spans.iter().map(|s| (s.rank, s.start, s.end)).collect();
        assert_eq!(
            starts,
            [(0, 0.0, 1.0), (0, 5.0, 7.0), (1, 1.5, 2.5), (1, 2.5, 4.5)]
        );
        // Two stages on one rank: no latency between them.
        let local = plan_of(1, 2, 1, &[&["0F0", "1F0", "1B0", "0B0"]]);
        let t = simulate(&local, &CostModel::uniform(1.0, 1.0, 1.0, 0.5)).unwrap();
        assert_eq!(t.makespan, 6.0);
    }

    #[test]
    fn lowered_plan_times_like_its_compute_only_form() {
        let lowered = plan_of(
            2,
            2,
            1,
            &[
                &["0F0", "0SEND_F0", "0RECV_B0", "0B0"],
                &["1RECV_F0", "1F0", "1B0", "1SEND_B0"],
            ],
        );
        let cost = CostModel::uniform(1.0, 1.0, 1.0, 0.5);
        let t = simulate(&lowered, &cost).unwrap();
        let compute = simulate(&lowered.compute_only(), &cost).unwrap();
        assert_eq!(t.spans, compute.spans);
        assert_eq!(t.makespan, 7.0);
    }

    #[test]
    fn a_late_send_delays_the_receiver() {
        // Rank 0 sends its forward only after an unrelated forward of micro-batch 1.
        let plan = plan_of(
            2,
            2,
            2,
            &[
                &["0F0", "0F1", "0SEND_F0", "0SEND_F1"],
                &["1RECV_F0", "1F0", "1RECV_F1", "1F1"],
            ],
        );
        let mut plan = plan;
        plan.microbatches = 2;
        let t = simulate(&plan, &CostModel::uniform(1.0, 1.0, 1.0, 0.25)).unwrap();
        assert_eq!(times(&t, 1)[0], ("1F0".to_string(), 2.25, 3.25));
    }

    #[test]
    fn split_backward_and_overlap_durations() {
        let plan = plan_of(1, 1, 2, &[&["0F0", "(0F1;0B0)OVERLAP_F_B", "0I1", "0W1"]]);
        let t = simulate(&plan, &CostModel::uniform(1.0, 2.0, 3.0, 0.0)).unwrap();
        let s = |a: &str, b, c| (a.to_string(), b, c);
        assert_eq!(
            times(&t, 0),
            [
                s("0F0", 0.0, 1.0),
                s("(0F1;0B0)OVERLAP_F_B", 1.0, 7.0),
                s("0I1", 7.0, 9.0),
                s("0W1", 9.0, 12.0),
            ]
        );
        assert_eq!(t.steady_bubble_ratio, 0.0);
    }

    #[test]
    fn rank_speed_scales_durations_and_idle_steps_are_skipped() {
        let mut plan = plan_of(2, 2, 1, &[&["0F0", "", "0B0"], &["", "1F0", "1B0"]]);
        plan.ranks[0].insert(0, None);
        let mut cost = CostModel::uniform(1.0, 1.0, 1.0, 0.0);
        cost.rank_speed = vec![1.0, 2.0];
        let t = simulate(&plan, &cost).unwrap();
        assert_eq!(
            times(&t, 1),
            [("1F0".into(), 1.0, 1.5), ("1B0".into(), 1.5, 2.5)]
        );
        assert_eq!(t.makespan, 4.5);
    }

    #[test]
    fn costs_that_overflow_are_an_overflow_not_a_deadlock() {
        let plan = crate::generate(crate::ScheduleKind::ZbH1, 4, 8, 1).unwrap();
        let huge = CostModel::uniform(1e308, 1e308, 1e308, 0.0);
        let err = simulate(&plan, &huge).unwrap_err();
        assert!(
            matches!(err, ScheduleError::TimeOverflow { rank: 0, .. }),
            "expected an overflow, got {err}"
        );
        assert!(
            err.to_string().contains("the simulated time overflows"),
            "{err}"
        );
        // A latency that overflows the time of a lowered plan's receive is one too.
        let lowered = crate::lower(&plan).unwrap();
        let err = simulate(&lowered, &CostModel::uniform(1.0, 1.0, 1.0, f64::MAX)).unwrap_err();
        assert!(matches!(err, ScheduleError::TimeOverflow { .. }), "{err}");
        // Large but finite costs still simulate.
        let big = CostModel::uniform(1e300, 1e300, 1e300, 0.0);
        assert!(simulate(&plan, &big).unwrap().makespan.is_finite());
    }

    #[test]
    fn circular_wait_is_a_deadlock_naming_the_ranks() {
        // Rank 0 runs its backward before its forward: it waits for rank 1, which waits for it.
        let plan = plan_of(2, 2, 1, &[&["0B0", "0F0"], &["1F0", "1B0"]]);
        let err = simulate(&plan, &CostModel::default()).unwrap_err();
        let ScheduleError::Deadlock(msg) = err else {
            panic!("expected a deadlock, got {err}");
        };
        assert!(msg.contains("rank 0 waits at step 0 (0B0)"), "{msg}");
        assert!(
            msg.contains("rank 1 waits at step 0 (1F0) for the forward 0F0"),
            "{msg}"
        );
    }

    #[test]
    fn a_missing_action_is_a_deadlock_not_a_hang() {
        let plan = plan_of(
            2,
            2,
            2,
            &[&["0F0", "0B0", "0B1"], &["1F0", "1B0", "1F1", "1B1"]],
        );
        let msg = simulate(&plan, &CostModel::default())
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("rank 1 waits at step 2 (1F1) for the forward 0F1"),
            "{msg}"
        );
        // W without its I.
        let plan = plan_of(1, 1, 1, &[&["0F0", "0W0", "0I0"]]);
        let msg = simulate(&plan, &CostModel::default())
            .unwrap_err()
            .to_string();
        assert!(msg.contains("(0W0)"), "{msg}");
    }

    #[test]
    fn malformed_plans_are_invalid() {
        let twice = plan_of(1, 1, 1, &[&["0F0", "0F0", "0B0"]]);
        let err = simulate(&twice, &CostModel::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("already produced"), "{err}");
        let wrong_rank = plan_of(2, 2, 1, &[&["1F0"], &["0F0"]]);
        let err = simulate(&wrong_rank, &CostModel::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 0, step 0 (1F0): stage 1 lives on rank 1"),
            "{err}"
        );
        let out_of_range = plan_of(1, 1, 1, &[&["0F3"]]);
        let err = simulate(&out_of_range, &CostModel::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("micro-batch 3 is outside 0..1"), "{err}");
        let mut overlap = plan_of(1, 1, 1, &[&[]]);
        overlap.ranks[0].push(Some(Action::overlap(
            StageMb {
                stage: 0,
                microbatch: 0,
            },
            StageMb {
                stage: 5,
                microbatch: 0,
            },
        )));
        assert!(simulate(&overlap, &CostModel::default()).is_err());
    }
}
