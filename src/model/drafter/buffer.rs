//! The drafter's training data: [`DraftRow`]s (one sequence's final hidden states and
//! tokens) in a bounded [`DraftBuffer`] that keeps the current and the previous target step,
//! shared through a [`DraftBufferHandle`].
//!
//! Why no distributions: a row's next-token distributions are `softmax(h · W_head)` of its own
//! hidden states, so a slice recomputes them through the drafter's frozen head
//! ([`super::Drafter::batch`]) for the few rows it samples; keeping them would cost
//! `positions × vocab` floats a row (400 MB for 2048 rows at a 49K vocabulary) against
//! `positions × d_model`.
//!
//! Why two generations: in RL the rows of one step arrive shortest first (short rollouts
//! finish early), so a buffer of the current step alone would be biased to short sequences
//! whenever a slice runs early in a step; the previous step's rows, long ones included,
//! stay available until the step after.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::{DrafterConfig, Result};
use crate::data::SplitMix64;
use crate::model::ModelError;
use crate::model::{GptConfig, Shape};
use crate::tensor::IGNORE_TARGET;

/// One sequence as the target's last stage saw it: `len` positions.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftRow {
    /// Final hidden states (the LM head's input) `[len, d_model]`.
    pub hidden: Vec<f32>,
    /// Next-token targets `[len]`: `targets[t]` is the token at position `t + 1`
    /// ([`IGNORE_TARGET`] where unknown).
    pub targets: Vec<u32>,
    /// Target step that produced the row.
    pub step: u64,
}

impl DraftRow {
    /// Positions in the sequence.
    pub fn len(&self) -> usize {
        self.targets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// Whether pair `t` trains: its token is known and a next position exists.
    pub fn pair_valid(&self, t: usize) -> bool {
        t + 1 < self.len() && self.targets[t] != IGNORE_TARGET
    }

    /// Training pairs in the row (see [`DraftRow::pair_valid`]).
    pub fn pairs(&self) -> usize {
        (0..self.len()).filter(|&t| self.pair_valid(t)).count()
    }

    /// Checks the lengths against `d_model` and `vocab`.
    pub fn check(&self, d_model: usize, vocab: usize) -> Result<()> {
        let n = self.len();
        let bad_id = self
            .targets
            .iter()
            .position(|&t| t != IGNORE_TARGET && t as usize >= vocab);
        let reason = if self.hidden.len() != n * d_model {
            format!(
                "{} hidden values for {n} positions of {d_model}",
                self.hidden.len()
            )
        } else if let Some(p) = bad_id {
            format!(
                "target {} at position {p} is outside the vocabulary {vocab}",
                self.targets[p]
            )
        } else {
            return Ok(());
        };
        Err(ModelError::DrafterInput {
            what: "row",
            reason,
        })
    }
}

/// Rows of the current and the previous target step, each generation at most `capacity`
/// rows (the oldest row of the current step goes first).
#[derive(Debug)]
pub struct DraftBuffer {
    d_model: usize,
    vocab: usize,
    capacity: usize,
    step: Option<u64>,
    current: VecDeque<DraftRow>,
    previous: Vec<DraftRow>,
    dropped: u64,
}

impl DraftBuffer {
    /// An empty buffer for rows of `d_model`-wide hidden states over `vocab` tokens.
    pub fn new(d_model: usize, vocab: usize, capacity: usize) -> Self {
        DraftBuffer {
            d_model,
            vocab,
            capacity: capacity.max(1),
            step: None,
            current: VecDeque::new(),
            previous: Vec::new(),
            dropped: 0,
        }
    }

