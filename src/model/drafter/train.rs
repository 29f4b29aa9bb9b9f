//! [`DrafterTrainer`]: slices of drafter training on rows sampled from the shared buffer,
//! the optimizer step (alone, or over the gradients of every replica), the running cost
//! estimate, and held-out agreement with the target.

use cpu_time::ThreadTime;
use std::time::Instant;

use super::net::LossSums;
use super::unroll::Unroller;
use super::{
    DraftBatch, DraftBufferHandle, DraftRow, Drafter, DrafterWeights, NamedTensor, Result,
    UnrollContext,
};
use crate::data::SplitMix64;
use crate::model::ModelError;
use crate::model::{AdamW, AdamWConfig, clip_scale};
use crate::tensor::{Backend, DType};

/// The micro-batch id of a training slice (one in flight at a time).
const SLICE_MB: usize = 0;
/// The micro-batch id of an evaluation forward (discarded right after).
const EVAL_MB: usize = usize::MAX;

/// What one slice did.
#[derive(Clone, Debug, PartialEq)]
pub struct SliceStats {
    /// Weighted loss per counted pair (`ce_weight·ce + hidden_weight·hidden`).
    pub loss: f32,
    /// Mean soft cross-entropy per pair.
    pub ce: f32,
    /// Mean SmoothL1 per pair.
    pub hidden: f32,
    /// Pairs counted (the next-token pairs; the loss, CE, SmoothL1 and agreement are theirs).
    pub pairs: usize,
    /// Pairs counted by the unrolled steps `2..=unroll` (their losses are in the gradient, see
    /// [`super::DrafterConfig::unroll`]); 0 without unrolling.
    pub unrolled_pairs: usize,
    /// Top-1 agreement with the target on this batch, before the update.
    pub agreement: f64,
    /// Layout rows of the batch (`batch · seq`, padding included): what the cost grows with.
    /// Each unrolled step computes them again, so a slice costs about `unroll` times this.
    pub layout_rows: usize,
    /// Thread CPU time of the slice, optimizer step included (seconds).
    pub cpu_seconds: f64,
    /// Wall time of the slice (seconds).
    pub wall_seconds: f64,
    /// The new version (drafter step) when this slice ended with an optimizer step.
    pub stepped: Option<u64>,
}

/// Agreement and loss on held-out rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalStats {
    /// Fraction of pairs whose drafter argmax equals the target's argmax.
    pub agreement: f64,
    /// Mean soft cross-entropy per pair.
    pub ce: f64,
    /// Mean SmoothL1 per pair.
    pub hidden: f64,
    /// Mean over pairs of `Σ_v min(p_v, q_v)` with `q` the drafter's softmax: the chance
    /// that a draft token sampled from `q` is accepted against the target's `p` (lossless
    /// sampling acceptance) given the true context, at the temperature of the rows' `p`
    /// (rollout rows record it at 1). Greedy acceptance of the first draft is `agreement`.
    pub overlap: f64,
    pub pairs: usize,
}

/// One replica's accumulated gradients for drafter step `version`: the gradients of the
/// **summed** loss over its `pairs` pairs (the step divides by the total over replicas).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DrafterGrads {
    pub version: u64,
    pub replica: usize,
    pub pairs: usize,
    pub tensors: Vec<NamedTensor>,
}

/// Trains one drafter replica from a shared [`DraftBufferHandle`].
pub struct DrafterTrainer<B: Backend> {
    drafter: Drafter<B>,
    optimizer: AdamW<B>,
    buffer: DraftBufferHandle,
    rng: SplitMix64,
    replica: usize,
    replicas: usize,
    /// AdamW learning rate: `config.lr` unless set apart ([`DrafterTrainer::set_lr`]).
    lr: f32,
    version: u64,
    slices: usize,
    pairs: usize,
    cost: Option<f64>,
}

impl<B: Backend> DrafterTrainer<B> {
    /// Replica `replica` of `replicas` (use `0, 1` for a single drafter). Each replica
    /// samples its own stream of rows (seeded by `(seed, replica)`); replicas must start from
    /// the same weights (same seed, or [`DrafterTrainer::load_weights`]).
    pub fn new(
        drafter: Drafter<B>,
        buffer: DraftBufferHandle,
        replica: usize,
        replicas: usize,
    ) -> Result<Self> {
        if replica >= replicas {
            return Err(ModelError::DrafterConfig {
                field: "replica",
                reason: format!("{replica} is not below the replica count {replicas}"),
            });
        }
        let c = drafter.config();
        let optimizer = AdamW::new(AdamWConfig {
            weight_decay: c.weight_decay,
            max_grad_norm: c.clip,
            ..AdamWConfig::default()
        });
        let lr = c.lr;
        Ok(DrafterTrainer {
            rng: SplitMix64::derive(c.seed, replica as u64),
            lr,
            drafter,
            optimizer,
            buffer,
            replica,
            replicas,
            version: 0,
            slices: 0,
            pairs: 0,
            cost: None,
        })
    }

