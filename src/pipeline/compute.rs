//! [`RankCompute`]: the real model behind the actor runtime's [`StageCompute`] trait.
//!
//! One `RankCompute` is one rank: the [`ModelChunk`]s of the stages the plan places on it
//! (the model is cut into `plan.stages` chunks by [`Cut::Even`](crate::model::Cut::Even), whatever
//! the placement), its own backend, its own AdamW over just those chunks, and access to the step's
//! data. F, I, W and B map one to one onto the chunk's `forward`, `backward_input`,
//! `backward_weight` and `backward`; payloads are the backend's buffers, moved, never copied.
//! Stage 0 reads the step's input tokens and the last stage its targets and loss scales from the
//! shared [`StepFeed`](super::feed::StepFeed), which builds them with the reference trainer's own
//! functions.
//!
//! The optimizer step is the reference trainer's: the rank reports its `Σ g²`
//! ([`StageCompute::grad_stats`]), the runtime decides from every rank's statistics whether
//! to clip (and by how much) or skip, and [`StageCompute::apply_step`] runs AdamW at the
//! learning rate of the step with that clip factor. The runtime runs a rank's iterations
//! strictly in order, so the rank counts its own iterations to know which step a forward
//! belongs to.
//!
//! Sharded optimizer (`optimizer.shard` with data-parallel replicas, see `compute/zero.rs`): the
//! rank's AdamW then holds the moments of its replica's chunk of the rank's parameters only;
//! the gradients are reduce-scattered, the chunk updated and the parameters all-gathered.
//!
//! Filler (optional, `RankCompute::set_drafter`): the rank holding the last stage has its
//! chunk copy the rows the drafter trains on into the run's [`DrafterFill`] buffers, and every
//! rank closes its drafter round at the end of each target step (see [`super::fill`]). The
//! drafter's own work runs in the bubbles, through the runtime's filler, never here.
//!
//! Kept ranks (optional, `RankCompute::keep_into`): after its last iteration the rank moves
//! its chunks and optimizer out (`RankParts`) instead of exporting host copies, and a
//! later run continues from them (`RankCompute::from_parts`): the RL update runs one
//! short run per RL step and would otherwise copy every parameter and moment out and back.
//!
//! Speculative steps (optional, `RankCompute::set_speculative`): the runtime may step
//! before it knows every rank's statistics. The rank then snapshots its parameters and
//! optimizer moments, keeps its gradients, and on a wrong guess restores them
//! ([`StageCompute::rollback_step`]) so the step is redone exactly; first-stage forwards
//! run on the guessed weights are run again and replace their stash.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::mpsc::Sender;

use pipefill_actors::{GradStats, StageCompute, StepDecision};

use super::fill::DrafterFill;
use super::shared::{RankFinal, Shared};
use crate::model::ModelError;
use crate::model::{
    AdamW, ChunkGrad, ChunkInput, ChunkOutput, LrSchedule, ModelChunk, OptimizerState, Shape,
};
use crate::pipeline::error::PipelineError;
use crate::tensor::Backend;
use crate::train::reference::{adamw_config, lr_schedule};

mod parts;
mod state;
pub(crate) mod zero;

pub(crate) use parts::RankParts;

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
    /// Whether the rank offers speculative optimizer steps ([`StageCompute::can_roll_back`]).
    speculate: bool,
    /// The state before the speculative step not yet confirmed or rolled back.
    snapshot: Option<Snapshot<B>>,
    /// `(stage, micro-batch)` forwards run on speculatively stepped weights.
    held: HashSet<(u32, u32)>,
    /// Forwards the runtime runs again after a rollback: each replaces its first stash.
    redo: HashSet<(u32, u32)>,
    /// The drafter trained in the bubbles, when the job has one.
    drafter: Option<Arc<DrafterFill>>,
    /// Where the rank moves its parts after the last iteration (`None`: it exports them).
    keep: Option<Sender<RankParts<B>>>,
    /// The sharded optimizer (`optimizer.shard` with replicas): `optimizer` then holds the
    /// moments of this replica's chunk only.
    zero: Option<zero::Zero>,
}

/// What every rank of a run is built from, however it starts: the job, its plan, the run's
/// shared state, and the `iterations` steps it runs from `first_step`.
pub(crate) struct RankJob<'a> {
    pub job: &'a crate::config::JobConfig,
    pub plan: &'a crate::schedules::Plan,
    pub shared: Arc<Shared>,
    pub first_step: u64,
    pub iterations: u64,
}

