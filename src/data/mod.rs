//! Training data: synthetic reasoning tasks with verifiable answers and long-tailed
//! solution lengths (the default, no download), or JSONL datasets tokenized by a Hugging
//! Face tokenizer; and the deterministic packing of either into each step's micro-batches.
//!
//! - [`rng`]: SplitMix64, the platform-independent generator everything is seeded from.
//! - [`tasks`]: task families, [`Task`] (prompt, worked solution, answer, checker) and the
//!   seeded [`TaskGenerator`].
//! - [`tokenizer`]: the fixed character vocabulary.
//! - [`hf_tokenizer`]: a `tokenizer.json` with its special tokens and [`chat`] template;
//!   [`text_tokenizer`]: [`TextTokenizer`], either tokenizer behind one type.
//! - [`jsonl`]: JSONL records (text, prompt/completion, chat messages, prompt/answer);
//!   [`documents`]: those records tokenized, with the SFT loss mask.
//! - [`reward`]: exact, numeric (GSM8K `####`) and boxed (MATH `\boxed{}`) answer checks.
//! - [`batch`]: [`StepData`], step `k`'s micro-batches as a pure function of the seed.
//! - [`summary`]: [`DatasetSummary`], counts and the solution-length histogram.

pub mod batch;
pub mod chat;
pub mod documents;
pub mod hf_tokenizer;
pub mod jsonl;
pub mod reward;
pub mod rng;
pub mod summary;
pub mod tasks;
pub mod text_tokenizer;
pub mod tokenizer;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use batch::{MicroBatch, StepData};
pub use documents::Tokenized;
pub use rng::SplitMix64;
pub use summary::DatasetSummary;
pub use tasks::{Task, TaskFamily, TaskGenerator, parse_answer};
pub use text_tokenizer::TextTokenizer;
pub use tokenizer::Tokenizer;

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

/// Where the training stream comes from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataSource {
    /// The synthetic reasoning tasks, character-tokenized.
    #[default]
    Synthetic,
    /// The records of the JSONL file `data.path`, tokenized by `data.tokenizer`.
    Jsonl,
}

impl DataSource {
    fn is_synthetic(&self) -> bool {
        *self == DataSource::Synthetic
    }
}

/// Default `data.max_line_bytes`: 1 MiB (about 250K tokens of text). Tokenizing a record
/// takes about 200 bytes of memory per byte of it for a moment, which the memory estimate
/// counts for the longest line allowed; a corpus of longer records raises the limit.
pub const MAX_LINE_BYTES: u64 = 1 << 20;
/// Default `data.max_file_bytes`: 4 GiB.
pub const MAX_FILE_BYTES: u64 = 4 << 30;

fn is_max_line(v: &u64) -> bool {
    *v == MAX_LINE_BYTES
}

fn is_max_file(v: &u64) -> bool {
    *v == MAX_FILE_BYTES
}

/// The `[data]` section of a job file: what tasks make up the training stream. (The
/// sequence length is the model's, `[model] seq_len`, so the two cannot disagree.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Task families, drawn uniformly.
    pub families: Vec<TaskFamily>,
    /// Scale of the heavy-tailed size law: P(size > k) = scale / (scale + k).
    pub size_scale: f64,
    /// Largest task size (digits, list length, ...).
    pub max_size: u32,
    /// Number of tasks sampled for the dataset summary.
    pub summary_tasks: usize,
    /// `synthetic` (the tasks above) or `jsonl` (the records of `path`). The new fields are
    /// omitted from the serialized config at their defaults, so the synthetic job's files
    /// and fingerprint are unchanged.
    #[serde(skip_serializing_if = "DataSource::is_synthetic")]
    pub source: DataSource,
    /// The JSONL file of `source = "jsonl"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// A tokenizer.json, a model directory holding one, or `"chars"` (the character
    /// tokenizer) for `source = "jsonl"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// Longest JSONL line read, in bytes (a longer one is an error naming its line).
    #[serde(skip_serializing_if = "is_max_line")]
    pub max_line_bytes: u64,
    /// Largest JSONL file read, in bytes (checked before reading).
    #[serde(skip_serializing_if = "is_max_file")]
    pub max_file_bytes: u64,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            families: TaskFamily::ALL.to_vec(),
            size_scale: 1.5,
            max_size: 24,
            summary_tasks: 4000,
            source: DataSource::Synthetic,
            path: None,
            tokenizer: None,
            max_line_bytes: MAX_LINE_BYTES,
            max_file_bytes: MAX_FILE_BYTES,
        }
    }
}

impl DataConfig {
    /// The stream's tokenizer: the character tokenizer for the synthetic tasks, else
    /// `data.tokenizer`'s (read here).
    pub fn text_tokenizer(&self) -> Result<TextTokenizer, DataError> {
        match (self.source, &self.tokenizer) {
            (DataSource::Synthetic, _) => Ok(TextTokenizer::Chars(Box::default())),
            (DataSource::Jsonl, Some(path)) => TextTokenizer::load(path),
            (DataSource::Jsonl, None) => Err(no_tokenizer()),
        }
    }

    /// The number of ids of `data.tokenizer` for a `jsonl` source (reading the tokenizer),
    /// `None` for the synthetic tasks.
    pub fn tokenizer_vocab(&self) -> Result<Option<usize>, DataError> {
        match (self.source, &self.tokenizer) {
            (DataSource::Jsonl, Some(_)) => Ok(Some(self.text_tokenizer()?.vocab_size())),
            _ => Ok(None),
        }
    }

    /// Checks the values a deserializer cannot: non-empty families, positive sizes, a path
    /// and a tokenizer for `jsonl`. Reads no file.
    pub fn validate(&self) -> Result<(), DataError> {
        if self.source == DataSource::Jsonl {
            if self.path.is_none() {
                return Err(DataError::Invalid {
                    field: "data.path",
                    reason: "source = \"jsonl\" needs the JSONL file's path".into(),
                });
            }
            if self.tokenizer.is_none() {
                return Err(no_tokenizer());
            }
            if self.max_line_bytes == 0 {
                return Err(DataError::Invalid {
                    field: "data.max_line_bytes",
                    reason: "must be at least 1".into(),
                });
            }
        }
        if self.summary_tasks == 0 {
            return Err(DataError::Invalid {
                field: "data.summary_tasks",
                reason: "must be at least 1".into(),
            });
        }
        // The generator checks families, size_scale and max_size.
        TaskGenerator::new(
            &self.families,
            self.size_scale,
            self.max_size,
            SplitMix64::new(0),
        )
        .map(|_| ())
    }
}

/// A `jsonl` source without `data.tokenizer`.
fn no_tokenizer() -> DataError {
    DataError::Invalid {
        field: "data.tokenizer",
        reason: "source = \"jsonl\" needs a tokenizer: a tokenizer.json, a model directory, \
                 or \"chars\""
            .into(),
    }
}

#[cfg(test)]
mod file_tests;
#[cfg(test)]
mod tests;
