//! The job's `[data]` section ([`DataConfig`]): where the training stream comes from and
//! the bounds on what it reads.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::error::DataError;
use super::rng::SplitMix64;
use super::tasks::{TaskFamily, TaskGenerator};
use super::text_tokenizer::TextTokenizer;

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