    /// Width of the hidden states.
    pub fn d_model(&self) -> usize {
        self.d_model
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The target step whose rows are current.
    pub fn step(&self) -> Option<u64> {
        self.step
    }

    /// Starts target step `step`: the current rows become the previous ones (the older
    /// previous rows are dropped). Calling it again for the same step does nothing.
    pub fn begin_step(&mut self, step: u64) {
        if self.step == Some(step) {
            return;
        }
        self.step = Some(step);
        self.previous = self.current.drain(..).collect();
    }

    /// Adds a row to the current step, dropping the oldest current row when full. Rows
    /// without a training pair are not kept.
    pub fn push(&mut self, mut row: DraftRow) -> Result<()> {
        row.check(self.d_model, self.vocab)?;
        if row.pairs() == 0 {
            return Ok(());
        }
        row.step = self.step.unwrap_or(0);
        if self.current.len() == self.capacity {
            self.current.pop_front();
            self.dropped += 1;
        }
        self.current.push_back(row);
        Ok(())
    }

    /// Splits a micro-batch's `hidden: [batch·seq, d]` and `targets: [batch·seq]` into one
    /// row per sequence and pushes them.
    pub fn push_micro_batch(
        &mut self,
        shape: Shape,
        hidden: &[f32],
        targets: &[u32],
    ) -> Result<()> {
        let (n, d) = (shape.tokens(), self.d_model);
        if hidden.len() != n * d || targets.len() != n {
            return Err(ModelError::DrafterInput {
                what: "micro-batch",
                reason: format!(
                    "{shape:?} with {} hidden values, {} targets",
                    hidden.len(),
                    targets.len(),
                ),
            });
        }
        let s = shape.seq;
        for b in 0..shape.batch {
            self.push(DraftRow {
                hidden: hidden[b * s * d..(b + 1) * s * d].to_vec(),
                targets: targets[b * s..(b + 1) * s].to_vec(),
                step: 0,
            })?;
        }
        Ok(())
    }

    /// Rows held (both generations).
    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows of the current step.
    pub fn current_len(&self) -> usize {
        self.current.len()
    }

    /// Rows of the previous step.
    pub fn previous_len(&self) -> usize {
        self.previous.len()
    }

    /// Rows dropped because the current step's generation was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Every row, previous step first.
    pub fn rows(&self) -> impl Iterator<Item = &DraftRow> {
        self.previous.iter().chain(self.current.iter())
    }

    /// `n` rows drawn uniformly, with replacement, over both generations (none when empty).
    pub fn sample(&self, rng: &mut SplitMix64, n: usize) -> Vec<DraftRow> {
        let len = self.len();
        if len == 0 {
            return Vec::new();
        }
        (0..n)
            .map(|_| {
                let i = rng.below(len as u64) as usize;
                match i.checked_sub(self.previous.len()) {
                    None => self.previous[i].clone(),
                    Some(j) => self.current[j].clone(),
                }
            })
            .collect()
    }
    /// `n` rows drawn uniformly, with replacement, from the rows of target step `step` alone
    /// (none when it has none). A planned placement samples this way: once every rank has
    /// finished a step, that step's rows are complete, whatever rows of later steps are
    /// arriving meanwhile, so what is drawn does not depend on timing.
    pub fn sample_step(&self, rng: &mut SplitMix64, n: usize, step: u64) -> Vec<DraftRow> {
        let rows: Vec<&DraftRow> = self.rows().filter(|r| r.step == step).collect();
        if rows.is_empty() {
            return Vec::new();
        }
        (0..n)
            .map(|_| rows[rng.below(rows.len() as u64) as usize].clone())
            .collect()
    }

    /// Whether the buffer holds rows of target step `step`.
    pub fn has_step(&self, step: u64) -> bool {
        self.rows().any(|r| r.step == step)
    }
}

/// A [`DraftBuffer`] shared between the last pipeline stage (which pushes copies) and the
/// drafter trainers (which sample). Cloning shares the same buffer.
#[derive(Clone, Debug)]
pub struct DraftBufferHandle(Arc<Mutex<DraftBuffer>>);

impl DraftBufferHandle {
    /// An empty shared buffer for the target `target` holding `config.advanced.buffer_rows` rows per
    /// step.
    pub fn new(target: &GptConfig, config: &DrafterConfig) -> Self {
        Self::from_buffer(DraftBuffer::new(
            target.d_model,
            target.vocab,
            config.advanced.buffer_rows,
        ))
    }

    pub fn from_buffer(buffer: DraftBuffer) -> Self {
        DraftBufferHandle(Arc::new(Mutex::new(buffer)))
    }

    /// The buffer, locked. A panic of another holder does not make the rows unusable (each
    /// operation leaves the buffer consistent), so a poisoned lock is taken over.
    pub fn lock(&self) -> MutexGuard<'_, DraftBuffer> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// See [`DraftBuffer::begin_step`].
    pub fn begin_step(&self, step: u64) {
        self.lock().begin_step(step);
    }

    /// See [`DraftBuffer::push_micro_batch`].
    pub fn push_micro_batch(&self, shape: Shape, hidden: &[f32], targets: &[u32]) -> Result<()> {
        self.lock().push_micro_batch(shape, hidden, targets)
    }

    /// See [`DraftBuffer::sample`].
    pub fn sample(&self, rng: &mut SplitMix64, n: usize) -> Vec<DraftRow> {
        self.lock().sample(rng, n)
    }

    /// See [`DraftBuffer::sample_step`].
    pub fn sample_step(&self, rng: &mut SplitMix64, n: usize, step: u64) -> Vec<DraftRow> {
        self.lock().sample_step(rng, n, step)
    }

    /// See [`DraftBuffer::has_step`].
    pub fn has_step(&self, step: u64) -> bool {
        self.lock().has_step(step)
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}
