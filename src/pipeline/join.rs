//! [`StepJoin`]: hands each completed step to the trainer's caller once both halves are
//! in — the step's metrics (from the ranks, through [`super::shared::Shared`]) and its
//! iteration's measured profile (from the runtime's profiler) — whichever comes first; and
//! what the caller is handed: [`StepView`], [`DrafterStep`], [`DrafterRun`].

use std::collections::BTreeMap;
use std::sync::mpsc::Receiver;

use pipefill_actors::{IterationProfile, RouterStats};

use crate::model::drafter::DrafterWeights;
use crate::train::StepMetrics;

/// One completed step as the caller sees it during the run.
#[derive(Clone, Copy, Debug)]
pub struct StepView<'a> {
    pub metrics: &'a StepMetrics,
    /// The step's measured iteration: timeline, bubbles, filler spans (`None` only if the
    /// runtime never published it).
    pub profile: Option<&'a IterationProfile>,
    /// The drafter's figures (runs with `filler = "drafter"`).
    pub drafter: Option<DrafterStep>,
}

/// What the drafter did up to one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrafterStep {
    /// Drafter optimizer steps published so far.
    pub version: u64,
    /// Slices run since the previous step was handed over, and their mean loss.
    pub slices: u64,
    pub loss: Option<f64>,
    /// Top-1 agreement with the target on held-out rows, measured every
    /// [`super::fill::HELD_OUT_EVERY`] steps and at the last step.
    pub agreement: Option<f64>,
}

/// The drafter of a run with `filler = "drafter"`.
#[derive(Clone, Debug)]
pub struct DrafterRun {
    /// Every rank's replica after the run (all at the same version, the same weights).
    pub replicas: Vec<DrafterWeights>,
    /// The router's cost estimates and counts, by kind of work.
    pub router: RouterStats,
    /// `(step, drafter version, held-out agreement)` each time it was measured.
    pub agreement: Vec<(u64, u64, f64)>,
    /// Bytes of the frozen embedding and head the replicas read after the run, each table
    /// counted once however many replicas share it.
    pub frozen_table_bytes: usize,
}

/// Pairs each step's metrics (from the ranks) with its iteration's measured profile (from
/// the runtime's profiler) and hands each pair to the caller once both have arrived; the
/// two come on separate channels, in either order.
pub(super) struct StepJoin<F> {
    first_step: u64,
    profiles: Receiver<IterationProfile>,
    /// Profiles by step, waiting for their metrics.
    profiles_by_step: BTreeMap<u64, IterationProfile>,
    /// Metrics waiting for their timeline.
    waiting: BTreeMap<u64, StepMetrics>,
    done: Vec<StepMetrics>,
    on_step: F,
}

impl<F: FnMut(&StepMetrics, Option<&IterationProfile>)> StepJoin<F> {
    pub(super) fn new(first_step: u64, profiles: Receiver<IterationProfile>, on_step: F) -> Self {
        StepJoin {
            first_step,
            profiles,
            profiles_by_step: BTreeMap::new(),
            waiting: BTreeMap::new(),
            done: Vec::new(),
            on_step,
        }
    }

    /// Takes the published timelines and hands over every step now complete.
    pub(super) fn poll(&mut self) {
        while let Ok(p) = self.profiles.try_recv() {
            self.profiles_by_step
                .insert(self.first_step + p.iteration, p);
        }
        let ready: Vec<u64> = self
            .waiting
            .keys()
            .copied()
            .filter(|s| self.profiles_by_step.contains_key(s))
            .collect();
        for step in ready {
            if let Some(m) = self.waiting.remove(&step) {
                let p = self.profiles_by_step.remove(&step);
                (self.on_step)(&m, p.as_ref());
                self.done.push(m);
            }
        }
    }

    pub(super) fn metrics(&mut self, m: StepMetrics) {
        self.waiting.insert(m.step, m);
        self.poll();
    }

    /// After the run: hands over what is left (with its timeline when it came) and returns
    /// every step's metrics.
    pub(super) fn finish(mut self) -> Vec<StepMetrics> {
        self.poll();
        for (step, m) in std::mem::take(&mut self.waiting) {
            let p = self.profiles_by_step.remove(&step);
            (self.on_step)(&m, p.as_ref());
            self.done.push(m);
        }
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    use crate::schedules::{Action, ActionKind, Span, Timeline};

    fn metrics(step: u64) -> StepMetrics {
        StepMetrics {
            step,
            loss: 1.0,
            lr: 1e-3,
            grad_norm: 1.0,
            tokens: 8,
            seconds: 0.1,
        }
    }

    /// Iteration `iteration`'s profile, with one rank busy for `busy` of a makespan of 1.
    fn profile(iteration: u64, busy: f64) -> IterationProfile {
        let span = |rank, start, end| Span {
            rank,
            start,
            end,
            action: Action::new(ActionKind::F, rank as u32, 0),
        };
        IterationProfile {
            iteration,
            timeline: Timeline::from_spans(2, vec![span(0, 0.0, 1.0), span(1, 0.0, busy)], &[]),
            records: Vec::new(),
            bubbles: Vec::new(),
            fillers: Vec::new(),
            steps: Vec::new(),
            ranks_reported: 2,
        }
    }

    #[test]
    fn each_step_is_handed_over_once_its_metrics_and_timeline_are_both_in() {
        let (tx, rx) = channel();
        let mut seen = Vec::new();
        let mut join = StepJoin::new(10, rx, |m: &StepMetrics, p: Option<&IterationProfile>| {
            seen.push((m.step, p.map(|p| p.timeline.bubble_ratio)));
        });
        // Metrics first: step 10 waits for iteration 0's timeline.
        join.metrics(metrics(10));
        tx.send(profile(1, 0.5)).unwrap();
        join.poll();
        // Timeline first: iteration 1 (step 11) is handed over with its metrics.
        join.metrics(metrics(11));
        tx.send(profile(0, 0.75)).unwrap();
        join.poll();
        // Step 12's timeline never comes: it is handed over without one at the end.
        join.metrics(metrics(12));
        let done: Vec<u64> = join.finish().iter().map(|m| m.step).collect();
        assert_eq!(done, [11, 10, 12]);
        assert_eq!(
            seen,
            [(11, Some(0.25)), (10, Some(0.125)), (12, None)],
            "bubble ratio = idle / (ranks × makespan)"
        );
    }
}
