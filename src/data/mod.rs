//! Training data that needs no download: synthetic reasoning tasks with verifiable
//! answers and long-tailed solution lengths, a character-level tokenizer, and the
//! deterministic packing of tasks into each step's micro-batches.
//!
//! - [`rng`]: SplitMix64, the platform-independent generator everything is seeded from.
//! - [`tasks`]: task families, [`Task`] (prompt, worked solution, answer, checker) and the
//!   seeded [`TaskGenerator`].
//! - [`tokenizer`]: the fixed character vocabulary.
//! - [`batch`]: [`StepData`], step `k`'s micro-batches as a pure function of the seed.
//! - [`summary`]: [`DatasetSummary`], counts and the solution-length histogram.

pub mod batch;
pub mod rng;
pub mod summary;
pub mod tasks;
pub mod tokenizer;

use serde::{Deserialize, Serialize};

pub use batch::{MicroBatch, StepData};
pub use rng::SplitMix64;
pub use summary::DatasetSummary;
pub use tasks::{Task, TaskFamily, TaskGenerator, parse_answer};
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
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            families: TaskFamily::ALL.to_vec(),
            size_scale: 1.5,
            max_size: 24,
            summary_tasks: 4000,
        }
    }
}

impl DataConfig {
    /// Checks the values a deserializer cannot: non-empty families, positive sizes.
    pub fn validate(&self) -> Result<(), DataError> {
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

#[cfg(test)]
mod tests;
