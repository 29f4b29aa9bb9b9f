//! A stage's side of the optimizer step (the protocol is in [`crate::step`]).
//!
//! At the end of iteration k the walk computes the rank's [`GradStats`] and sends them to
//! every other rank on the statistics transport. Under [`StepMode::Barrier`] it then waits
//! for every rank's statistics and steps exactly. Under [`StepMode::PostValidate`] it steps
//! speculatively with the statistics it already has (or, when the compute cannot roll back,
//! defers the step) and leaves a [`Pending`] on the actor, which the walk of k+1 validates:
//!
//! - A forward of the first stage (its input is the data, not another rank's output) may run
//!   on the speculatively stepped weights; its output stays on the rank. This is what lets
//!   the first rank start iteration k+1 while later ranks still finish k.
//! - Any other action that touches the weights (F of a later stage, I, W, B) or ships
//!   something (SEND) first validates: it waits for the missing statistics (a bubble),
//!   computes the exact decision, and confirms the step or rolls it back and redoes it. On
//!   a rollback the held forwards are run again on the exact weights before their outputs
//!   leave, so no other rank ever sees a value computed from a wrong step.
//! - The first-stage forwards validate as soon as every statistic is there, so their
//!   outputs leave no later than they must.
//!
//! The last iteration's step is settled by the [`super::Settle`] message.
//!
//! In virtual-clock mode a statistic counts only once its virtual arrival time (the sender's
//! clock plus the link latency) has passed on this rank; to know that arrival the rank waits
//! (in real time, not virtual time) until the statistic is physically there. Speculative
//! decisions, rollbacks and the timeline then follow virtual time, not how the OS happened
//! to schedule the stage threads.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use pipefill_schedules::{Action, ActionKind};

use super::walk::{Held, Walk, panic_text};
use super::{StageActor, StageEvent};
use crate::compute::StageCompute;
use crate::error::{LinkError, RuntimeError};
use crate::record::StepWork;
use crate::step::{GradStats, RankStep, StepDecision, StepMode, decide};
use crate::transport::{Envelope, Flow, Tag};

/// An optimizer step whose exact decision is not known yet.
pub(crate) struct Pending {
    iteration: u64,
    /// Each rank's statistics once received, with when they are available on this rank.
    known: Vec<Option<(GradStats, f64)>>,
    /// The speculative decision the rank stepped with; `None` when it has not stepped.
    speculative: Option<StepDecision>,
}

impl Pending {
    /// Every rank's statistics are here and available at time `now`.
    fn complete_at(&self, now: f64) -> bool {
        self.known
            .iter()
            .all(|k| matches!(k, Some((_, at)) if *at <= now))
    }

    /// The statistics available at time `now`, by rank.
    fn usable_at(&self, now: f64) -> Vec<Option<GradStats>> {
        self.known
            .iter()
            .map(|k| k.filter(|(_, at)| *at <= now).map(|(s, _)| s))
            .collect()
    }
}

fn stats_tag(from: usize, iteration: u64) -> Tag {
    Tag {
        flow: Flow::GradStats,
        stage: from as u32,
        microbatch: 0,
        iteration,
    }
}

/// Whether `action` may run on speculatively stepped weights: a plain forward of the first
/// stage, whose input is the data and whose output can be held and recomputed.
fn may_speculate(action: Action) -> bool {
    action.kind == ActionKind::F && action.stage == 0
}

impl<C: StageCompute> StageActor<C> {
    fn optimizer_error(&self, iteration: u64, cause: String) -> RuntimeError {
        RuntimeError::Optimizer {
            rank: self.wiring.rank,
            iteration,
            cause,
        }
    }

