//! The planned placement at run time ([`FillMode::Planned`]): the drafter a run trains is a
//! function of the plan, the configs and the step index, not of measured times.
//!
//! - **What runs.** Rank `r` runs, in target step `s`, the slices [`SlicePlan::slices`]`(r, s)`
//!   in order, each sampling only the rows of step `s − 1` (complete on every rank once it has
//!   finished step `s − 1`, whatever rows of step `s` are arriving). The router hands the next
//!   one out in a bubble where its cost fits ([`PlannedSlices`], via
//!   [`pipefill_actors::FillerSource::fixed_size`]); the slices no bubble took run at the
//!   step's end. Where they run changes the step's time, never what they compute: one
//!   replica's slices run one after another on its rank's thread, in the planned order.
//! - **Frozen tables.** A step's slices read the tables deposited at the end of the step
//!   before (when a refresh was due then; otherwise the older ones they already read): the
//!   target's weights after that step, which is what a checkpoint taken there holds, so the
//!   drafter's file need not (see `state.rs`). A replica takes them before its first slice
//!   of the step; a bubble whose rank has not received them yet (posted by the first and
//!   last ranks at their step end) runs no slice, and the step's end waits for them with the
//!   round.
//! - **Rounds.** At the end of step `s` every rank waits until round `s − 1` is complete,
//!   takes its tables if it had not, runs the step's leftover slices, applies that round (its
//!   gradients of every replica, summed in replica order) and posts its gradients of step `s`
//!   as round `s`. In one process round `s − 1` is complete by then: a rank cannot
//!   finish step `s` before every rank has begun it, that is ended step `s − 1`. Across
//!   processes (`pipefill launch`) the other replicas' posts, and step `s − 1`'s rows, travel
//!   on the mesh and may still be on their way, so the wait is real; the last stage's process
//!   sends a step's rows before its post of that step's round, so a complete round `s − 1`
//!   also means the rows its slices sample are in. The wait is bounded (`ROUND_WAIT`) and
//!   ends at once with the exchange's error when a peer is gone ([`DrafterFill::abort`]). A
//!   round with no pair counted is not an update (the version stays).
//! - **Checkpoints.** After step `s` the state is each replica's weights after round `s − 1`,
//!   its sampler as it ended step `s`, round `s` (posted, not applied: the export waits until
//!   it is complete) and the rows of steps up to `s` ([`super::state`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use pipefill_actors::{FillerSource, Slice};

use super::{DrafterFill, Frozen, RoundPost, SLICE_KIND, SlicePlan, lock};
use crate::data::SplitMix64;
use crate::model::ModelChunk;
use crate::model::ModelError;
use crate::model::drafter::DrafterGrads;
use crate::model::drafter::state::RoundState;
use crate::tensor::Backend;

/// How long a rank waits for a round that every rank should have posted already.
const ROUND_WAIT: Duration = Duration::from_secs(300);

/// Where one rank stands in its planned slices.
struct Cursor {
    /// The target step whose slices the rank runs (the step after the last it ended).
    step: u64,
    /// Slices of that step handed out so far.
    next: usize,
    /// The replica's row sampler as it ended its last step (what a checkpoint keeps).
    sampler: SplitMix64,
    /// Whether the replica reads the frozen tables of `step`'s slices.
    tables: bool,
}

/// One step's round: each replica's gradients, by replica, and the copies posted with them.
#[derive(Default)]
struct Round {
    grads: BTreeMap<usize, DrafterGrads>,
    frozen: Frozen,
    applied: usize,
}

/// The planned placement's state (see the module docs).
pub(super) struct Planned {
    slices: SlicePlan,
    /// The target step the run starts at.
    start: u64,
    cursors: Vec<Mutex<Cursor>>,
    rounds: Mutex<BTreeMap<u64, Round>>,
    posted: Condvar,
    /// Why the exchange with the other processes failed: no round will complete.
    failed: OnceLock<String>,
}

impl Planned {
    pub(super) fn new(slices: SlicePlan, start: u64, samplers: Vec<SplitMix64>) -> Self {
        let cursors = samplers
            .into_iter()
            .map(|sampler| {
                Mutex::new(Cursor {
                    step: start,
                    next: 0,
                    sampler,
                    tables: false,
                })
            })
            .collect();
        Planned {
            slices,
            start,
            cursors,
            rounds: Mutex::new(BTreeMap::new()),
            posted: Condvar::new(),
            failed: OnceLock::new(),
        }
    }

    pub(super) fn start(&self) -> u64 {
        self.start
    }

