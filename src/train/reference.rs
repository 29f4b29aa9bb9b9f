//! The single-device reference trainer: the whole model on one backend, no pipeline.
//!
//! It is the oracle every pipeline schedule must reproduce, so everything that decides an
//! update is explicit and deterministic:
//! - **data**: [`step_micro_batches`] returns step `k`'s micro-batches as a pure function
//!   of the data seed, `k` and the batch shape (see [`crate::data::batch`]);
//! - **loss normalisation**: micro-batch `i` backpropagates with
//!   `scale_i = tokens_i / Σ tokens`, so the accumulated gradient is the gradient of the
//!   mean loss over the whole mini-batch, whatever the number of micro-batches;
//! - **update**: global-norm clipping, then AdamW with the learning rate of
//!   [`lr_schedule`] at step `k`.
//!
//! A pipeline runtime runs the same forward/backward calls per (stage, micro-batch) in a
//! different order; the gradients differ only by floating-point summation order.

use std::time::Instant;

use super::{StepMetrics, TrainError};
use crate::config::TrainConfig;
use crate::data::{DataConfig, MicroBatch, StepData};
use crate::model::ModelError;
use crate::model::checkpoint::Checkpoint;
use crate::model::{AdamW, AdamWConfig, Cut, Gpt, GptConfig, LrSchedule, Shape};
use crate::tensor::{Backend, CpuBackend};

/// Step `step`'s micro-batches: `train.micro_batches` micro-batches of
/// `train.micro_batch_size` consecutive rows of the step's packed batch.
pub fn step_micro_batches(data: &StepData, train: &TrainConfig, step: u64) -> Vec<MicroBatch> {
    data.micro_batches(step, train.micro_batches, train.micro_batch_size)
}

/// `d objective / d loss` of each micro-batch: its share of the step's counted target
/// tokens (an SFT prompt's ignored targets do not count), so that the accumulated gradient
/// is that of the mean loss over the whole mini-batch. A pipeline's last stage starts each
/// micro-batch's backward from the same value. A step with no counted target scales by 0.
pub fn loss_scales(batches: &[MicroBatch]) -> Vec<f32> {
    let total: usize = batches.iter().map(MicroBatch::counted).sum();
    batches
        .iter()
        .map(|mb| {
            if total == 0 {
                0.0
            } else {
                mb.counted() as f32 / total as f32
            }
        })
        .collect()
}

/// The step's loss from its micro-batches' mean losses: the token-weighted mean, summed in
/// `f64` in micro-batch order.
pub fn combine_losses(losses: &[f32], scales: &[f32]) -> f32 {
    losses
        .iter()
        .zip(scales)
        .map(|(&l, &s)| f64::from(l) * f64::from(s))
        .sum::<f64>() as f32
}

/// The learning-rate schedule of `train`: linear warmup to `lr`, cosine decay to `lr / 10`
/// at the last step.
pub fn lr_schedule(train: &TrainConfig) -> LrSchedule {
    LrSchedule {
        peak_lr: train.lr,
        min_lr: train.lr / 10.0,
        warmup_steps: train.warmup,
        total_steps: train.steps,
    }
}

/// The AdamW hyper-parameters of `train` (betas and epsilon are the model's defaults).
pub fn adamw_config(train: &TrainConfig) -> AdamWConfig {
    AdamWConfig {
        weight_decay: train.weight_decay,
        max_grad_norm: train.clip,
        ..AdamWConfig::default()
    }
}

