//! [`DataError`]: what reading, tokenizing and packing the training data can fail with.

use std::path::PathBuf;

/// Errors of the data module.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("character {ch:?} at position {position} is not in the tokenizer's vocabulary")]
    UnknownChar { ch: char, position: usize },
    #[error("token id {id} at position {position} is outside the vocabulary (size {vocab_size})")]
    UnknownToken {
        id: u32,
        position: usize,
        vocab_size: usize,
    },
    #[error("unknown task family {0:?} (known: addition, sorting, counting, parity)")]
    UnknownFamily(String),
    #[error("invalid `{field}`: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("cannot read {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path} {reason}")]
    File { path: PathBuf, reason: String },
    /// A line of a JSONL file that cannot be used: `file:line: reason`.
    #[error("{path}:{line}: {reason}")]
    Line {
        path: PathBuf,
        line: u64,
        reason: String,
    },
    #[error("tokenizer {path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("chat template: {reason}")]
    Template { reason: String },
    #[error(transparent)]
    Input(#[from] crate::input::InputError),
}