    /// The step a run continuing from now would start at: the step after the last one
    /// every rank ended; in a multi-process run (`local`: this process's replica, the only
    /// one that steps here) the step after the last one the local rank ended.
    pub(super) fn resume_step(&self, local: Option<usize>) -> u64 {
        if let Some(cursor) = local.and_then(|r| self.cursors.get(r)) {
            return lock(cursor).step;
        }
        let steps = self.cursors.iter().map(|c| lock(c).step);
        steps.min().unwrap_or(self.start)
    }

    /// Each replica's sampler as it ended its last step.
    pub(super) fn samplers(&self) -> Vec<SplitMix64> {
        self.cursors.iter().map(|c| lock(c).sampler).collect()
    }

    /// `rank`'s sampler as it ended its last step.
    pub(super) fn sampler(&self, rank: usize) -> Option<SplitMix64> {
        self.cursors.get(rank).map(|c| lock(c).sampler)
    }

    /// The round of the step before `next`, once every replica posted it (waiting for the
    /// posts when a step of this run posted it); none before the run's first step when the
    /// run did not resume one.
    pub(super) fn kept_round(&self, next: u64) -> Result<Option<RoundState>, ModelError> {
        if !self.has_round_before(next) {
            return Ok(None);
        }
        let (grads, _) = self.complete(next - 1)?;
        Ok(Some(round_state(next - 1, grads)))
    }

    /// Whether step `next` has a round before it (to wait for, apply or keep): every step
    /// after the run's first, and the first one when the run resumed with a posted round.
    fn has_round_before(&self, next: u64) -> bool {
        next > self.start
            || next
                .checked_sub(1)
                .is_some_and(|s| lock(&self.rounds).contains_key(&s))
    }

    /// The posts of the round of the step before `next` this process holds now, without
    /// waiting for the others (a multi-process run's checkpoint gathers them from every
    /// process instead: a wait here, on a stage thread, could wait on that very thread).
    pub(super) fn round_so_far(&self, next: u64) -> Option<RoundState> {
        let step = next.checked_sub(1)?;
        let rounds = lock(&self.rounds);
        let round = rounds.get(&step)?;
        let grads = round.grads.values().cloned().collect();
        Some(round_state(step, grads))
    }

    /// The exchange failed for `reason`: every wait for a round ends with it.
    pub(super) fn abort(&self, reason: String) {
        let _ = self.failed.set(reason);
        // Under the rounds' lock, so that a waiter that has not seen the failure yet is
        // already waiting when the notification comes.
        let _rounds = lock(&self.rounds);
        self.posted.notify_all();
    }

    /// Before the run: every cursor takes its checkpointed sampler, and the kept round (of
    /// the step before the run's first) is posted again.
    pub(super) fn restore(
        &self,
        samplers: &[SplitMix64],
        round: Option<&RoundState>,
    ) -> Result<(), ModelError> {
        for (cursor, &sampler) in self.cursors.iter().zip(samplers) {
            lock(cursor).sampler = sampler;
        }
        let Some(round) = round else {
            return Ok(());
        };
        if round.step + 1 != self.start || round.grads.len() != self.cursors.len() {
            return Err(ModelError::DrafterInput {
                what: "checkpointed state",
                reason: format!(
                    "keeps the round of step {} from {} replicas; a run from step {} with {} \
                     ranks applies the round of step {} from each",
                    round.step,
                    round.grads.len(),
                    self.start,
                    self.cursors.len(),
                    self.start.wrapping_sub(1)
                ),
            });
        }
        // Tables a file written before they were shared keeps with the round are not taken:
        // the run's first step reads its seeds, the target's weights of the same checkpoint.
        let mut rounds = lock(&self.rounds);
        rounds.insert(
            round.step,
            Round {
                grads: round.grads.iter().map(|g| (g.replica, g.clone())).collect(),
                frozen: Frozen::default(),
                applied: 0,
            },
        );
        Ok(())
    }

    /// `rank`'s next planned slice, `(its step, layout rows)`, if it has one left, the
    /// step before has rows to sample and the tables the slice reads are in; `take` hands it
    /// out (the replica taking the tables first).
    fn next(&self, fill: &DrafterFill, rank: usize, take: bool) -> Option<(u64, u64)> {
        let (step, rows, tables) = {
            let cursor = lock(self.cursors.get(rank)?);
            let rows = *self.slices.slices(rank, cursor.step).get(cursor.next)?;
            (cursor.step, rows, cursor.tables)
        };
        // A step with slices is at least 1; its slices sample the step before.
        if !fill.buffer.has_step(step - 1) {
            return None;
        }
        if !tables {
            let deposits = match self.due_tables(fill, step) {
                true => self.deposits(step - 1)?,
                false => Frozen::default(),
            };
            if !take {
                return Some((step, rows));
            }
            if fill.take_tables(rank, &deposits).is_err() {
                // The slice's own run reports the replica's error.
                return None;
            }
            lock(&self.cursors[rank]).tables = true;
        }
        if take {
            lock(&self.cursors[rank]).next += 1;
        }
        Some((step, rows))
    }

