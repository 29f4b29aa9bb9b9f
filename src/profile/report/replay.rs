//! Step inflation without machine-load noise: a filled run replayed without its fillers.
//!
//! Comparing a filled run with a separate run without fillers mixes what filling cost with
//! how loaded the machine was in each run (the compute actions' thread-CPU costs differ
//! between runs). Under the virtual clock the cost of filling on the critical path is exact
//! instead: take the run's measured actions and optimizer-step work (their own durations),
//! run them again in the order each rank ran them under the virtual clock's rules, and
//! leave the filler spans out. Same work, same costs; each step's makespan differs only by
//! what filling cost the critical path.
//!
//! A rank's virtual clock (`pipefill_actors` `clock.rs`, `stage/walk.rs`, `stage/step.rs`)
//! moves only by timed work and by waits for something another rank produced, so the
//! replay follows every such move, across steps (a rank starts step k+1 where its part of
//! step k ended, so a filler that delayed the end of k shows in k+1):
//! - each rank starts where its first walk began ([`StepWork::Began`]);
//! - a compute action starts when the rank is free and its inputs are there, and lasts its
//!   measured duration. Inputs: `F(s, mb)` needs `F(s − 1, mb)`, a backward (`I`/`B`) of
//!   `(s, mb)` needs the backward of `(s + 1, mb)`; one produced on another rank is there
//!   `link_latency` after it was produced (local ones were produced earlier on the rank);
//! - a SEND stamps the payload with the rank's clock (no time of its own); the matching
//!   RECV completes at `max(clock, stamp + link_latency)`;
//! - the optimizer step's work lies where the rank ran it ([`StepRecord::before`]): the
//!   gradient statistics take their measured time and leave at its end; an exact step
//!   starts once every rank's statistics of that step are there (`link_latency` after they
//!   left another rank) and takes its measured time; a speculative step takes its time, and
//!   the first-stage forwards run after it keep their outputs until the exact step (or
//!   their recomputation after a rollback) releases them.
//!
//! Which way each rank went (stepping at the end of a walk or at the next walk's first
//! compute action, speculating or not) is taken as it was measured; without fillers a
//! different timing could have chosen differently, which the replay does not explore.

use std::collections::HashMap;

use pipefill_actors::{ActionRecord, IterationProfile, StepRecord, StepWork};
use pipefill_schedules::{Action, ActionKind, Timeline};

use crate::profile::ProfileError;

/// What a rank produced that another may wait for, by iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Made {
    Forward(u64, u32, u32),
    Backward(u64, u32, u32),
    SentF(u64, u32, u32),
    SentB(u64, u32, u32),
    /// A rank's gradient statistics of a step.
    Stats(usize, u64),
}

/// One thing a rank did, in the order it did it.
#[derive(Clone, Copy)]
enum Item<'a> {
    Act(usize, &'a ActionRecord),
    Step(&'a StepRecord),
}

impl Item<'_> {
    fn iteration(&self) -> u64 {
        match self {
            Item::Act(_, r) => r.iteration,
            Item::Step(s) => s.iteration,
        }
    }

    fn describe(&self) -> String {
        match self {
            Item::Act(_, r) => r.action.to_string(),
            Item::Step(s) => format!("{:?}", s.work),
        }
    }
}

/// Per rank: its clock, the step it stepped speculatively for (not yet exact) and the
/// outputs held meanwhile with the action that produced them.
struct RankState {
    clock: f64,
    speculative: Option<u64>,
    held: Vec<(Action, Made)>,
}

/// A replay in progress: each rank's items, how far it got, and what has been produced.
struct Replay<'a> {
    lists: Vec<Vec<Item<'a>>>,
    pos: Vec<usize>,
    state: Vec<RankState>,
    /// When each product was there on the rank that made it, and that rank.
    made: HashMap<Made, (f64, usize)>,
    /// The last stage of each iteration (whose forward feeds no one).
    last_stage: HashMap<u64, u32>,
    link_latency: f64,
    out: Vec<ActionRecord>,
}

/// `records` (every rank's actions) and `steps` (every rank's walk starts and
/// optimizer-step work) of consecutive iterations, replayed without fillers under a virtual
/// clock with `link_latency` between ranks: the records with their replayed times, in the
/// order given (`waited` is left as measured: the replay does not split idle time).
pub fn replay(
    records: &[ActionRecord],
    steps: &[StepRecord],
    link_latency: f64,
) -> Result<Vec<ActionRecord>, ProfileError> {
    let mut replay = Replay::new(records, steps, link_latency)?;
    let ranks = replay.lists.len();
    loop {
        let mut progressed = false;
        for rank in 0..ranks {
            while replay.advance(rank) {
                progressed = true;
            }
        }
        let waiting = (0..ranks).find(|&r| replay.pos[r] < replay.lists[r].len());
        let Some(rank) = waiting else {
            return Ok(replay.out);
        };
        if !progressed {
            let item = replay.lists[rank][replay.pos[rank]];
            return Err(ProfileError::Stuck {
                rank,
                iteration: item.iteration(),
                what: item.describe(),
            });
        }
    }
}

