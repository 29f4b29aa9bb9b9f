//! What every way of running a job shares, whichever path (the reference trainer, the
//! in-process pipeline, a launched rank, `pipefill rl`) runs it: so far the run directory
//! ([`dir`]), which decides whether a run may write where it was told to, the line of
//! `metrics.jsonl` ([`metrics`]), and the training log that writes those lines and sums the
//! run up ([`log`]).

pub mod dir;
pub mod log;
pub mod metrics;

pub use dir::{Existing, Resume, RunDir, RunDirError};
pub use log::{NothingToDo, RunLog, RunSummary, steps_left};
pub use metrics::StepLine;