    /// Runs `f` on the compute with panic capture; failures name the step's iteration.
    fn guarded<T>(
        &mut self,
        iteration: u64,
        f: impl FnOnce(&mut C) -> Result<T, C::Error>,
    ) -> Result<T, RuntimeError> {
        match catch_unwind(AssertUnwindSafe(|| f(&mut self.compute))) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.optimizer_error(iteration, e.to_string())),
            Err(p) => {
                Err(self.optimizer_error(iteration, format!("panicked: {}", panic_text(&*p))))
            }
        }
    }

    fn sync_error(&self, iteration: u64, source: LinkError) -> RuntimeError {
        RuntimeError::StepSync {
            rank: self.wiring.rank,
            iteration,
            source,
        }
    }

    /// Computes this rank's statistics, sends them to every other rank and takes in what
    /// has arrived (in virtual mode: everything, to learn the arrival times).
    fn exchange(&mut self, iteration: u64) -> Result<Pending, RuntimeError> {
        let rank = self.wiring.rank;
        let watch = self.clock.start();
        let own = self.guarded(iteration, |c| c.grad_stats(iteration))?;
        self.clock.stop(watch);
        let stats = Arc::clone(&self.wiring.stats);
        let sent_at = self.clock.now();
        for to in (0..stats.ranks()).filter(|&to| to != rank) {
            let envelope = Envelope {
                tag: stats_tag(rank, iteration),
                from: rank,
                sent_at,
                payload: own,
            };
            stats
                .send(to, envelope)
                .map_err(|e| self.sync_error(iteration, e))?;
        }
        let mut pending = Pending {
            iteration,
            known: vec![None; stats.ranks()],
            speculative: None,
        };
        pending.known[rank] = Some((own, sent_at));
        self.take_stats(&mut pending, self.clock.is_virtual())?;
        Ok(pending)
    }

    /// Takes in the missing statistics: all of them when `block`, else those already here.
    fn take_stats(&mut self, pending: &mut Pending, block: bool) -> Result<(), RuntimeError> {
        let rank = self.wiring.rank;
        let stats = Arc::clone(&self.wiring.stats);
        for from in 0..pending.known.len() {
            if pending.known[from].is_some() {
                continue;
            }
            let tag = stats_tag(from, pending.iteration);
            let got = if block {
                stats.recv(rank, &tag).map(Some)
            } else {
                stats.try_recv(rank, &tag)
            };
            let got = got.map_err(|e| self.sync_error(pending.iteration, e))?;
            if let Some(env) = got {
                let at = self.clock.arrival(from, rank, env.sent_at);
                pending.known[from] = Some((env.payload, at));
            }
        }
        Ok(())
    }

    /// Receives every missing statistic and returns when the last is available here.
    fn gather(&mut self, pending: &mut Pending) -> Result<f64, RuntimeError> {
        self.take_stats(pending, true)?;
        let last = pending.known.iter().flatten().map(|(_, at)| *at);
        Ok(last.fold(self.clock.now(), f64::max))
    }

    /// With every rank's statistics known: the exact decision, then confirm, roll back and
    /// redo, or take the deferred step. Reports the outcome (with `held` forwards to be
    /// recomputed on a rollback) and returns whether it rolled back.
    fn resolve(
        &mut self,
        pending: Pending,
        waited: f64,
        held: usize,
    ) -> Result<bool, RuntimeError> {
        let iteration = pending.iteration;
        let all = pending.usable_at(f64::INFINITY);
        let (grad_norm, exact) = decide(&all, self.wiring.step.max_grad_norm);
        let watch = self.clock.start();
        let rolled_back = match pending.speculative {
            Some(guess) if guess.same_as(&exact) => {
                self.guarded(iteration, |c| c.confirm_step(iteration))?;
                false
            }
            Some(_) => {
                tracing::debug!(
                    rank = self.wiring.rank,
                    iteration,
                    "rolling back a speculative step"
                );
                self.guarded(iteration, |c| c.rollback_step(iteration))?;
                self.guarded(iteration, |c| c.apply_step(iteration, exact, false))?;
                true
            }
            None => {
                self.guarded(iteration, |c| c.apply_step(iteration, exact, false))?;
                false
            }
        };
        self.clock.stop(watch);
        let step = RankStep {
            rank: self.wiring.rank,
            speculative: pending.speculative,
            rolled_back,
            recomputed: if rolled_back { held } else { 0 },
            waited,
        };
        let _ = self.wiring.events.send(StageEvent::Stepped {
            iteration,
            grad_norm,
            decision: exact,
            step,
        });
        Ok(rolled_back)
    }

    /// Settles the pending step after the job's last iteration (no walk to record in).
    pub(super) fn settle_final(&mut self) -> Result<(), RuntimeError> {
        let Some(mut pending) = self.pending.take() else {
            return Ok(());
        };
        let start = self.clock.now();
        let ready = self.gather(&mut pending)?;
        self.clock.advance_to(ready);
        self.resolve(pending, (ready - start).max(0.0), 0)
            .map(|_| ())
    }
}

