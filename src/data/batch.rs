//! Packing documents into fixed-length token windows and splitting a step's batch into
//! micro-batches.
//!
//! The data of step `k` is a pure function of `(seed, k)` and the batch shape: a task
//! stream seeded for that step is tokenized, concatenated, and cut into `rows` windows of
//! `seq_len + 1` tokens (inputs are a window's first `seq_len`, targets its last
//! `seq_len`). Micro-batches are consecutive runs of rows, so splitting the same batch
//! into 1×B or k×(B/k) micro-batches covers the same rows in the same order: the
//! reference trainer and every pipeline schedule see exactly the same data.
//!
//! With `[data] source = "jsonl"` the stream is made of the file's documents instead
//! ([`Documents`], read and tokenized once in [`StepData::new`]): step `k` draws documents
//! uniformly with the generator seeded for `(seed, k)` (the first one from a random offset
//! when it is longer than a window, so every part of a long text is reachable) and packs
//! them the same way. A target whose token is not a training target (an SFT prompt, a chat's
//! user turns) is [`IGNORE_TARGET`].

use std::sync::Arc;

use super::config::{DataConfig, DataSource};
use super::documents::{Documents, Tokenized};
use super::error::DataError;
use super::jsonl::read_records;
use super::rng::SplitMix64;
use super::tasks::TaskGenerator;
use super::text_tokenizer::TextTokenizer;
use super::tokenizer::Tokenizer;
use crate::tensor::IGNORE_TARGET;

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
    /// Number of target positions (`rows × seq_len`).
    pub fn tokens(&self) -> usize {
        self.rows * self.seq_len
    }

    /// Number of counted targets (not [`IGNORE_TARGET`]): the loss is a mean over them.
    pub fn counted(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_TARGET).count()
    }
}

/// What the step's token stream is made of.
#[derive(Debug, Clone)]
enum Stream {
    /// The synthetic task stream.
    Tasks,
    /// A JSONL file's documents.
    Documents(Arc<Documents>),
}

/// The deterministic source of every step's training data.
#[derive(Debug, Clone)]
pub struct StepData {
    config: DataConfig,
    seq_len: usize,
    seed: u64,
    tokenizer: Tokenizer,
    text: TextTokenizer,
    stream: Stream,
}

impl StepData {
    /// Data for `config` in sequences of `seq_len` tokens, seeded by `seed`. Fails if the
    /// config is invalid or `seq_len` is 0.
    pub fn new(config: DataConfig, seq_len: usize, seed: u64) -> Result<Self, DataError> {
        Self::load(config, seq_len, seed, &mut |_| {})
    }

    /// [`StepData::new`], telling `progress` how far tokenizing a JSONL dataset got (a
    /// synthetic source reads nothing and reports nothing).
    pub fn load(
        config: DataConfig,
        seq_len: usize,
        seed: u64,
        progress: &mut dyn FnMut(Tokenized),
    ) -> Result<Self, DataError> {
        config.validate()?;
        if seq_len == 0 {
            return Err(DataError::Invalid {
                field: "model.seq_len",
                reason: "must be at least 1".into(),
            });
        }
        let text = config.text_tokenizer()?;
        let stream = match config.source {
            DataSource::Synthetic => Stream::Tasks,
            DataSource::Jsonl => {
                let path = config.path.as_deref().expect("validated: jsonl has a path");
                let lines = read_records(path, config.max_file_bytes, config.max_line_bytes)?;
                let docs = Documents::build(&lines, path, &text, progress)?;
                if docs.is_empty() {
                    return Err(DataError::File {
                        path: path.to_path_buf(),
                        reason: "has no records".into(),
                    });
                }
                Stream::Documents(Arc::new(docs))
            }
        };
        Ok(Self {
            config,
            seq_len,
            seed,
            tokenizer: Tokenizer::new(),
            text,
            stream,
        })
    }

    /// The tokenizer of the stream: the character tokenizer for the synthetic tasks, else
    /// `data.tokenizer`'s.
    pub fn text_tokenizer(&self) -> &TextTokenizer {
        &self.text
    }

    /// Number of ids the stream may hold (the model's `vocab` must be at least this).
    pub fn vocab_size(&self) -> usize {
        self.text.vocab_size()
    }

    /// The JSONL documents of a `jsonl` source.
    pub fn documents(&self) -> Option<&Documents> {
        match &self.stream {
            Stream::Tasks => None,
            Stream::Documents(d) => Some(d),
        }
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

    /// The character tokenizer of the synthetic tasks.
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
        match &self.stream {
            Stream::Tasks => self.task_windows(step, rows),
            Stream::Documents(docs) => self.document_windows(docs, step, rows).0,
        }
    }

    /// [`windows`](Self::windows) of a document stream, with each id's target flag.
    fn document_windows(&self, docs: &Documents, step: u64, rows: usize) -> (Vec<u32>, Vec<bool>) {
        let window = self.seq_len + 1;
        let need = rows * window;
        let mut ids = Vec::with_capacity(need);
        let mut targets = Vec::with_capacity(need);
        let mut rng = SplitMix64::derive(self.seed, step);
        let mut first = true;
        while ids.len() < need {
            let d = rng.below(docs.len() as u64) as usize;
            let (doc_ids, doc_targets) = docs.document(d);
            let from = if first && doc_ids.len() > window {
                rng.below((doc_ids.len() - window + 1) as u64) as usize
            } else {
                0
            };
            first = false;
            let take = (need - ids.len()).min(doc_ids.len() - from);
            ids.extend_from_slice(&doc_ids[from..from + take]);
            targets.extend_from_slice(&doc_targets[from..from + take]);
        }
        (ids, targets)
    }

    /// [`windows`](Self::windows) of the synthetic task stream.
    fn task_windows(&self, step: u64, rows: usize) -> Vec<u32> {
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
        let rows = micro_batches * micro_batch_size;
        let (windows, flags) = match &self.stream {
            Stream::Tasks => (self.task_windows(step, rows), None),
            Stream::Documents(docs) => {
                let (ids, flags) = self.document_windows(docs, step, rows);
                (ids, Some(flags))
            }
        };
        let per = micro_batch_size * window;
        windows
            .chunks(per)
            .enumerate()
            .map(|(m, chunk)| {
                let mut inputs = Vec::with_capacity(micro_batch_size * seq_len);
                let mut targets = Vec::with_capacity(micro_batch_size * seq_len);
                for (r, w) in chunk.chunks(window).enumerate() {
                    inputs.extend_from_slice(&w[..seq_len]);
                    match &flags {
                        None => targets.extend_from_slice(&w[1..]),
                        Some(flags) => {
                            let at = m * per + r * window;
                            let f = &flags[at + 1..at + window];
                            targets.extend(
                                w[1..]
                                    .iter()
                                    .zip(f)
                                    .map(|(&t, &keep)| if keep { t } else { IGNORE_TARGET }),
                            );
                        }
                    }
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
