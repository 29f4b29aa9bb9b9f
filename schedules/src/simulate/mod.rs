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

use std::collections::{HashMap, VecDeque};

use crate::action::{Action, ActionKind};
use crate::error::{Result, ScheduleError};
use crate::plan::Plan;
use crate::timeline::{CostModel, Span, Timeline};

/// Simulates `plan` (compute-only or lowered) under `cost`.
pub fn simulate(plan: &Plan, cost: &CostModel) -> Result<Timeline> {
    timeline(plan, cost, None)
}

/// Simulates `plan` with every compute action lasting what `measured` recorded for it on
/// its rank (`cost` for those it did not record, and for the link latency and memory).
///
/// The exact replay of a run: a runtime whose clock moves only by timed work and waits for
/// inputs (the virtual clock) must reproduce `measured` up to rounding, whatever its
/// actions happened to cost, while a cost model of means smooths one slow action on the
/// critical path away.
pub fn simulate_measured(plan: &Plan, cost: &CostModel, measured: &Timeline) -> Result<Timeline> {
    let durations = measured
        .spans
        .iter()
        .map(|s| ((s.rank, s.action), s.duration()))
        .collect();
    timeline(plan, cost, Some(durations))
}

fn timeline(
    plan: &Plan,
    cost: &CostModel,
    measured: Option<HashMap<(usize, Action), f64>>,
) -> Result<Timeline> {
    let spans = Sim::new(plan, cost, measured)?.run()?;
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
    /// Per (rank, action) durations that replace the cost model's ([`simulate_measured`]).
    measured: Option<HashMap<(usize, Action), f64>>,
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
    fn new(
        plan: &'a Plan,
        cost: &'a CostModel,
        measured: Option<HashMap<(usize, Action), f64>>,
    ) -> Result<Self> {
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
            measured,
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
                let measured = self.measured.as_ref().and_then(|m| m.get(&(r, action)));
                let end = start
                    + measured
                        .copied()
                        .unwrap_or_else(|| self.cost.duration(r, &action));
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
mod tests;