    pub fn drafter(&self) -> &Drafter<B> {
        &self.drafter
    }

    /// The drafter, e.g. to refresh its frozen copies.
    pub fn drafter_mut(&mut self) -> &mut Drafter<B> {
        &mut self.drafter
    }

    pub fn buffer(&self) -> &DraftBufferHandle {
        &self.buffer
    }

    /// The learning rate of the next optimizer steps.
    pub fn lr(&self) -> f32 {
        self.lr
    }

    /// Changes the learning rate of the next optimizer steps (the moments are kept): e.g. a
    /// drafter trained from scratch in the bubbles that goes on to follow a slowly moving
    /// target on few rows (RL, see [`crate::rl::trainer_spec`]).
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        if !(lr >= 0.0 && lr.is_finite()) {
            return Err(ModelError::DrafterConfig {
                field: "lr",
                reason: format!("{lr} is not a finite number ≥ 0"),
            });
        }
        self.lr = lr;
        Ok(())
    }

    /// Drafter optimizer steps taken.
    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn replica(&self) -> usize {
        self.replica
    }

    /// Slices accumulated since the last optimizer step.
    pub fn pending_slices(&self) -> usize {
        self.slices
    }

    /// Whether `accumulation` slices have run since the last step (with several replicas,
    /// the moment to exchange gradients).
    pub fn ready_to_step(&self) -> bool {
        self.slices >= self.drafter.config().accumulation
    }

    /// The expected cost of the next slice in seconds of thread CPU time: an EMA of the
    /// measured slices (`None` before the first). It is the whole cost when the drafter's
    /// backend computes on the calling thread (a one-thread CPU backend, as in virtual-clock
    /// runs); a backend with worker threads does part of the work off this clock.
    pub fn predicted_cost(&self) -> Option<f64> {
        self.cost
    }

    /// The longest window a slice takes from one sequence: `max_positions`, and no more
    /// than the target's sequences hold pairs.
    fn max_window(&self) -> usize {
        let seq = self.drafter.target_config().seq_len;
        self.drafter
            .config()
            .max_positions
            .min(seq.saturating_sub(1))
            .max(1)
    }

    /// The most layout rows (`batch · seq`) a slice computes: `batch_rows` full windows.
    pub fn max_slice_rows(&self) -> usize {
        self.drafter.config().batch_rows * self.max_window()
    }

    /// The layout rows [`DrafterTrainer::slice_within`]`(rows)` computes at most (exactly,
    /// when the buffer's sequences are `seq_len` long, as the pipeline's are): its size, to
    /// predict its cost before it runs.
    pub fn slice_size(&self, rows: usize) -> usize {
        let (r, p) = self.slice_shape(rows);
        r * p
    }

    fn slice_shape(&self, rows: usize) -> (usize, usize) {
        let max_rows = self.drafter.config().batch_rows;
        DraftBatch::shape_within(rows, max_rows, self.max_window())
    }

    /// One forward + backward of the drafter on `batch_rows` sequences sampled from the
    /// buffer; a single replica also steps the optimizer after every `accumulation` slices
    /// (several replicas step through [`DrafterTrainer::step_with`]).
    pub fn slice(&mut self) -> Result<SliceStats> {
        self.slice_within(self.max_slice_rows())
    }

    /// A slice sized to at most `rows` layout rows (see [`DrafterTrainer::slice_size`]):
    /// fewer sequences and shorter windows than a full one, for a bubble with less time left.
    /// Its gradients are of the loss summed over its pairs, as a full slice's, so the step
    /// weighs every pair the same whatever the slices' sizes.
    pub fn slice_within(&mut self, rows: usize) -> Result<SliceStats> {
        self.slice_from(rows, None, true)
    }

    /// [`DrafterTrainer::slice_within`] on rows of target step `step` only
    /// ([`super::DraftBuffer::sample_step`]): what a planned placement runs.
    pub fn slice_of_step(&mut self, rows: usize, step: u64) -> Result<SliceStats> {
        self.slice_from(rows, Some(step), true)
    }

    /// [`DrafterTrainer::slice_within`] that only accumulates its gradients: no optimizer
    /// step whatever `accumulation` says, [`DrafterTrainer::step_accumulated`] takes it. For
    /// work cut finer than a slice (a rollout's idle gaps, `rl::rollout::idle`) that should
    /// still step once per slice's worth of pairs.
    pub fn accumulate_within(&mut self, rows: usize) -> Result<SliceStats> {
        self.slice_from(rows, None, false)
    }

    /// A single replica's optimizer step over the gradients accumulated since the last one
    /// (what [`DrafterTrainer::slice`] does after `accumulation` slices); the new version.
    pub fn step_accumulated(&mut self) -> Result<u64> {
        if self.replicas != 1 {
            return Err(ModelError::Replicas {
                version: self.version,
                reason: format!("{} replicas step together (step_with)", self.replicas),
            });
        }
        self.step_alone()?;
        Ok(self.version)
    }

    /// A slice of at most `rows` layout rows sampled from the whole buffer, or from one
    /// step's rows; `may_step`: a single replica steps after `accumulation` slices.
    fn slice_from(&mut self, rows: usize, step: Option<u64>, may_step: bool) -> Result<SliceStats> {
        let (cpu0, wall0) = (ThreadTime::now(), Instant::now());
        let c = self.drafter.config().clone();
        let (batch_rows, positions) = self.slice_shape(rows);
        let rows = match step {
            Some(step) => self.buffer.sample_step(&mut self.rng, batch_rows, step),
            None => self.buffer.sample(&mut self.rng, batch_rows),
        };
        if rows.is_empty() {
            return Err(ModelError::NoData);
        }
        let mut batch = self.drafter.batch(&rows, positions, Some(&mut self.rng))?;
        let (sums, unrolled_pairs) = self.forward_backward(&mut batch)?;
        self.slices += 1;
        self.pairs += sums.pairs;
        let stepped = if may_step && self.replicas == 1 && self.ready_to_step() {
            self.step_alone()?;
            Some(self.version)
        } else {
            None
        };
        let cpu_seconds = cpu0.elapsed().as_secs_f64();
        self.cost = Some(match self.cost {
            None => cpu_seconds,
            Some(old) => old + c.advanced.cost_ema * (cpu_seconds - old),
        });
        let n = sums.pairs.max(1) as f64;
        let (ce, hidden) = (sums.ce / n, sums.hidden / n);
        Ok(SliceStats {
            loss: (f64::from(c.ce_weight) * ce + f64::from(c.hidden_weight) * hidden) as f32,
            ce: ce as f32,
            hidden: hidden as f32,
            pairs: sums.pairs,
            unrolled_pairs,
            agreement: sums.agree as f64 / n,
            layout_rows: batch.rows(),
            cpu_seconds,
            wall_seconds: wall0.elapsed().as_secs_f64(),
            stepped,
        })
    }

    /// Step 1 of a slice on `batch`, then its unrolled steps (which rewrite `batch`, see
    /// [`super::unroll`]): step 1's loss sums and the pairs the unrolled steps counted.
    fn forward_backward(&mut self, batch: &mut DraftBatch) -> Result<(LossSums, usize)> {
        let c = self.drafter.config();
        let (unroll, context) = (c.unroll, c.unroll_context);
        if unroll > 1 && context == UnrollContext::Exact {
            return self.drafter.unrolled_slice(batch, unroll);
        }
        // Causal: each step a whole forward and backward of its own.
        let (first, mut f) = self.step(batch, 1.0)?;
        let mut unrolled = 0;
        if unroll > 1 {
            let unroller = Unroller::new(batch, self.drafter.target_config().d_model);
            for j in 1..unroll {
                let fed = self.drafter.backend().to_host(&f)?;
                // No pair is that many predictions deep: the later steps have none either.
                if unroller.advance(batch, &fed) == 0 {
                    break;
                }
                let weight = self.drafter.config().unroll_decay.powi(j as i32);
                let (sums, next) = self.step(batch, weight)?;
                unrolled += sums.pairs;
                f = next;
            }
        }
        Ok((first, unrolled))
    }

    /// One forward, `backward_input` and `backward_weight` of the drafter on `batch`, its
    /// loss's gradient scaled by `weight`; its loss sums and predicted hidden states.
    fn step(&mut self, batch: &DraftBatch, weight: f32) -> Result<(LossSums, B::Buf)> {
        let d = &mut self.drafter;
        let (f, logits) = d.forward(SLICE_MB, batch)?;
        let result = d
            .loss_grad_weighted(batch, &f, &logits, weight)
            .and_then(|(sums, dfeat)| {
                d.backward_input(SLICE_MB, &dfeat)?;
                d.backward_weight(SLICE_MB)?;
                Ok(sums)
            });
        if result.is_err() {
            d.discard(SLICE_MB);
        }
        Ok((result?, f))
    }

    /// Clips and applies the gradients held in the parameters (of the loss summed over
    /// `pairs` pairs) as the gradient of the mean loss, and advances the version. The
    /// gradients are left as they are.
    fn apply(&mut self, pairs: usize) -> Result<()> {
        let be = self.drafter.backend().clone();
        let mut sq = 0.0;
        for p in self.drafter.params() {
            sq += be.sum_squares(&p.grad)?;
        }
        // With no pair counted the gradients are 0 and so is the scale (no 0/0).
        let mean = if pairs == 0 { 0.0 } else { 1.0 / pairs as f64 };
        let norm = sq.sqrt() * mean;
        let scale = clip_scale(norm, self.drafter.config().clip) * mean as f32;
        self.optimizer
            .step(&be, self.drafter.params_mut(), self.lr, scale)?;
        self.version += 1;
        Ok(())
    }

    /// The single replica's step: applies the accumulated gradients and starts afresh.
    fn step_alone(&mut self) -> Result<()> {
        self.apply(self.pairs)?;
        self.drafter.zero_grads()?;
        self.slices = 0;
        self.pairs = 0;
        Ok(())
    }

    /// This replica's accumulated gradients as a message, for [`DrafterTrainer::step_with`]
    /// on every replica; the local gradients are zeroed.
    pub fn take_grads(&mut self) -> Result<DrafterGrads> {
        let be = self.drafter.backend().clone();
        let mut tensors = Vec::new();
        for p in self.drafter.params() {
            tensors.push(NamedTensor {
                name: p.name.clone(),
                shape: p.shape.clone(),
                values: be.to_host(&p.grad)?,
            });
        }
        self.drafter.zero_grads()?;
        let grads = DrafterGrads {
            version: self.version,
            replica: self.replica,
            pairs: self.pairs,
            tensors,
        };
        self.slices = 0;
        self.pairs = 0;
        Ok(grads)
    }

    /// The optimizer step over the gradients of every replica (one [`DrafterGrads`] each,
    /// all for this step). They are summed in replica order whatever order they arrive in,
    /// so every replica computes the same update and the weights stay identical. Gradients
    /// this replica accumulated since its [`DrafterTrainer::take_grads`] (slices run while
    /// the exchange was under way) are kept for the next step.
    pub fn step_with(&mut self, grads: &[DrafterGrads]) -> Result<u64> {
        let bad = |reason: String| ModelError::Replicas {
            version: self.version,
            reason,
        };
        let mut ordered: Vec<&DrafterGrads> = grads.iter().collect();
        ordered.sort_by_key(|g| g.replica);
        let replicas: Vec<usize> = ordered.iter().map(|g| g.replica).collect();
        if replicas != (0..self.replicas).collect::<Vec<_>>() {
            return Err(bad(format!(
                "gradients of replicas {replicas:?}, expected each of 0..{} once",
                self.replicas
            )));
        }
        if let Some(g) = ordered.iter().find(|g| g.version != self.version) {
            return Err(bad(format!(
                "replica {} sent gradients of step {}",
                g.replica, g.version
            )));
        }
        let mut sums = Vec::new();
        for (i, p) in self.drafter.params().into_iter().enumerate() {
            let mut sum = vec![0.0f32; p.numel()];
            for g in &ordered {
                let t = g.tensors.get(i).filter(|t| t.name == p.name);
                let t = t.filter(|t| t.values.len() == sum.len()).ok_or_else(|| {
                    bad(format!(
                        "replica {}: no gradient of `{}` with {} values at position {i}",
                        g.replica,
                        p.name,
                        sum.len()
                    ))
                })?;
                sum.iter_mut().zip(&t.values).for_each(|(s, &v)| *s += v);
            }
            sums.push(sum);
        }
        let pairs = ordered.iter().map(|g| g.pairs).sum();
        let be = self.drafter.backend().clone();
        let mut pending = Vec::with_capacity(sums.len());
        for (p, sum) in self.drafter.params_mut().into_iter().zip(&sums) {
            let summed = be.from_host(sum, DType::F32)?;
            pending.push(std::mem::replace(&mut p.grad, summed));
        }
        let applied = self.apply(pairs);
        for (p, g) in self.drafter.params_mut().into_iter().zip(pending) {
            p.grad = g;
        }
        applied?;
        Ok(self.version)
    }

    /// The weights as a message versioned by drafter step.
    pub fn weights(&self) -> Result<DrafterWeights> {
        self.drafter.weights(self.version)
    }

    /// Adopts an owner's weights and version (the owner-broadcast placement). The optimizer
    /// state stays this replica's own.
    pub fn load_weights(&mut self, weights: &DrafterWeights) -> Result<()> {
        self.drafter.load_weights(weights)?;
        self.version = weights.version;
        Ok(())
    }

    /// Top-1 agreement between the drafter's and the target's next token on held-out rows.
    pub fn agreement(&mut self, held_out: &[DraftRow]) -> Result<f64> {
        Ok(self.evaluate(held_out)?.agreement)
    }

    /// Agreement and mean losses on `rows` (whole sequences, `batch_rows` at a time); no
    /// gradient is touched.
    pub fn evaluate(&mut self, rows: &[DraftRow]) -> Result<EvalStats> {
        let mut total = LossSums::default();
        let mut overlap = 0.0;
        for chunk in rows.chunks(self.drafter.config().batch_rows) {
            let batch = self.drafter.batch(chunk, usize::MAX, None)?;
            let out = self.drafter.forward(EVAL_MB, &batch);
            self.drafter.discard(EVAL_MB);
            let (f, logits) = out?;
            let (s, _) = self.drafter.loss_grad(&batch, &f, &logits)?;
            overlap += overlap_sum(&self.drafter.backend().to_host(&logits)?, &batch);
            total.ce += s.ce;
            total.hidden += s.hidden;
            total.pairs += s.pairs;
            total.agree += s.agree;
        }
        if total.pairs == 0 {
            return Err(ModelError::DrafterInput {
                what: "held-out rows",
                reason: format!("{} rows hold no training pair", rows.len()),
            });
        }
        let n = total.pairs as f64;
        Ok(EvalStats {
            agreement: total.agree as f64 / n,
            ce: total.ce / n,
            hidden: total.hidden / n,
            overlap: overlap / n,
            pairs: total.pairs,
        })
    }
}

