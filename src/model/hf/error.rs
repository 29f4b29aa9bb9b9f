//! [`HfError`]: reading or writing a Hugging Face model directory.

use std::path::PathBuf;

use crate::model::ModelError;

/// What can go wrong reading or writing a Hugging Face model directory; each names the file
/// and the field or tensor.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{path}: `{field}` {reason}")]
    Config {
        path: PathBuf,
        field: String,
        reason: String,
    },
    #[error("{path}: tensor `{tensor}` {reason}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    #[error("{path} {reason}")]
    File { path: PathBuf, reason: String },
    #[error("cannot export to {path}: {reason}")]
    Export { path: PathBuf, reason: String },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Input(#[from] crate::input::InputError),
}
