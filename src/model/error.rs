//! [`ModelError`]: the one error of the `model` layer: building, cutting and running a
//! model's chunks, its optimizer state, checkpoints, the drafter, Hugging Face directories
//! and the packed row products of inference.

use std::path::PathBuf;

use crate::model::checkpoint::last_complete_note;
use crate::model::infer::rowmul::Isa;
use crate::tensor::TensorError;

/// What can go wrong in the model layer.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    // ---- model chunks, parameters and optimizer state
    /// A configuration field is unusable.
    #[error("model config: `{field}` {reason}")]
    Config { field: &'static str, reason: String },
    /// The model cannot be cut as asked.
    #[error("cannot cut {layers} layers as {cut}: {reason}")]
    Cut {
        layers: usize,
        cut: String,
        reason: String,
    },
    /// An input does not fit the chunk (wrong kind, wrong length).
    #[error("stage {stage}, micro-batch {mb}: {reason}")]
    Input {
        stage: usize,
        mb: usize,
        reason: String,
    },
    /// A backward action came without the action it depends on (I before F, W before I).
    #[error("{layer}: {action} of micro-batch {mb} has no matching {missing}")]
    Order {
        layer: String,
        action: &'static str,
        mb: usize,
        missing: &'static str,
    },
    /// No parameter of that name in this chunk.
    #[error("no parameter named `{0}`")]
    UnknownParam(String),
    /// Values given for a parameter have the wrong length.
    #[error("parameter `{name}` has {expected} values, got {got}")]
    ParamLen {
        name: String,
        expected: usize,
        got: usize,
    },
    /// Optimizer state that does not match the parameters.
    #[error("optimizer state: {0}")]
    OptimizerState(String),
    /// The tied embedding's two copies cannot be summed as asked.
    #[error("tied embeddings: {0}")]
    Tied(String),
    /// The weights of `[model] from` could not be read (the message names the file).
    #[error("importing the model: {0}")]
    Import(String),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),

    // ---- checkpoints (`checkpoint`)
    #[error("checkpoint {path}: {error}")]
    CheckpointIo {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("checkpoint {path}: not a pipefill checkpoint sidecar: {reason}")]
    BadMeta { path: PathBuf, reason: String },
    #[error(
        "checkpoint {path}: the file is truncated or was replaced: {got} bytes, its manifest or sidecar says {expected}"
    )]
    Size {
        path: PathBuf,
        expected: u64,
        got: u64,
    },
    /// A file of the checkpoint whose bytes are not the ones its listing recorded.
    #[error("checkpoint {path}: corrupted: its hash is {got}, {listing} says {expected}")]
    Corrupted {
        path: PathBuf,
        got: String,
        expected: String,
        /// The manifest's or sidecar's file name.
        listing: String,
    },
    /// A file name or size that the manifest or sidecar `path` gives in `field`, refused
    /// before anything is read ([`files`](crate::model::checkpoint::files)).
    #[error("checkpoint {path}: {field} {name:?} {reason}")]
    Listed {
        path: PathBuf,
        field: String,
        name: String,
        reason: String,
    },
    #[error("checkpoint {path}: is {kind}, not a regular file")]
    Irregular { path: PathBuf, kind: &'static str },
    #[error(
        "checkpoint {path}: {bytes} bytes, more than this file of a checkpoint may hold ({limit})"
    )]
    TooLarge {
        path: PathBuf,
        bytes: u64,
        limit: u64,
    },
    /// A file whose listed size the memory cannot hold: refused before it is allocated.
    #[error(
        "checkpoint {path}: {bytes} bytes, more than the memory can hold ({available} bytes \
         available)"
    )]
    OverMemory {
        path: PathBuf,
        bytes: u64,
        available: u64,
    },
    #[error("checkpoint {path}: not a valid safetensors file: {reason}")]
    BadTensors { path: PathBuf, reason: String },
    /// The checkpoint does not fit the model it is restored into.
    #[error("checkpoint does not fit this run: {0}")]
    Mismatch(String),
    /// Another rank of a multi-process run could not write (or acknowledge) its shard of
    /// the checkpoint in `path`.
    #[error("checkpoint {path}: rank {rank}'s shard: {reason}")]
    ShardPeer {
        path: PathBuf,
        rank: usize,
        reason: String,
    },
    /// A periodic checkpoint could not be written: the run stops there (what the write
    /// left is removed); `last` is the checkpoint a resume would continue from.
    #[error(
        "cannot write the checkpoint of step {step}: {cause}; the run stopped: {}",
        last_complete_note(last.as_deref())
    )]
    Periodic {
        step: u64,
        dir: PathBuf,
        last: Option<PathBuf>,
        /// Named in the message, not a `source`: the whole reason is one line.
        cause: Box<ModelError>,
    },
    #[error("checkpoint {path}: tensor `{name}`: {reason}")]
    CheckpointTensor {
        path: PathBuf,
        name: String,
        reason: String,
    },

    // ---- the drafter (`drafter`)
    /// A `[drafter]` value that cannot be used.
    #[error("`{field}` {reason}")]
    DrafterConfig { field: &'static str, reason: String },
    /// The buffer holds no sequence with at least one training pair.
    #[error("drafter slice: the draft buffer holds no sequence with a training pair yet")]
    NoData,
    /// An input (row, context, weights, gradients) does not fit the drafter.
    #[error("drafter {what}: {reason}")]
    DrafterInput { what: &'static str, reason: String },
    /// Gradients handed to [`DrafterTrainer::step_with`](crate::model::drafter::DrafterTrainer::step_with) that do not make one consistent set.
    #[error("drafter step {version}: {reason}")]
    Replicas { version: u64, reason: String },

    // ---- Hugging Face model directories (`hf`): each names the file and the field or tensor
    #[error("{path}: `{field}` {reason}")]
    HfConfig {
        path: PathBuf,
        field: String,
        reason: String,
    },
    #[error("{path}: tensor `{tensor}` {reason}")]
    HfTensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    #[error("{path} {reason}")]
    File { path: PathBuf, reason: String },
    #[error("cannot export to {path}: {reason}")]
    Export { path: PathBuf, reason: String },
    #[error(transparent)]
    Read(#[from] crate::input::InputError),

    // ---- packed row products (`infer::rowmul`)
    #[error("rowmul: the {0:?} kernel needs CPU features this machine lacks")]
    RowmulUnavailable(Isa),
    #[error("rowmul: x has {got} floats, not rows {rows} × din {din}")]
    RowmulShape { got: usize, rows: usize, din: usize },
    #[error("rowmul: w has {got} floats, not din {din} × dout {dout}")]
    RowmulWeights { got: usize, din: usize, dout: usize },
    #[error("rowmul: weight {0} is beyond the range of half precision (±65504)")]
    HalfRange(f32),
}