/// `Σ_v min(p_v, softmax(z)_v)` summed over the counted pairs of `batch` (`logits: [rows,
/// vocab]`), see [`EvalStats::overlap`].
fn overlap_sum(logits: &[f32], batch: &DraftBatch) -> f64 {
    let v = batch.target_probs.len() / batch.rows().max(1);
    let mut total = 0.0;
    for r in (0..batch.rows()).filter(|&r| batch.mask[r]) {
        let (z, p) = (
            &logits[r * v..(r + 1) * v],
            &batch.target_probs[r * v..(r + 1) * v],
        );
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = z.iter().map(|&x| f64::from(x - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        total += e
            .iter()
            .zip(p)
            .map(|(&q, &p)| (q / sum).min(f64::from(p)))
            .sum::<f64>();
    }
    total
}

impl<B: Backend> std::fmt::Debug for DrafterTrainer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrafterTrainer")
            .field("replica", &self.replica)
            .field("replicas", &self.replicas)
            .field("version", &self.version)
            .field("pending_slices", &self.slices)
            .field("predicted_cost", &self.cost)
            .finish()
    }
}

/// What a checkpoint keeps of a replica besides its weights ([`super::state`]).
impl<B: Backend> DrafterTrainer<B> {
    /// The optimizer's state (moments and step counter).
    pub fn optimizer_state(&self) -> Result<crate::model::OptimizerState> {
        self.optimizer.state(self.drafter.backend())
    }

    /// Replaces the optimizer's state with a checkpointed one.
    pub fn load_optimizer_state(&mut self, state: &crate::model::OptimizerState) -> Result<()> {
        let be = self.drafter.backend().clone();
        self.optimizer.load_state(&be, state)
    }

    /// The row sampler (where this replica's stream of sampled rows stands).
    pub fn sampler(&self) -> SplitMix64 {
        self.rng
    }

    /// Continues the row sampler from a checkpointed position.
    pub fn set_sampler(&mut self, rng: SplitMix64) {
        self.rng = rng;
    }
}
