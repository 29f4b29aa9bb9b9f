//! Errors of the schedules crate: each names what is wrong and where.

use crate::action::ParseActionError;

/// Everything that can go wrong building, reading, checking or simulating a plan.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    /// A generator cannot build a plan for these parameters (e.g. `m < p` for 1F1B).
    #[error("{schedule}: {reason}")]
    Unsupported { schedule: String, reason: String },

    /// The schedule name is not one of the built-in generators.
    #[error(
        "unknown schedule `{0}` (built-in: gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zb-h2, zb-v)"
    )]
    UnknownSchedule(String),

    /// A schedule file cannot be read or parsed.
    #[error("{file}: {reason}")]
    File { file: String, reason: String },

    /// An action's text is malformed, with where it was found.
    #[error("{file}: rank {rank}, step {step}: {source}")]
    Action {
        file: String,
        rank: usize,
        step: usize,
        #[source]
        source: ParseActionError,
    },

    /// The plan breaks a rule: `at` says where (e.g. "rank 1, step 14"), `rule` what.
    #[error("{at}: {rule}")]
    Invalid { at: String, rule: String },

    /// The plan as a whole breaks a rule that no single step is to blame for
    /// (e.g. "stage 2, micro-batch 3 has no forward", "stage 5 is placed on ranks 0 and 2").
    #[error("{0}")]
    Plan(String),

    /// The plan hangs under blocking point-to-point semantics.
    #[error("deadlock: {0}")]
    Deadlock(String),

    /// Peak activation memory exceeds the limit.
    #[error("rank {rank} needs {peak} units of activation memory, over the limit of {limit}")]
    Memory { rank: usize, peak: f64, limit: f64 },
}

pub type Result<T, E = ScheduleError> = std::result::Result<T, E>;
