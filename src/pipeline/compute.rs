//! [`RankCompute`]: the real model behind the actor runtime's [`StageCompute`] trait.
//!
//! One `RankCompute` is one rank: the [`ModelChunk`]s of the stages the plan places on it
//! (the model is cut into `plan.stages` chunks by [`Cut::Even`], whatever the placement),
//! its own backend, its own AdamW over just those chunks, and access to the step's data.
//! F, I, W and B map one to one onto the chunk's `forward`, `backward_input`,
//! `backward_weight` and `backward`; payloads are the backend's buffers, moved, never
//! copied. Stage 0 reads the step's input tokens and the last stage its targets and loss
//! scales from the shared [`StepFeed`], which builds them with the reference trainer's own
//! functions.
//!
//! The optimizer step is the reference trainer's: the rank reports its `Σ g²`
//! ([`StageCompute::grad_stats`]), the runtime decides from every rank's statistics whether
//! to clip (and by how much) or skip, and [`StageCompute::apply_step`] runs AdamW at the
//! learning rate of the step with that clip factor. The runtime runs a rank's iterations
//! strictly in order, so the rank counts its own iterations to know which step a forward
//! belongs to.

use std::collections::BTreeMap;
use std::sync::Arc;

use pipefill_actors::{GradStats, StageCompute, StepDecision};

use super::PipelineError;
use super::shared::{RankFinal, Shared};
use crate::model::checkpoint::HostTensor;
use crate::model::{
    AdamW, AdamWConfig, ChunkGrad, ChunkInput, ChunkOutput, LrSchedule, ModelChunk, Shape,
};
use crate::tensor::Backend;

/// One rank of a pipelined model (see the module docs).
pub struct RankCompute<B: Backend> {
    rank: usize,
    backend: B,
    /// The stages this rank holds, by stage index.
    chunks: BTreeMap<u32, ModelChunk<B>>,
    optimizer: AdamW<B>,
    lr: LrSchedule,
    shared: Arc<Shared>,
    /// The step of iteration 0 (non-zero when resuming).
    first_step: u64,
    /// Iterations this rank has completed (its optimizer steps).
    done: u64,
    /// Iterations of the run: after the last, the rank hands over its final state.
    iterations: u64,
}

impl<B: Backend> RankCompute<B> {
    /// Rank `rank` holding `chunks` (each chunk's own stage index decides where it sits).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rank: usize,
        backend: B,
        chunks: Vec<ModelChunk<B>>,
        adamw: AdamWConfig,
        lr: LrSchedule,
        shared: Arc<Shared>,
        first_step: u64,
        iterations: u64,
    ) -> Self {
        RankCompute {
            rank,
            backend,
            chunks: chunks.into_iter().map(|c| (c.stage() as u32, c)).collect(),
            optimizer: AdamW::new(adamw),
            lr,
            shared,
            first_step,
            done: 0,
            iterations,
        }
    }

    /// The optimizer, e.g. to load a checkpoint's moments before the run.
    pub(crate) fn optimizer_mut(&mut self) -> &mut AdamW<B> {
        &mut self.optimizer
    }

    /// The chunks this rank holds, mutable (to load parameters before the run).
    pub(crate) fn chunks_mut(&mut self) -> impl Iterator<Item = &mut ModelChunk<B>> {
        self.chunks.values_mut()
    }

    /// The step the rank is working on.
    fn step(&self) -> u64 {
        self.first_step + self.done
    }

    fn chunk(&mut self, stage: u32) -> Result<&mut ModelChunk<B>, PipelineError> {
        let rank = self.rank;
        self.chunks
            .get_mut(&stage)
            .ok_or(PipelineError::NotHere { rank, stage })
    }

    /// The final parameters and optimizer state of this rank.
    fn export(&self) -> Result<RankFinal, PipelineError> {
        let mut stages = Vec::with_capacity(self.chunks.len());
        for (&stage, chunk) in &self.chunks {
            let mut params = Vec::new();
            for p in chunk.params() {
                params.push(HostTensor {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    data: self
                        .backend
                        .to_host(&p.value)
                        .map_err(crate::model::ModelError::from)?,
                });
            }
            stages.push((stage, params));
        }
        Ok(RankFinal {
            stages,
            optimizer: self.optimizer.state(&self.backend)?,
        })
    }
}

impl<B: Backend> StageCompute for RankCompute<B> {
    type Tensor = B::Buf;
    type Error = PipelineError;

