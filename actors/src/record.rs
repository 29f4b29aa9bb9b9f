//! What a stage reports about one iteration: per-action records, bubbles and filler work.

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
}