    /// Whether step `step`'s slices read tables deposited at the end of step `step − 1` in
    /// this run (a refresh was due then), not those the replica holds (no refresh due, or
    /// the run's first step, whose tables are its seeds or its checkpoint's).
    fn due_tables(&self, fill: &DrafterFill, step: u64) -> bool {
        step > self.start && step.is_multiple_of(fill.refresh_every)
    }

    /// The tables posted with round `step` so far, once both are in (`None` before).
    fn deposits(&self, step: u64) -> Option<Frozen> {
        let rounds = lock(&self.rounds);
        let frozen = &rounds.get(&step)?.frozen;
        (frozen.embed.is_some() && frozen.head.is_some()).then(|| frozen.clone())
    }

    /// Adds one replica's post of round `step`.
    fn post(&self, step: u64, grads: DrafterGrads, frozen: Frozen) -> Result<(), ModelError> {
        let mut rounds = lock(&self.rounds);
        let round = rounds.entry(step).or_default();
        let replica = grads.replica;
        if replica >= self.cursors.len() || round.grads.contains_key(&replica) {
            return Err(ModelError::Replicas {
                version: grads.version,
                reason: format!(
                    "replica {replica} posted the round of step {step} again, or is not one of {}",
                    self.cursors.len()
                ),
            });
        }
        round.frozen.merge(frozen);
        round.grads.insert(replica, grads);
        drop(rounds);
        self.posted.notify_all();
        Ok(())
    }

