//! The bubble-filler seam: what a stage does while its next action waits for input.
//!
//! When a stage's next action needs a payload that has not arrived, the stage is in a
//! bubble. It records the bubble and offers the slot to its [`BubbleFiller`] with the idle
//! time it expects ([`Bubble::predicted_idle`]); the filler may hand back one piece of work
//! ([`FillerWork`]) that the stage runs on its own thread, timed like any action, and then
//! the stage asks again with what is left of the slot, until the filler declines or the
//! input is there. [`NoFiller`] (the default) always declines; [`crate::router`]'s
//! `RoutedFiller` hands out the queued work of a job's `FillerRouter` (drafter training,
//! rollout verification).
//!
//! After each piece of work the stage tells the filler what it measured
//! ([`BubbleFiller::finished`]), and after each bubble how long it really lasted when that is
//! known ([`BubbleFiller::bubble_ended`]): the filler keeps a running cost estimate of its
//! work and, in wall-clock mode, corrects the schedule's predicted idle time by the error it
//! has observed.

use pipefill_schedules::Action;
use serde::{Deserialize, Serialize};

/// A bubble as the stage sees it when it offers the slot.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bubble {
    pub rank: usize,
    pub iteration: u64,
    /// The action that waits for its input.
    pub waiting_for: Action,
    /// Idle time the stage expects before its input arrives, in seconds, minus what filler
    /// work already used of this slot. In virtual-clock mode this is exact (the payload's
    /// virtual arrival is known); in wall mode it comes from the schedule's prediction
    /// and is `None` when there is none.
    pub predicted_idle: Option<f64>,
    /// Whether `predicted_idle` is exact (virtual clock) rather than a prediction.
    pub exact: bool,
}

/// One slice of filler work: runs once on the stage's thread.
pub struct FillerWork {
    /// Shown in the profile (e.g. "drafter step 12").
    pub label: String,
    /// What the filler expects it to cost, in seconds (to compare with what it measured).
    pub predicted_cost: f64,
    /// The work itself. An error is recorded on the filler span; it does not stop the job.
    pub run: Box<dyn FnOnce() -> Result<(), String> + Send>,
}

impl std::fmt::Debug for FillerWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FillerWork")
            .field("label", &self.label)
            .field("predicted_cost", &self.predicted_cost)
            .finish_non_exhaustive()
    }
}

/// Decides what, if anything, runs in a bubble.
pub trait BubbleFiller: Send + 'static {
    /// Called when the stage enters a bubble, and again after each piece of work it handed
    /// out, while the input is still missing. `None` ends filling for this bubble.
    fn fill(&mut self, bubble: &Bubble) -> Option<FillerWork>;

    /// The work handed out last has run; `span` is what the stage measured (its cost is
    /// `span.end - span.start` on the stage's clock).
    fn finished(&mut self, _span: &FillerSpan) {}

    /// A bubble ended. `predicted_idle` is what the stage expected when it entered the
    /// bubble; `observed_idle` the idle time the input really kept it waiting, `None` when
    /// filler work was still running as the input arrived (the arrival was not observed).
    fn bubble_ended(
        &mut self,
        _bubble: &BubbleSpan,
        _predicted_idle: Option<f64>,
        _observed_idle: Option<f64>,
    ) {
    }
}

/// The default filler: leaves every bubble idle.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoFiller;

impl BubbleFiller for NoFiller {
    fn fill(&mut self, _bubble: &Bubble) -> Option<FillerWork> {
        None
    }
}

/// A recorded bubble: the rank waited over `[start, end)` for `waiting_for`'s input.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct BubbleSpan {
    pub rank: usize,
    pub iteration: u64,
    pub start: f64,
    pub end: f64,
    pub waiting_for: Action,
}

/// A recorded piece of filler work run inside a bubble.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FillerSpan {
    pub rank: usize,
    pub iteration: u64,
    pub start: f64,
    pub end: f64,
    pub label: String,
    pub predicted_cost: f64,
    /// The work's own error, if it failed.
    pub error: Option<String>,
}