/// CPU threads for `train.threads` (0: every available core).
pub fn cpu_threads(train: &TrainConfig) -> usize {
    match train.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// The CPU backend a job's whole model trains on: `train.threads` threads, storing in
/// `train.precision`.
pub fn cpu_backend(train: &TrainConfig) -> Result<CpuBackend, crate::tensor::TensorError> {
    Ok(CpuBackend::new(cpu_threads(train))?.with_storage(train.precision))
}

/// Trains a whole model on one backend: gradient accumulation over micro-batches, then
/// one clipped AdamW update per step.
pub struct Trainer<B: Backend> {
    backend: B,
    train: TrainConfig,
    model: Gpt<B>,
    optimizer: AdamW<B>,
    data: StepData,
    lr: LrSchedule,
    step: u64,
}

impl Trainer<CpuBackend> {
    /// The reference trainer on the job's CPU backend ([`cpu_backend`]).
    pub fn reference(
        model: &GptConfig,
        data: &DataConfig,
        train: &TrainConfig,
    ) -> Result<Self, TrainError> {
        let backend = cpu_backend(train).map_err(ModelError::from)?;
        Self::with_backend(backend, model, data, train)
    }
}

impl<B: Backend> Trainer<B> {
    /// The reference trainer on `backend`, at step 0 with a freshly initialised model.
    pub fn with_backend(
        backend: B,
        model: &GptConfig,
        data: &DataConfig,
        train: &TrainConfig,
    ) -> Result<Self, TrainError> {
        train.validate()?;
        model.validate()?;
        let data = StepData::new(data.clone(), model.seq_len, train.seed)?;
        Self::with_data(backend, model, data, train)
    }

    /// The reference trainer on `backend` over `data` already loaded (a JSONL dataset is
    /// tokenized once for the summary and the run); `data` must be built for the model's
    /// `seq_len` and the job's `train.seed`.
    pub fn with_data(
        backend: B,
        model: &GptConfig,
        data: StepData,
        train: &TrainConfig,
    ) -> Result<Self, TrainError> {
        train.validate()?;
        model.validate()?;
        for (field, data_has, job_has) in [
            ("model.seq_len", data.seq_len() as u64, model.seq_len as u64),
            ("train.seed", data.seed(), train.seed),
        ] {
            if data_has != job_has {
                return Err(TrainError::StepData {
                    field,
                    job: job_has,
                    data: data_has,
                });
            }
        }
        let mut gpt = Gpt::new(model, backend.clone(), &Cut::Even(1))?;
        gpt.set_recompute(train.recompute.strongest())?;
        Ok(Self {
            model: gpt,
            optimizer: AdamW::new(adamw_config(train)),
            backend,
            train: train.clone(),
            data,
            lr: lr_schedule(train),
            step: 0,
        })
    }

    /// The next step to run (= steps completed).
    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn model(&self) -> &Gpt<B> {
        &self.model
    }

    pub fn model_mut(&mut self) -> &mut Gpt<B> {
        &mut self.model
    }

    pub fn data(&self) -> &StepData {
        &self.data
    }

    pub fn train_config(&self) -> &TrainConfig {
        &self.train
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Step `step`'s micro-batches (see [`step_micro_batches`]).
    pub fn micro_batches(&self, step: u64) -> Vec<MicroBatch> {
        step_micro_batches(&self.data, &self.train, step)
    }

    /// Zeroes the gradients, then runs forward and backward of every micro-batch in
    /// `batches`, accumulating the gradient of their mean loss. Returns that mean loss and
    /// the number of target tokens.
    pub fn accumulate(&mut self, batches: &[MicroBatch]) -> Result<(f32, usize), TrainError> {
        self.model.zero_grads()?;
        let scales = loss_scales(batches);
        let mut losses = Vec::with_capacity(batches.len());
        for (i, (mb, &scale)) in batches.iter().zip(&scales).enumerate() {
            let shape = Shape {
                batch: mb.rows,
                seq: mb.seq_len,
            };
            losses.push(
                self.model
                    .forward_backward(i, shape, &mb.inputs, &mb.targets, scale)?,
            );
        }
        let tokens = batches.iter().map(MicroBatch::tokens).sum();
        Ok((combine_losses(&losses, &scales), tokens))
    }

    /// Clips and applies the accumulated gradients with the learning rate of the current
    /// step, then advances the step. Returns `(lr, gradient norm before clipping)`.
    pub fn apply_update(&mut self) -> Result<(f32, f32), TrainError> {
        let lr = self.lr.lr(self.step);
        let norm = self.optimizer.step_chunks(self.model.chunks_mut(), lr)?;
        self.step += 1;
        Ok((lr, norm as f32))
    }

    /// One whole training step on the current step's data.
    pub fn train_step(&mut self) -> Result<StepMetrics, TrainError> {
        let started = Instant::now();
        let step = self.step;
        let batches = self.micro_batches(step);
        let (loss, tokens) = self.accumulate(&batches)?;
        if !loss.is_finite() {
            return Err(TrainError::Diverged { step, loss });
        }
        let (lr, grad_norm) = self.apply_update()?;
        Ok(StepMetrics {
            step,
            loss,
            lr,
            grad_norm,
            tokens,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// The mean loss of step `step`'s data under the current parameters (no gradients).
    pub fn eval_loss(&mut self, step: u64) -> Result<f32, TrainError> {
        let batches = self.micro_batches(step);
        let mut losses = Vec::with_capacity(batches.len());
        for mb in &batches {
            let shape = Shape {
                batch: mb.rows,
                seq: mb.seq_len,
            };
            losses.push(self.model.loss(shape, &mb.inputs, &mb.targets)?);
        }
        Ok(combine_losses(&losses, &loss_scales(&batches)))
    }

    /// A checkpoint of the model, the optimizer and the data position.
    pub fn checkpoint(&self) -> Result<Checkpoint, TrainError> {
        Ok(Checkpoint::capture(
            &self.model,
            &self.optimizer,
            self.step,
            self.data.seed(),
        )?)
    }

    /// [`Trainer::checkpoint`] at the end of the run: the optimizer's moments move into it
    /// instead of being copied, so the run's last moments do not hold the state twice. The
    /// trainer takes no further step.
    pub fn final_checkpoint(&mut self) -> Result<Checkpoint, TrainError> {
        Ok(Checkpoint::capture_final(
            &self.model,
            &mut self.optimizer,
            self.step,
            self.data.seed(),
        )?)
    }

    /// Continues from `checkpoint`: parameters, optimizer state and step. The model shape
    /// and data seed must be this trainer's.
    pub fn restore(&mut self, checkpoint: &Checkpoint) -> Result<(), TrainError> {
        checkpoint.restore(&mut self.model, &mut self.optimizer, self.data.seed())?;
        self.step = checkpoint.meta.step;
        Ok(())
    }
}
