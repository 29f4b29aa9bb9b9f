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
//! - [`config`]: the job's `[data]` section ([`DataConfig`]); [`error`]: [`DataError`].

pub mod batch;
pub mod chat;
pub mod config;
pub mod documents;
pub mod error;
pub mod hf_tokenizer;
pub mod jsonl;
pub mod reward;
pub mod rng;
pub mod summary;
pub mod tasks;
pub mod text_tokenizer;
pub mod tokenizer;

pub use batch::{MicroBatch, StepData};
pub use config::{DataConfig, DataSource, MAX_FILE_BYTES, MAX_LINE_BYTES};
pub use documents::Tokenized;
pub use error::DataError;
pub use rng::SplitMix64;
pub use summary::DatasetSummary;
pub use tasks::{Task, TaskFamily, TaskGenerator, parse_answer};
pub use text_tokenizer::TextTokenizer;
pub use tokenizer::Tokenizer;

#[cfg(test)]
mod file_tests;
#[cfg(test)]
mod tests;