impl<C: StageCompute> Walk<'_, C> {
    /// The end of this rank's part of the iteration: statistics out, then the barrier step
    /// or the speculative one. Returns the step's `(start, end)`.
    pub(super) fn end_step(&mut self, last: Action) -> Result<(f64, f64), RuntimeError> {
        let iteration = self.iteration;
        let policy = self.actor.wiring.step;
        if policy.mode == StepMode::Unchecked {
            return self.unchecked_step();
        }
        let computed = self.actor.clock.now();
        let mut pending = self.actor.exchange(iteration)?;
        let now = self.actor.clock.now();
        self.record_step(StepWork::Stats { step: iteration }, (computed, now));
        if policy.mode == StepMode::Barrier || pending.complete_at(now) {
            let waited = self.wait_for_stats(&mut pending, last)?;
            let start = self.actor.clock.now();
            self.actor.resolve(pending, waited, 0)?;
            let span = (start, self.actor.clock.now());
            self.record_step(StepWork::Exact { step: iteration }, span);
            return Ok(span);
        }
        if self.actor.compute.can_roll_back() {
            let (_, guess) = decide(&pending.usable_at(now), policy.max_grad_norm);
            let watch = self.actor.clock.start();
            self.actor
                .guarded(iteration, |c| c.apply_step(iteration, guess, true))?;
            let span = self.actor.clock.stop(watch);
            self.record_step(StepWork::Speculative { step: iteration }, span);
            pending.speculative = Some(guess);
        }
        self.actor.pending = Some(pending);
        Ok((now, self.actor.clock.now()))
    }

    /// [`StepMode::Unchecked`]: no statistics, no agreement; an unclipped step at once.
    fn unchecked_step(&mut self) -> Result<(f64, f64), RuntimeError> {
        let iteration = self.iteration;
        let watch = self.actor.clock.start();
        self.actor.guarded(iteration, |c| {
            c.apply_step(iteration, StepDecision::UNCLIPPED, false)
        })?;
        let span = self.actor.clock.stop(watch);
        self.record_step(StepWork::Unchecked { step: iteration }, span);
        let step = RankStep {
            rank: self.actor.wiring.rank,
            speculative: None,
            rolled_back: false,
            recomputed: 0,
            waited: 0.0,
        };
        let _ = self.actor.wiring.events.send(StageEvent::Stepped {
            iteration,
            grad_norm: f64::NAN,
            decision: StepDecision::UNCLIPPED,
            step,
        });
        Ok(span)
    }

    /// Before a compute action: returns true when it runs on speculatively stepped weights
    /// (its outputs must be held); otherwise the previous step is exact when it returns.
    pub(super) fn before_compute(&mut self, action: Action) -> Result<bool, RuntimeError> {
        let Some(mut pending) = self.actor.pending.take() else {
            return Ok(false);
        };
        if pending.speculative.is_some() && may_speculate(action) {
            let block = self.actor.clock.is_virtual();
            self.actor.take_stats(&mut pending, block)?;
            if !pending.complete_at(self.actor.clock.now()) {
                self.actor.pending = Some(pending);
                return Ok(true);
            }
        }
        self.actor.pending = Some(pending);
        self.validate(action)?;
        Ok(false)
    }

    /// The previous iteration's step becomes exact: waits for the missing statistics (a
    /// bubble before `action`), confirms or rolls back and redoes it, then releases the
    /// held forward outputs (recomputed first after a rollback).
    pub(super) fn validate(&mut self, action: Action) -> Result<(), RuntimeError> {
        let Some(mut pending) = self.actor.pending.take() else {
            return Ok(());
        };
        let waited = self.wait_for_stats(&mut pending, action)?;
        let held = std::mem::take(&mut self.speculative);
        let step = pending.iteration;
        let start = self.actor.clock.now();
        let rolled_back = self.actor.resolve(pending, waited, held.len())?;
        self.record_step(StepWork::Exact { step }, (start, self.actor.clock.now()));
        for (forward, key, mut out) in held {
            if rolled_back {
                let watch = self.actor.clock.start();
                let payload = self.call(forward, forward, None)?;
                let (start, end) = self.actor.clock.stop(watch);
                let work = StepWork::Recompute {
                    step,
                    action: forward,
                };
                self.record_step(work, (start, end));
                let payload = payload.ok_or_else(|| {
                    self.fail(
                        forward,
                        "recomputed after a rollback, it returned no output",
                    )
                })?;
                out = Held { payload, at: end };
            }
            self.deliver(forward, key, out)?;
        }
        Ok(())
    }

    /// Completes `pending`'s statistics; the time until the last one is available is a
    /// bubble before `waiting_for`, offered to the filler. Returns the time waited.
    fn wait_for_stats(
        &mut self,
        pending: &mut Pending,
        waiting_for: Action,
    ) -> Result<f64, RuntimeError> {
        let start = self.actor.clock.now();
        if self.actor.clock.is_virtual() {
            let ready = self.actor.gather(pending)?;
            if ready > start {
                self.fill(waiting_for, |clock| Some(ready - clock));
                self.actor.clock.advance_to(ready);
                let span = self.bubble(start, waiting_for);
                let idle = Some(ready - start);
                self.actor.wiring.filler.bubble_ended(&span, idle, idle);
            }
        } else if !pending.complete_at(start) {
            // Wall: whatever is missing is late; its length is not predicted.
            self.actor.gather(pending)?;
            self.bubble(start, waiting_for);
        }
        Ok((self.actor.clock.now() - start).max(0.0))
    }
}