impl<'a> Replay<'a> {
    fn new(
        records: &'a [ActionRecord],
        steps: &'a [StepRecord],
        link_latency: f64,
    ) -> Result<Self, ProfileError> {
        let ranks = records
            .iter()
            .map(|r| r.rank + 1)
            .chain(steps.iter().map(|s| s.rank + 1))
            .max()
            .unwrap_or(0);
        // Each rank's items in the order it ran them: its step work before the action it
        // preceded, iterations one after the other (the stable sort keeps the recorded
        // order of step work at one position).
        let mut lists: Vec<Vec<Item>> = vec![Vec::new(); ranks];
        for s in steps {
            lists[s.rank].push(Item::Step(s));
        }
        for (i, r) in records.iter().enumerate() {
            lists[r.rank].push(Item::Act(i, r));
        }
        for list in &mut lists {
            list.sort_by_key(|item| match item {
                Item::Step(s) => (s.iteration, s.before, 0),
                Item::Act(_, r) => (r.iteration, r.index, 1),
            });
        }
        let mut last_stage: HashMap<u64, u32> = HashMap::new();
        for r in records.iter().filter(|r| r.action.kind.is_compute()) {
            for part in r.action.parts() {
                let last = last_stage.entry(r.iteration).or_default();
                *last = (*last).max(part.stage);
            }
        }
        let mut state = Vec::with_capacity(ranks);
        for (rank, list) in lists.iter().enumerate() {
            let began = list.iter().find_map(|item| match item {
                Item::Step(s) if s.work == StepWork::Began => Some(s.start),
                _ => None,
            });
            let clock = match (began, list.is_empty()) {
                (Some(t), _) => t,
                (None, true) => 0.0,
                (None, false) => return Err(ProfileError::NoStart { rank }),
            };
            state.push(RankState {
                clock,
                speculative: None,
                held: Vec::new(),
            });
        }
        Ok(Replay {
            pos: vec![0; ranks],
            lists,
            state,
            made: HashMap::new(),
            last_stage,
            link_latency,
            out: records.to_vec(),
        })
    }

    /// When `key` is there on rank `to` (`None`: not produced yet).
    fn arrival(&self, key: Made, to: usize) -> Option<f64> {
        let &(t, from) = self.made.get(&key)?;
        Some(if from == to { t } else { t + self.link_latency })
    }

    /// Runs rank `rank`'s next item if what it waits for is there; false if it cannot.
    fn advance(&mut self, rank: usize) -> bool {
        let Some(&item) = self.lists[rank].get(self.pos[rank]) else {
            return false;
        };
        let ran = match item {
            Item::Step(s) => self.step_work(rank, s),
            Item::Act(i, r) => self.action(rank, i, r),
        };
        if ran {
            self.pos[rank] += 1;
        }
        ran
    }

    fn step_work(&mut self, rank: usize, s: &StepRecord) -> bool {
        let cost = s.end - s.start;
        match s.work {
            StepWork::Began => {}
            StepWork::Stats { step } => {
                let st = &mut self.state[rank];
                st.clock += cost;
                self.made.insert(Made::Stats(rank, step), (st.clock, rank));
            }
            StepWork::Exact { step } => {
                let ranks = self.lists.len();
                let ready = (0..ranks).try_fold(self.state[rank].clock, |at, from| {
                    Some(at.max(self.arrival(Made::Stats(from, step), rank)?))
                });
                let Some(ready) = ready else { return false };
                let st = &mut self.state[rank];
                st.clock = ready + cost;
                if st.speculative == Some(step) {
                    st.speculative = None;
                    // Held outputs leave now, except those recomputed next.
                    let recomputed: Vec<Action> = self.lists[rank][self.pos[rank] + 1..]
                        .iter()
                        .map_while(|item| match item {
                            Item::Step(StepRecord {
                                work: StepWork::Recompute { action, .. },
                                ..
                            }) => Some(*action),
                            _ => None,
                        })
                        .collect();
                    self.release(rank, |a| !recomputed.contains(&a));
                }
            }
            StepWork::Speculative { step } => {
                let st = &mut self.state[rank];
                st.clock += cost;
                st.speculative = Some(step);
            }
            StepWork::Unchecked { .. } => self.state[rank].clock += cost,
            StepWork::Recompute { action, .. } => {
                self.state[rank].clock += cost;
                self.release(rank, |a| a == action);
            }
        }
        true
    }

