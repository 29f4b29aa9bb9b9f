//! Packing documents into fixed-length token windows and splitting a step's batch into
//! micro-batches.
//!
//! The data of step `k` is a pure function of `(seed, k)` and the batch shape: a task
//! stream seeded for that step is tokenized, concatenated, and cut into `rows` windows of
//! `seq_len + 1` tokens (inputs are a window's first `seq_len`, targets its last
//! `seq_len`). Micro-batches are consecutive runs of rows, so splitting the same batch
//! into 1×B or k×(B/k) micro-batches covers the same rows in the same order: the
//! reference trainer and every pipeline schedule see exactly the same data.

use super::rng::SplitMix64;
use super::tasks::TaskGenerator;
use super::tokenizer::Tokenizer;
use super::{DataConfig, DataError};

/// One micro-batch: `rows` sequences of `seq_len` input tokens and their next-token targets,
/// row-major (`inputs[r * seq_len + t]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MicroBatch {
    pub rows: usize,
    pub seq_len: usize,
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
}

impl MicroBatch {
    /// Number of target tokens (the loss is a mean over them).
    pub fn tokens(&self) -> usize {
        self.rows * self.seq_len
    }
}

/// The deterministic source of every step's training data.
#[derive(Debug, Clone)]
pub struct StepData {
    config: DataConfig,
    seq_len: usize,
    seed: u64,
    tokenizer: Tokenizer,
}

impl StepData {
    /// Data for `config` in sequences of `seq_len` tokens, seeded by `seed`. Fails if the
    /// config is invalid or `seq_len` is 0.
    pub fn new(config: DataConfig, seq_len: usize, seed: u64) -> Result<Self, DataError> {
        config.validate()?;
        if seq_len == 0 {
            return Err(DataError::Invalid {
                field: "model.seq_len",
                reason: "must be at least 1".into(),
            });
        }
        Ok(Self {
            config,
            seq_len,
            seed,
            tokenizer: Tokenizer::new(),
        })
    }

    pub fn config(&self) -> &DataConfig {
        &self.config
    }

    /// Tokens per sequence (windows hold one more).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The task stream that feeds step `step`.
    pub fn tasks_for_step(&self, step: u64) -> TaskGenerator {
        TaskGenerator::new(
            &self.config.families,
            self.config.size_scale,
            self.config.max_size,
            SplitMix64::derive(self.seed, step),
        )
        .expect("config validated in StepData::new")
    }

    /// The `rows` windows of `seq_len + 1` tokens of step `step`, concatenated row-major.
    pub fn windows(&self, step: u64, rows: usize) -> Vec<u32> {
        let window = self.seq_len + 1;
        let need = rows * window;
        let mut stream = Vec::with_capacity(need + 1024);
        let mut tasks = self.tasks_for_step(step);
        while stream.len() < need {
            let task = tasks.next_task();
            // Generated text only uses vocabulary characters (tested for every family).
            let doc = self
                .tokenizer
                .encode_document(&task.text())
                .expect("generated tasks use only vocabulary characters");
            stream.extend_from_slice(&doc);
        }
        stream.truncate(need);
        stream
    }

    /// Step `step`'s batch of `micro_batches × micro_batch_size` rows, split into
    /// `micro_batches` micro-batches of consecutive rows.
    pub fn micro_batches(
        &self,
        step: u64,
        micro_batches: usize,
        micro_batch_size: usize,
    ) -> Vec<MicroBatch> {
        let seq_len = self.seq_len;
        let window = seq_len + 1;
        let windows = self.windows(step, micro_batches * micro_batch_size);
        windows
            .chunks(micro_batch_size * window)
            .map(|chunk| {
                let mut inputs = Vec::with_capacity(micro_batch_size * seq_len);
                let mut targets = Vec::with_capacity(micro_batch_size * seq_len);
                for w in chunk.chunks(window) {
                    inputs.extend_from_slice(&w[..seq_len]);
                    targets.extend_from_slice(&w[1..]);
                }
                MicroBatch {
                    rows: micro_batch_size,
                    seq_len,
                    inputs,
                    targets,
                }
            })
            .collect()
    }
}
