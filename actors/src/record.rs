//! What a stage reports about one iteration: per-action records, bubbles, filler work and
//! the rank's share of the optimizer step ([`StepRecord`]), which together are every move of
//! the rank's clock, so a timeline can be replayed exactly (without its fillers, say).

use pipefill_schedules::{Action, Span};
use serde::{Deserialize, Serialize};

use crate::filler::{BubbleSpan, FillerSpan};

/// One executed action of one rank: where it sits in the rank's list and when it ran.
///
/// Compute actions (F, I, W, B, overlapped F+B) span the time their compute took; SEND and
/// RECV are recorded at the moment they completed (`start == end` in virtual mode, where a
/// link's cost is its latency, applied to the receiver's clock).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActionRecord {
    pub rank: usize,
    pub iteration: u64,
    /// Position in the rank's action list (idle steps count as positions).
    pub index: usize,
    pub action: Action,
    pub start: f64,
    pub end: f64,
    /// Time the rank spent in a bubble waiting for this action's input, in seconds.
    pub waited: f64,
}

impl ActionRecord {
    pub fn duration(&self) -> f64 {
        self.end - self.start
    }

    /// The span the profiler builds the timeline from.
    pub fn span(&self) -> Span {
        Span {
            rank: self.rank,
            start: self.start,
            end: self.end,
            action: self.action,
        }
    }
}

/// Everything one rank measured during one iteration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageReport {
    pub rank: usize,
    pub iteration: u64,
    /// In the order the rank ran them (= the plan's order).
    pub records: Vec<ActionRecord>,
    pub bubbles: Vec<BubbleSpan>,
    pub fillers: Vec<FillerSpan>,
    /// When the rank's optimizer step ran, `(start, end)`.
    pub optimizer: (f64, f64),
    /// The walk's start and its optimizer-step work, in the order it ran.
    #[serde(default)]
    pub steps: Vec<StepRecord>,
}

/// A move of a rank's clock that is neither an action, a bubble nor filler work: the walk's
/// start and the rank's part of the optimizer step. Where the optimizer step's work lands
/// depends on timing (at the end of a walk, or deferred to the next walk's first compute
/// action), so it is recorded with its position.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub rank: usize,
    /// The iteration whose walk recorded it.
    pub iteration: u64,
    /// The position in that walk's action list it ran before (the list's length: after the
    /// last action).
    pub before: usize,
    pub work: StepWork,
    pub start: f64,
    pub end: f64,
}

/// What a [`StepRecord`] timed; `step` is the iteration whose optimizer step it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum StepWork {
    /// The walk began (`start == end`: the rank's clock then).
    Began,
    /// The rank computed its gradient statistics and sent them to every rank at `end`.
    Stats { step: u64 },
    /// The exact step (applied, confirmed, or rolled back and redone), begun at `start`,
    /// once every rank's statistics of `step` were available on this rank.
    Exact { step: u64 },
    /// A speculative step: taken with the statistics at hand; the first-stage forwards run
    /// after it keep their outputs on the rank until the `Exact` record of `step`.
    Speculative { step: u64 },
    /// An unchecked step: no statistics, no agreement.
    Unchecked { step: u64 },
    /// A held first-stage forward recomputed after `step` was rolled back; its output
    /// leaves at `end`.
    Recompute { step: u64, action: Action },
}
