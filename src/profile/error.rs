//! `ProfileError`: what can go wrong gathering, replaying, reading or writing a profile.
//!
//! One enum for the layer: merging the ranks' profiles on rank 0 (`merge`), the bubble
//! report and its files (`report`), and the step replay behind step inflation
//! (`report::replay`).

use std::path::PathBuf;

use crate::comm::CommError;

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    // ---- merging the ranks' profiles (`merge`)
    #[error("no profile from rank {rank} (expected one from each of {ranks} ranks)")]
    MissingRank { rank: usize, ranks: usize },
    #[error("rank {rank} sent its profile twice, or a rank outside 0..{ranks}")]
    BadRank { rank: usize, ranks: usize },
    #[error("rank {rank} measured {got} iterations, rank 0 measured {expected}")]
    Iterations {
        rank: usize,
        got: usize,
        expected: usize,
    },
    #[error("rank {rank}'s profile holds a span of rank {span_rank}")]
    SpanRank { rank: usize, span_rank: usize },
    #[error("rank {peer} sent an unreadable {what}: {reason}")]
    BadFrame {
        peer: usize,
        what: &'static str,
        reason: String,
    },
    #[error("no clock exchange with rank 0 completed")]
    NoSamples,
    #[error("cannot write {path}: {error}")]
    Write {
        path: std::path::PathBuf,
        error: std::io::Error,
    },
    #[error("no iteration measured: nothing to report")]
    NothingMeasured,
    #[error(transparent)]
    Comm(#[from] CommError),

    // ---- the bubble report and its files (`report`)
    /// The measured and predicted timelines do not describe the same pipeline.
    #[error("the measured timeline has {measured} ranks but the predicted one has {predicted}")]
    RankMismatch { measured: usize, predicted: usize },
    #[error("{path}: no such run directory")]
    NoRunDir { path: PathBuf },
    #[error(transparent)]
    Read(#[from] crate::input::InputError),
    /// The file exists but is not a report this version understands.
    #[error("{path} is not a valid bubble report: {message}")]
    Corrupt { path: PathBuf, message: String },

    // ---- the step replay (`report::replay`)
    #[error("step replay: no record has a compute action, so there is no makespan")]
    NoMakespan,
    #[error(
        "step replay: rank {rank} has no record of where its first walk began (a profile \
         from before step records were kept?)"
    )]
    NoStart { rank: usize },
    #[error(
        "step replay: no rank can make progress; rank {rank} in iteration {iteration} waits \
         at {what} for something no record of the run produces"
    )]
    Stuck {
        rank: usize,
        iteration: u64,
        what: String,
    },
}