impl<'a> RankJob<'a> {
    /// `iterations` steps of `job`'s `plan` from `first_step`, sharing `shared`.
    pub(crate) fn new(
        job: &'a crate::config::JobConfig,
        plan: &'a crate::schedules::Plan,
        shared: &Arc<Shared>,
        (first_step, iterations): (u64, u64),
    ) -> Self {
        RankJob {
            job,
            plan,
            shared: Arc::clone(shared),
            first_step,
            iterations,
        }
    }
}

impl<B: Backend> RankCompute<B> {
    /// Rank `rank` of `run.plan`: the chunks the plan places on it (the model cut into
    /// `plan.stages` even chunks), on `backend`, with the job's AdamW and learning-rate
    /// schedule.
    pub(crate) fn for_rank(
        run: RankJob<'_>,
        rank: usize,
        backend: B,
    ) -> Result<Self, PipelineError> {
        Self::build(run, rank, backend, false)
    }

    /// [`RankCompute::for_rank`] continuing from `model` and `state` (see
    /// [`RankCompute::load_resumed`]): the chunks are built without the random
    /// initialisation, since every parameter is overwritten at once.
    pub(crate) fn resumed<G: Backend>(
        run: RankJob<'_>,
        rank: usize,
        backend: B,
        (model, state): (&crate::model::Gpt<G>, &OptimizerState),
    ) -> Result<Self, PipelineError> {
        let mut compute = Self::build(run, rank, backend, true)?;
        compute.load_resumed(model, state)?;
        Ok(compute)
    }