    fn forward(
        &mut self,
        stage: u32,
        microbatch: u32,
        input: Option<B::Buf>,
    ) -> Result<Option<B::Buf>, PipelineError> {
        let step = self.step();
        let data = self.shared.feed.get(step);
        let mb = data
            .batches
            .get(microbatch as usize)
            .ok_or(PipelineError::NoMicroBatch {
                microbatch,
                have: data.batches.len(),
            })?;
        let shape = Shape {
            batch: mb.rows,
            seq: mb.seq_len,
        };
        let chunk = self.chunk(stage)?;
        let input = match input {
            Some(h) => ChunkInput::Hidden(h),
            None => ChunkInput::Tokens(&mb.inputs),
        };
        let targets = chunk.is_last().then_some(mb.targets.as_slice());
        match chunk.forward(microbatch as usize, shape, input, targets)? {
            ChunkOutput::Hidden(h) => Ok(Some(h)),
            ChunkOutput::Loss { loss, .. } => {
                self.shared.record_loss(step, microbatch, loss);
                Ok(None)
            }
            ChunkOutput::Logits(_) => Err(PipelineError::Stage {
                stage,
                reason: "the last stage returned logits during training".into(),
            }),
        }
    }

    fn backward_input(
        &mut self,
        stage: u32,
        microbatch: u32,
        grad: Option<B::Buf>,
    ) -> Result<Option<B::Buf>, PipelineError> {
        let grad = self.chunk_grad(microbatch, grad)?;
        Ok(self
            .chunk(stage)?
            .backward_input(microbatch as usize, grad)?)
    }

    fn backward_weight(&mut self, stage: u32, microbatch: u32) -> Result<(), PipelineError> {
        Ok(self.chunk(stage)?.backward_weight(microbatch as usize)?)
    }

    fn backward(
        &mut self,
        stage: u32,
        microbatch: u32,
        grad: Option<B::Buf>,
    ) -> Result<Option<B::Buf>, PipelineError> {
        let grad = self.chunk_grad(microbatch, grad)?;
        Ok(self.chunk(stage)?.backward(microbatch as usize, grad)?)
    }

    fn grad_stats(&mut self, iteration: u64) -> Result<GradStats, PipelineError> {
        self.check_iteration(iteration)?;
        let mut own = Vec::with_capacity(self.chunks.len());
        let mut stats = GradStats::default();
        for (&stage, chunk) in &self.chunks {
            let mut sq = Vec::new();
            for p in chunk.params() {
                let q = self
                    .backend
                    .sum_squares(&p.grad)
                    .map_err(crate::model::ModelError::from)?;
                // Σ g² is NaN or infinite exactly when some entry is (or overflows).
                stats.nonfinite |= !q.is_finite();
                stats.sq_norm += q;
                sq.push(q);
            }
            own.push((stage, sq));
        }
        self.shared.post_sq_norms(self.step(), own);
        Ok(stats)
    }

    fn apply_step(
        &mut self,
        iteration: u64,
        decision: StepDecision,
        _speculative: bool,
    ) -> Result<(), PipelineError> {
        // Never speculative: `can_roll_back` is false, so the runtime defers the step until
        // it knows every rank's statistics.
        self.check_iteration(iteration)?;
        let step = self.step();
        let lr = self.lr.lr(step);
        if let StepDecision::Apply { clip_scale } = decision {
            let params = self.chunks.values_mut().flat_map(|c| c.params_mut());
            self.optimizer.step(&self.backend, params, lr, clip_scale)?;
        }
        for chunk in self.chunks.values_mut() {
            chunk.zero_grads()?;
        }
        self.done += 1;
        if self.done == self.iterations {
            self.shared.deposit_final(self.rank, self.export()?);
        } else {
            self.shared.feed.prefetch(self.step());
        }
        self.shared.stepped(step, lr);
        Ok(())
    }
}

impl<B: Backend> RankCompute<B> {
    /// The runtime calls the step of iteration `iteration` once, in order.
    fn check_iteration(&self, iteration: u64) -> Result<(), PipelineError> {
        if iteration == self.done {
            return Ok(());
        }
        Err(PipelineError::OutOfOrder {
            rank: self.rank,
            expected: self.done,
            got: iteration,
        })
    }

    /// What the backward of `microbatch` starts from: the received gradient, or at the
    /// last stage the micro-batch's loss scale.
    fn chunk_grad(
        &self,
        microbatch: u32,
        grad: Option<B::Buf>,
    ) -> Result<ChunkGrad<B>, PipelineError> {
        if let Some(g) = grad {
            return Ok(ChunkGrad::Hidden(g));
        }
        let data = self.shared.feed.get(self.step());
        let scale =
            data.scales
                .get(microbatch as usize)
                .copied()
                .ok_or(PipelineError::NoMicroBatch {
                    microbatch,
                    have: data.scales.len(),
                })?;
        Ok(ChunkGrad::Loss(scale))
    }
}