    /// Waits until every replica posted round `step`; its gradients and copies.
    fn complete(&self, step: u64) -> Result<(Vec<DrafterGrads>, Frozen), ModelError> {
        let deadline = Instant::now() + ROUND_WAIT;
        let mut rounds = lock(&self.rounds);
        loop {
            let posted = rounds.get(&step).map_or(0, |r| r.grads.len());
            if posted == self.cursors.len() {
                let round = &rounds[&step];
                return Ok((
                    round.grads.values().cloned().collect(),
                    round.frozen.clone(),
                ));
            }
            let missing = || {
                let have = rounds.get(&step);
                let missing: Vec<String> = (0..self.cursors.len())
                    .filter(|r| have.is_none_or(|h| !h.grads.contains_key(r)))
                    .map(|r| r.to_string())
                    .collect();
                missing.join(", ")
            };
            if let Some(reason) = self.failed.get() {
                return Err(ModelError::Replicas {
                    version: 0,
                    reason: format!(
                        "the round of target step {step} lacks replicas {} and will not \
                         complete: {reason}",
                        missing()
                    ),
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ModelError::Replicas {
                    version: 0,
                    reason: format!(
                        "the round of target step {step} still lacks the gradients of replicas \
                         {} after {} s",
                        missing(),
                        ROUND_WAIT.as_secs()
                    ),
                });
            }
            rounds = self
                .posted
                .wait_timeout(rounds, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// A round as a checkpoint keeps it: its gradients, not the tables posted with it (the
/// replicas took those before the checkpoint's next step, and they are the target's weights
/// in the same checkpoint).
fn round_state(step: u64, grads: Vec<DrafterGrads>) -> RoundState {
    RoundState {
        step,
        grads,
        embed: None,
        head: None,
    }
}

impl DrafterFill {
    /// Switches to the planned placement of `slices` for a run from target step `start`
    /// (before the run, before [`DrafterFill::import_state`]).
    pub fn plan_slices(&mut self, slices: SlicePlan, start: u64) {
        let samplers = self
            .replicas
            .iter()
            .map(|r| lock(r).trainer.sampler())
            .collect();
        self.planned = Some(Planned::new(slices, start, samplers));
    }

    /// Whether this fill places its slices by plan.
    pub fn is_planned(&self) -> bool {
        self.planned.is_some()
    }

    /// Another process's replica posted `post` as its round of target step `step` (the
    /// planned placement's rounds are keyed by step; see [`DrafterFill::post_remote`] for
    /// the measured placement's).
    pub fn post_remote_at(&self, step: u64, post: RoundPost) -> Result<(), ModelError> {
        let planned = self
            .planned
            .as_ref()
            .ok_or_else(|| ModelError::DrafterInput {
                what: "round post",
                reason: "keyed by step, but this run places its slices by measured times".into(),
            })?;
        let (frozen, grads) = Frozen::of_post(post);
        planned.post(step, grads, frozen)
    }

    /// The planned placement's end of target step `step` on `rank` (see the module docs):
    /// the step's slices no bubble took, the previous step's round applied, this step's
    /// round posted with the frozen copies `chunks` hold when they are due.
    pub(super) fn planned_step_end<C: Backend>(
        &self,
        planned: &Planned,
        rank: usize,
        step: u64,
        chunks: &[&ModelChunk<C>],
    ) -> Result<(), ModelError> {
        let at = lock(&planned.cursors[rank]).step;
        if at != step {
            return Err(ModelError::DrafterInput {
                what: "planned placement",
                reason: format!("rank {rank} ended target step {step} while at step {at}"),
            });
        }
        let applies = planned.has_round_before(step);
        // Before the leftover slices: across processes the round's completion is what says
        // that the rows they sample are in (see the module docs).
        let round = applies.then(|| planned.complete(step - 1)).transpose()?;
        if let Some((_, frozen)) = &round
            && !lock(&planned.cursors[rank]).tables
        {
            if planned.due_tables(self, step) {
                self.take_tables(rank, frozen)?;
            }
            lock(&planned.cursors[rank]).tables = true;
        }
        while let Some((s, rows)) = planned.next(self, rank, true) {
            self.slice(rank, rows as usize, Some(s - 1))?;
        }
        if let Some(round) = round {
            self.planned_apply(planned, rank, step - 1, round)?;
        }
        let mut frozen = Frozen::default();
        if (step + 1).is_multiple_of(self.refresh_every) {
            for chunk in chunks {
                frozen.take_from(chunk, step);
            }
        }
        let (grads, sampler) = {
            let mut replica = lock(&self.replicas[rank]);
            (replica.trainer.take_grads()?, replica.trainer.sampler())
        };
        *lock(&planned.cursors[rank]) = Cursor {
            step: step + 1,
            next: 0,
            sampler,
            tables: false,
        };
        let wire = self.peers.get().map(|_| frozen.post(&grads));
        planned.post(step, grads, frozen)?;
        match (self.peers.get(), wire) {
            (Some(peers), Some(post)) => peers.step_end(rank, step, Some(&post)),
            _ => Ok(()),
        }
    }

    /// `rank`'s replica applies round `step`: the summed update when it counted pairs (its
    /// tables it took before the step's slices); replica 0 publishes the weights.
    fn planned_apply(
        &self,
        planned: &Planned,
        rank: usize,
        step: u64,
        (grads, _): (Vec<DrafterGrads>, Frozen),
    ) -> Result<(), ModelError> {
        let mut replica = lock(&self.replicas[rank]);
        let updates = grads.iter().any(|g| g.pairs > 0);
        if updates {
            replica.trainer.step_with(&grads)?;
        }
        if rank == 0 && updates {
            self.board
                .publish(replica.trainer.version(), replica.trainer.weights()?);
        }
        drop(replica);
        let appliers = if self.peers.get().is_some() {
            1
        } else {
            self.ranks
        };
        let mut rounds = lock(&planned.rounds);
        if let Some(round) = rounds.get_mut(&step) {
            round.applied += 1;
            if round.applied == appliers {
                rounds.remove(&step);
            }
        }
        Ok(())
    }
}

/// The planned slices, handed to the router one at a time, in order, each only where it
/// fits (see the module docs).
pub(super) struct PlannedSlices(pub(super) Arc<DrafterFill>);

impl PlannedSlices {
    fn planned(&self) -> Option<&Planned> {
        self.0.planned.as_ref()
    }
}

impl FillerSource for PlannedSlices {
    fn kind(&self) -> &str {
        SLICE_KIND
    }

    fn sizes(&self) -> (u64, u64) {
        let full = lock(&self.0.replicas[0]).trainer.max_slice_rows();
        (1, full as u64)
    }

    fn fixed_size(&mut self, rank: usize) -> Option<u64> {
        let (_, rows) = self.planned()?.next(&self.0, rank, false)?;
        Some(rows)
    }

    fn next(&mut self, rank: usize, _units: u64) -> Option<Slice> {
        let (step, rows) = self.planned()?.next(&self.0, rank, true)?;
        let fill = Arc::clone(&self.0);
        Some(Slice {
            label: format!("drafter slice (step {step}, {rows} rows)"),
            units: rows,
            run: Box::new(move || {
                fill.slice(rank, rows as usize, Some(step - 1))
                    .map_err(|e| e.to_string())
            }),
        })
    }
}

#[cfg(test)]
#[path = "planned_tests.rs"]
mod tests;