    /// The rank's chunks (`blank`: placeholder parameters the caller overwrites) and a
    /// fresh optimizer.
    fn build(
        run: RankJob<'_>,
        rank: usize,
        backend: B,
        blank: bool,
    ) -> Result<Self, PipelineError> {
        let cut = crate::model::Cut::Even(run.plan.stages);
        let chunk = if blank {
            ModelChunk::blank
        } else {
            ModelChunk::new
        };
        let chunks = run
            .plan
            .stages_of(rank)
            .into_iter()
            .map(|s| {
                let mut c = chunk(&run.job.model, backend.clone(), &cut, s as usize)?;
                c.set_recompute(run.job.train.recompute.of_rank(rank))?;
                Ok(c)
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let chunks = chunks.into_iter().map(|c| (c.stage() as u32, c)).collect();
        let optimizer = AdamW::new(adamw_config(&run.job.train));
        Self::assemble(run, rank, (backend, chunks, optimizer))
    }

    /// A rank that has run none of its iterations yet, over `state`: its backend, chunks
    /// by stage and optimizer (fresh, or kept from an earlier run).
    fn assemble(
        run: RankJob<'_>,
        rank: usize,
        (backend, chunks, optimizer): (B, BTreeMap<u32, ModelChunk<B>>, AdamW<B>),
    ) -> Result<Self, PipelineError> {
        let zero = zero::Zero::for_rank(run.job, &run.shared, rank, &chunks)?;
        Ok(RankCompute {
            rank,
            backend,
            chunks,
            optimizer,
            lr: lr_schedule(&run.job.train),
            shared: run.shared,
            first_step: run.first_step,
            done: 0,
            iterations: run.iterations,
            speculate: false,
            snapshot: None,
            held: HashSet::new(),
            redo: HashSet::new(),
            drafter: None,
            keep: None,
            zero,
        })
    }

    /// The backend this rank computes on.
    pub(crate) fn backend(&self) -> &B {
        &self.backend
    }

    /// Joins the run's drafter: the last stage's chunk (if this rank holds it) captures its
    /// training rows into the drafter's buffer.
    pub(crate) fn set_drafter(&mut self, fill: Arc<DrafterFill>) -> Result<(), PipelineError> {
        for chunk in self.chunks.values_mut().filter(|c| c.is_last()) {
            chunk.set_draft_sink(Some(fill.buffer().clone()))?;
        }
        self.drafter = Some(fill);
        Ok(())
    }

    /// A tied embedding's copies take the sum of their gradients ([`crate::model::tie`]):
    /// here when this rank holds both, with the other stage's rank when it holds one.
    /// Whether the rank holds a copy.
    fn sum_tied(&mut self) -> Result<bool, PipelineError> {
        use crate::model::tie;
        match tie::sides(self.chunks.values_mut()) {
            (None, None) => Ok(false),
            (Some(_), Some(_)) => {
                tie::sum_local(&self.backend, self.chunks.values_mut())?;
                Ok(true)
            }
            (Some(mut side), None) | (None, Some(mut side)) => {
                let mut grad = side.take_grad(&self.backend)?;
                self.shared.sum_tied(self.rank, &mut grad)?;
                side.set_grad(&self.backend, grad)?;
                Ok(true)
            }
        }
    }

    /// The sharded optimizer's reduce-scatter, with the tied pair's sum where this rank
    /// holds a copy ([`zero::Zero::gather_pair`]); the gradient norm's segments.
    fn reduce_sharded(&mut self) -> Result<Vec<(u32, Vec<f64>)>, PipelineError> {
        let mut zero = self.zero.take().expect("a sharded optimizer");
        let out = (|| {
            zero.reduce(self.rank, &self.backend, &self.chunks)?;
            if zero.holds_pair() {
                zero.gather_pair(self.rank, &self.backend, &mut self.chunks)?;
                self.sum_tied()?;
                zero.keep_pair(self.rank, &self.backend, &self.chunks)?;
            }
            zero.sq_norms(self.rank)
        })();
        self.zero = Some(zero);
        out
    }

    /// Offers speculative optimizer steps to the runtime (post-validation: step at once,
    /// roll back if the exact decision differs). Off by default: the step then waits for
    /// every rank's gradient statistics.
    pub(crate) fn set_speculative(&mut self, on: bool) {
        self.speculate = on;
    }

    /// The chunk of `stage`, if this rank holds it.
    pub(crate) fn chunk_ref(&self, stage: u32) -> Option<&ModelChunk<B>> {
        self.chunks.get(&stage)
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
        let data = self.shared.step_data(step);
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
        if self.snapshot.is_some() {
            self.held.insert((stage, microbatch));
        }
        let redo = self.redo.remove(&(stage, microbatch));
        let fill = self.drafter.clone();
        let chunk = self.chunk(stage)?;
        if redo {
            chunk.discard(microbatch as usize);
        }
        let input = match input {
            Some(h) => ChunkInput::Hidden(h),
            None => ChunkInput::Tokens(&mb.inputs),
        };
        let targets = chunk.is_last().then_some(mb.targets.as_slice());
        if chunk.is_last() {
            chunk.set_token_loss(data.token_loss.clone())?;
        }
        // Held-out rows go to their own buffer for this forward only.
        let held_out = match &fill {
            Some(fill) if chunk.is_last() => {
                fill.buffer().begin_step(step);
                let held = DrafterFill::holds_out(step, microbatch);
                if held {
                    chunk.set_draft_sink(Some(fill.held_out().clone()))?;
                }
                held.then(|| fill.buffer().clone())
            }
            _ => None,
        };
        let output = chunk.forward(microbatch as usize, shape, input, targets);
        if let Some(training) = held_out {
            chunk.set_draft_sink(Some(training))?;
        }
        match output? {
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
        // Data-parallel replicas sum their gradients first, so the norm, the clip decision
        // and the step are the whole batch's on every replica. Replicas sum the norm from
        // the sharded optimizer's segments, sharded or not, so both clip alike (`zero`).
        let own = match &mut self.zero {
            Some(_) => self.reduce_sharded()?,
            None => {
                let params = self.chunks.values_mut().flat_map(|c| c.params_mut());
                let summed = self.shared.sync_grads(self.rank, &self.backend, params)?;
                let tied = self.sum_tied()?;
                match (summed, self.shared.replica()) {
                    (Some(mut grads), Some(r)) => {
                        if tied {
                            grads = zero::flat(&self.backend, &self.chunks, true)?;
                        }
                        zero::replica_sq_norms(&self.chunks, &grads, r.count)
                    }
                    _ => zero::param_sq_norms(&self.backend, &self.chunks)?,
                }
            }
        };
        let mut stats = GradStats::default();
        for q in own.iter().flat_map(|(_, sq)| sq) {
            // Σ g² is NaN or infinite exactly when some entry is (or overflows).
            stats.nonfinite |= !q.is_finite();
            stats.sq_norm += q;
        }
        self.shared.post_sq_norms(self.step(), own);
        Ok(stats)
    }

    fn apply_step(
        &mut self,
        iteration: u64,
        decision: StepDecision,
        speculative: bool,
    ) -> Result<(), PipelineError> {
        self.check_iteration(iteration)?;
        let step = self.step();
        let lr = self.lr.lr(step);
        if speculative {
            self.snapshot = Some(self.take_snapshot(iteration)?);
        }
        if let StepDecision::Apply { clip_scale } = decision {
            match &self.zero {
                Some(zero) => zero.step(
                    self.rank,
                    (&self.backend, &mut self.optimizer),
                    &mut self.chunks,
                    lr,
                    clip_scale,
                )?,
                None => {
                    let params = self.chunks.values_mut().flat_map(|c| c.params_mut());
                    self.optimizer.step(&self.backend, params, lr, clip_scale)?;
                }
            }
        }
        self.done += 1;
        if speculative {
            // The gradients stay until the step is confirmed (a rollback redoes the step
            // from them); the next step's first-stage forwards may run meanwhile.
            self.shared.feed.prefetch(self.step());
            return Ok(());
        }
        self.finish(step, lr)
    }

    fn can_roll_back(&self) -> bool {
        self.speculate
    }

    fn rollback_step(&mut self, iteration: u64) -> Result<(), PipelineError> {
        let snap = self.pending_snapshot(iteration)?;
        for (&stage, chunk) in &mut self.chunks {
            for p in chunk.params_mut() {
                let saved = snap
                    .params
                    .get(&p.name)
                    .ok_or_else(|| PipelineError::Stage {
                        stage,
                        reason: format!("no snapshot of `{}` to roll back to", p.name),
                    })?;
                self.backend
                    .copy(saved, &mut p.value)
                    .map_err(ModelError::from)?;
            }
        }
        self.optimizer.load_state(&self.backend, &snap.optimizer)?;
        self.done -= 1;
        // The forwards run on the wrong weights are run again; each replaces its stash.
        self.redo = std::mem::take(&mut self.held);
        Ok(())
    }

    fn confirm_step(&mut self, iteration: u64) -> Result<(), PipelineError> {
        self.pending_snapshot(iteration)?;
        self.held.clear();
        let step = self.first_step + iteration;
        self.finish(step, self.lr.lr(step))
    }
}

/// What a rollback restores: every parameter value and the optimizer state before the
/// speculative step of `iteration` (the gradients are kept until confirmation anyway).
struct Snapshot<B: Backend> {
    iteration: u64,
    params: BTreeMap<String, B::Buf>,
    optimizer: OptimizerState,
}

impl<B: Backend> RankCompute<B> {
    /// The step of `iteration` is final: consume its gradients, report it, and hand over
    /// the final state after the last one.
    fn finish(&mut self, step: u64, lr: f32) -> Result<(), PipelineError> {
        for chunk in self.chunks.values_mut() {
            chunk.zero_grads()?;
        }
        if let Some(zero) = &mut self.zero {
            zero.finish();
        }
        if let Some(fill) = &self.drafter {
            let chunks: Vec<_> = self.chunks.values().collect();
            fill.step_end(self.rank, step, &chunks)
                .map_err(|e| PipelineError::Stage {
                    stage: self.chunks.keys().next().copied().unwrap_or(0),
                    reason: format!("drafter: {e}"),
                })?;
        }
        if self.shared.checkpoint_due(step) {
            self.shared
                .deposit_checkpoint(step, self.rank, self.export()?)?;
        } else if let Some(zero) = self
            .zero
            .as_ref()
            .filter(|_| self.shared.checkpoint_step(step))
        {
            // The first replica saves: the others send it their moments.
            zero.gather_state(self.rank, &self.backend, &self.optimizer, &self.chunks)?;
        }
        // A checkpoint write failed, or the caller stopped the run: this step is the last.
        self.shared.check_stop(self.rank)?;
        if self.done == self.iterations {
            match self.keep.take() {
                Some(keep) => self.send_parts(&keep),
                None => {
                    let state = self.export_final()?;
                    self.shared.deposit_final(self.rank, state)
                }
            }
        } else {
            self.shared.feed.prefetch(self.step());
        }
        self.shared.stepped(step, lr);
        Ok(())
    }

    fn take_snapshot(&self, iteration: u64) -> Result<Snapshot<B>, PipelineError> {
        let mut params = BTreeMap::new();
        for p in self.chunks.values().flat_map(|c| c.params()) {
            let copy = self.backend.dup(&p.value).map_err(ModelError::from)?;
            params.insert(p.name.clone(), copy);
        }
        Ok(Snapshot {
            iteration,
            params,
            optimizer: self.optimizer.state(&self.backend)?,
        })
    }

    /// The snapshot of the speculative step of `iteration`, taken off the rank.
    fn pending_snapshot(&mut self, iteration: u64) -> Result<Snapshot<B>, PipelineError> {
        match self.snapshot.take() {
            Some(s) if s.iteration == iteration => Ok(s),
            other => {
                let expected = other.map_or(self.done, |s| s.iteration);
                Err(PipelineError::OutOfOrder {
                    rank: self.rank,
                    expected,
                    got: iteration,
                })
            }
        }
    }

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
        let data = self.shared.step_data(self.step());
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