    /// Releases the outputs rank `rank` holds from the actions that pass `which`, now.
    fn release(&mut self, rank: usize, which: impl Fn(Action) -> bool) {
        let st = &mut self.state[rank];
        let clock = st.clock;
        let made = &mut self.made;
        st.held.retain(|&(action, key)| {
            if !which(action) {
                return true;
            }
            made.insert(key, (clock, rank));
            false
        });
    }

    fn action(&mut self, rank: usize, i: usize, rec: &ActionRecord) -> bool {
        let (a, it) = (rec.action, rec.iteration);
        let clock = self.state[rank].clock;
        let (start, end) = match a.kind {
            ActionKind::SendF | ActionKind::SendB => {
                let key = match a.kind {
                    ActionKind::SendF => Made::SentF(it, a.stage, a.microbatch),
                    _ => Made::SentB(it, a.stage, a.microbatch),
                };
                self.made.insert(key, (clock, rank));
                (clock, clock)
            }
            // RECV_F of stage s takes SEND_F of s − 1; RECV_B of s, SEND_B of s + 1.
            ActionKind::RecvF | ActionKind::RecvB => {
                let key = match a.kind {
                    ActionKind::RecvF => Made::SentF(it, a.stage.wrapping_sub(1), a.microbatch),
                    _ => Made::SentB(it, a.stage + 1, a.microbatch),
                };
                let Some(arrival) = self.arrival(key, rank) else {
                    return false;
                };
                let t = clock.max(arrival);
                (t, t)
            }
            _ => {
                let last = self.last_stage.get(&it).copied().unwrap_or(0);
                let ready = a.parts().try_fold(clock, |at, part| {
                    let need = match part.kind {
                        ActionKind::F if part.stage > 0 => {
                            Made::Forward(it, part.stage - 1, part.microbatch)
                        }
                        ActionKind::I | ActionKind::B if part.stage < last => {
                            Made::Backward(it, part.stage + 1, part.microbatch)
                        }
                        _ => return Some(at),
                    };
                    Some(at.max(self.arrival(need, rank)?))
                });
                let Some(start) = ready else { return false };
                let end = start + rec.duration();
                let st = &mut self.state[rank];
                for part in a.parts() {
                    let key = match part.kind {
                        ActionKind::F => Made::Forward(it, part.stage, part.microbatch),
                        ActionKind::I | ActionKind::B => {
                            Made::Backward(it, part.stage, part.microbatch)
                        }
                        _ => continue,
                    };
                    // On speculatively stepped weights: the output stays until the step
                    // is exact.
                    if st.speculative.is_some() {
                        st.held.push((a, key));
                    } else {
                        self.made.insert(key, (end, rank));
                    }
                }
                (start, end)
            }
        };
        self.state[rank].clock = end;
        self.out[i].start = start;
        self.out[i].end = end;
        true
    }
}

/// Each iteration's makespan in the replay of `iterations` (consecutive, as the profiler
/// gives them) without fillers: last compute end − first compute start, through
/// [`Timeline::from_spans`] like the measured one.
pub fn replay_makespans(
    iterations: &[IterationProfile],
    link_latency: f64,
) -> Result<Vec<f64>, ProfileError> {
    let records: Vec<ActionRecord> = iterations
        .iter()
        .flat_map(|it| it.records.iter().copied())
        .collect();
    let steps: Vec<StepRecord> = iterations
        .iter()
        .flat_map(|it| it.steps.iter().copied())
        .collect();
    let replayed = replay(&records, &steps, link_latency)?;
    let mut makespans = Vec::with_capacity(iterations.len());
    let mut rest = &replayed[..];
    for it in iterations {
        let (mine, after) = rest.split_at(it.records.len());
        rest = after;
        if !mine.iter().any(|r| r.action.kind.is_compute()) {
            return Err(ProfileError::NoMakespan);
        }
        let spans = mine.iter().map(ActionRecord::span).collect();
        makespans.push(Timeline::from_spans(it.timeline.ranks.len(), spans, &[]).makespan);
    }
    Ok(makespans)
}

/// Step inflation of each iteration: its measured makespan / its makespan in the replay
/// without fillers − 1.
pub fn step_inflations(
    iterations: &[IterationProfile],
    link_latency: f64,
) -> Result<Vec<f64>, ProfileError> {
    let without = replay_makespans(iterations, link_latency)?;
    Ok(iterations
        .iter()
        .zip(without)
        .map(|(it, w)| {
            if w > 0.0 {
                it.timeline.makespan / w - 1.0
            } else {
                0.0
            }
        })
        .collect())
}

#[cfg(test)]
#[path = "replay_tests.rs"]
mod tests;
