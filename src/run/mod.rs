//! What every way of running a job shares, whichever path (the reference trainer, the
//! in-process pipeline, a launched rank, `pipefill rl`) runs it: so far the run directory
//! ([`dir`]), which decides whether a run may write where it was told to, and the line of
//! `metrics.jsonl` ([`metrics`]).

pub mod dir;
pub mod metrics;

pub use dir::{Existing, Resume, RunDir, RunDirError};
pub use metrics::StepLine;
