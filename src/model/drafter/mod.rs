//! The EAGLE-style drafter: a one-layer model that predicts the target model's next final
//! hidden state, and through the target's LM head its next token. It is trained in the
//! pipeline's bubbles on hidden states the last stage already computes, and proposes
//! tokens for speculative decoding.
//!
//! # The model ([`Drafter`])
//! Pair `t` of a sequence is `(h_t, x_{t+1})`: the target's final hidden state at position
//! `t` (after the final RMSNorm, the LM head's input) and the token that follows it. The
//! drafter computes
//!
//! ```text
//! f̂_{t+1} = Block(fc([tok_emb(x_{t+1}), h_t]))      fc: [2·d_model, d_model]
//! q_{t+1}  = softmax(f̂_{t+1} · W_head)
//! ```
//!
//! where `Block` is one decoder block of the target's shape ([`crate::model::layers::Block`],
//! parameters `drafter.block.…`) and `tok_emb` / `W_head` are the target's `embed.tok` and
//! `head.w`, frozen ([`FrozenTables`]; a tied target's one table read both ways): one
//! snapshot per process, refreshed from the target every `refresh_every` target steps
//! ([`Drafter::refresh_from_chunk`], [`Drafter::refresh_from_gpt`], [`Drafter::refresh`])
//! and shared by pointer by the process's drafters ([`Drafter::share_frozen`]); never in
//! the drafter's optimizer, its weights messages or its checkpoint (see `frozen.rs`).
//! Positions need no embedding of their own: `h_t` already carries them.
//! The loss of one pair (see [`loss`]) is
//! `ce_weight · CE(p_{t+1}, q_{t+1}) + hidden_weight · mean_j SmoothL1_β(f̂_{t+1} − h_{t+1})`,
//! where `p_{t+1}` is the target's next-token distribution. Every layer keeps the target's
//! split backward: `forward`, `backward_input`, `backward_weight`.
//!
//! # Training data ([`DraftBuffer`])
//! The last pipeline chunk, given a [`DraftBufferHandle`] through
//! [`crate::model::ModelChunk::set_draft_sink`], copies the final hidden states it already
//! computed and the tokens into the buffer, one [`DraftRow`] per sequence: `d_model + 1`
//! values a position, whatever the vocabulary. A slice recomputes the soft targets
//! `p_{t+1} = softmax(h_{t+1} · W_head)` of the rows it samples through the frozen head
//! ([`Drafter::batch`]). The buffer keeps the rows of the current and the previous target
//! step ([`DraftBuffer::begin_step`]), each generation bounded.
//!
//! # Training ([`DrafterTrainer`])
//! A *slice* ([`DrafterTrainer::slice`]) is one forward + backward of the drafter on
//! `batch_rows` sequences sampled from the buffer; after `accumulation` slices the optimizer
//! steps. Its cost is kept as an EMA of measured thread CPU time
//! ([`DrafterTrainer::predicted_cost`]) so a filler can place it in a bubble that fits.
//! With `unroll = n > 1` a slice also runs the "training-time test" of EAGLE-3: `n − 1` more
//! steps on the same rows, in which each pair's hidden state is the drafter's own (detached)
//! prediction from the step before, as a proposal feeds it at depth `2..=n`, against the
//! same targets; their losses are added to the gradient, and the slice costs about `n` times
//! as much (it is measured, so the estimate follows). The default is `unroll = 2` with
//! causal context (see [`DrafterConfig::unroll`] for the figures that chose it). [`Drafter::chain_acceptance`] measures
//! what it is for: how deep greedy chains match the target's own generations.
//! Replicas stay identical by exchanging gradients: each replica hands
//! [`DrafterTrainer::take_grads`] to every other, and all call [`DrafterTrainer::step_with`]
//! on the same set, which sums them in replica order, so every replica applies the same
//! update bit for bit. Alternatively one owner steps and broadcasts
//! [`DrafterTrainer::weights`] ([`DrafterWeights`], versioned by drafter step), which any
//! replica or the rollout engine loads with [`Drafter::load_weights`].
//!
//! # Proposing ([`Drafter::propose`])
//! Given, for each live sequence, its last target pairs `(h_i, x_{i+1})`
//! ([`DraftContext`]), the drafter proposes a chain of `k` tokens and the distribution `q`
//! each was drawn from (for lossless acceptance), feeding its own predicted hidden state
//! forward, as EAGLE does. With a draft vocabulary ([`Drafter::set_draft_vocab`], EAGLE-3's
//! most frequent tokens, see `vocab.rs`) a drafted token pays the head's columns of those
//! tokens only.
//!
//! # Example
//! ```
//! use pipefill::model::{Cut, GptConfig, Gpt, Shape};
//! use pipefill::model::drafter::{DraftBufferHandle, Drafter, DrafterConfig, DrafterTrainer, DraftContext};
//! use pipefill::data::SplitMix64;
//! use pipefill::tensor::CpuBackend;
//!
//! let target = GptConfig { layers: 2, d_model: 16, heads: 2, seq_len: 8, ..GptConfig::default() };
//! let be = CpuBackend::new(1).unwrap();
//! let mut gpt = Gpt::new(&target, be.clone(), &Cut::Even(1)).unwrap();
//! // The last stage copies its hidden states and distributions into the buffer.
//! let config = DrafterConfig { batch_rows: 2, ..DrafterConfig::default() };
//! let buffer = DraftBufferHandle::new(&target, &config);
//! gpt.chunks_mut().last_mut().unwrap().set_draft_sink(Some(buffer.clone())).unwrap();
//! buffer.begin_step(0);
//! let ids: Vec<u32> = (0..16).map(|i| i % 7).collect();
//! let targets: Vec<u32> = (1..17).map(|i| i % 7).collect();
//! gpt.forward_backward(0, Shape { batch: 2, seq: 8 }, &ids, &targets, 1.0).unwrap();
//! // A filler runs slices in bubbles.
//! let mut drafter = Drafter::new(&target, &config, be).unwrap();
//! drafter.refresh_from_gpt(&gpt, 0).unwrap();
//! let mut trainer = DrafterTrainer::new(drafter, buffer.clone(), 0, 1).unwrap();
//! let stats = trainer.slice().unwrap();
//! assert!(stats.loss.is_finite() && trainer.predicted_cost().is_some());
//! // The rollout engine loads the weights and proposes.
//! let weights = trainer.weights().unwrap();
//! let mut rollout_drafter = Drafter::new(&target, &config, CpuBackend::new(1).unwrap()).unwrap();
//! rollout_drafter.load_weights(&weights).unwrap();
//! let hidden = vec![0.5f32; 3 * 16];
//! let ctx = DraftContext { hidden: &hidden, tokens: &[1, 2, 3] };
//! let chains = rollout_drafter.propose(&[ctx], 4, 0.0, &mut SplitMix64::new(0)).unwrap();
//! assert_eq!(chains[0].tokens.len(), 4);
//! ```

mod batch;
mod buffer;
mod frozen;
mod linear;
pub mod loss;
mod masked;
mod net;
mod packed;
mod propose;
pub mod state;
#[cfg(test)]
mod tests;
mod train;
mod tree;
mod unroll;
mod vocab;

use crate::model::ModelError;
pub use batch::DraftBatch;
pub use buffer::{DraftBuffer, DraftBufferHandle, DraftRow};
pub use frozen::FrozenTables;
pub use linear::Linear;
pub use net::{Drafter, DrafterWeights, LossSums, NamedTensor};
pub use propose::{DraftChain, DraftContext};
pub use train::{DrafterGrads, DrafterTrainer, EvalStats, SliceStats};
pub use tree::{DraftTree, MAX_TREE_NODES, TreeShape};
pub use unroll::{ChainStats, greedy_tail};
pub use vocab::frequent_tokens;

use serde::{Deserialize, Serialize};

/// The `[drafter]` section of a job file: the drafter's loss, optimizer, data and cost
/// estimate. Every field has a default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DrafterConfig {
    /// Weight of the soft cross-entropy against the target's next-token distribution.
    pub ce_weight: f32,
    /// Weight of the SmoothL1 term on the predicted hidden state (mean over its elements).
    pub hidden_weight: f32,
    /// Target steps between refreshes of the frozen embedding and LM head copies.
    pub refresh_every: u64,
    /// AdamW learning rate (constant).
    pub lr: f32,
    /// AdamW decoupled weight decay (not on norm gains).
    pub weight_decay: f32,
    /// Gradient-norm clipping threshold of the drafter's update (0: none).
    pub clip: f32,
    /// Sequences per slice.
    pub batch_rows: usize,
    /// Longest run of pairs taken from one sequence per slice (a random window of a longer
    /// sequence), which bounds a slice's cost.
    pub max_positions: usize,
    /// Slices whose gradients are accumulated into one optimizer step.
    pub accumulation: usize,
    /// Drafter steps unrolled per slice (training-time test, see the module docs): step 1 learns
    /// from the target's hidden states; step `j ≥ 2` from the drafter's own predictions of
    /// step `j − 1`, as a proposal's depth-`j` draft does. A slice costs about `unroll` times
    /// a one-step slice of the same rows. 2 by default (with `unroll_context = "causal"`):
    /// the drafter exists for the depth of its chains, and 2 lengthens them more than the
    /// dearer slices cost (docs/benchmarks.md, "Why the defaults").
    pub unroll: usize,
    /// What an unrolled step's pairs attend to (see [`UnrollContext`]).
    pub unroll_context: UnrollContext,
    /// Weight of unrolled step `j`'s loss relative to step 1's: `unroll_decay^(j−1)`, in
    /// `(0, 1]` (1: the steps' losses are summed, as EAGLE-3 does).
    pub unroll_decay: f32,
    /// Most recent target pairs a proposal attends to (see [`Drafter::propose`]).
    pub window: usize,
    /// Seed of the drafter's initialisation and of its batch sampling.
    pub seed: u64,
    /// What decides which drafter work runs in which bubble of a pipelined run (see
    /// [`FillMode`]).
    pub placement: FillMode,
    /// Internal tuning (`[drafter.advanced]`).
    pub advanced: DrafterTuning,
}

/// `[drafter.advanced]`: the drafter's internal tuning, not a job's intent. Every field has
/// the default the engine was measured with; a job sets one only to experiment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DrafterTuning {
    /// SmoothL1 threshold β of the hidden-state loss: quadratic below, linear above.
    pub smooth_l1_beta: f32,
    /// Rows kept per target step in the buffer (the current and the previous step each).
    pub buffer_rows: usize,
    /// Weight of the newest measurement in the slice-cost estimate (EMA), in `(0, 1]`.
    pub cost_ema: f64,
    /// With [`FillMode::Planned`]: the share of each bubble, as the plan's simulation under
    /// a cost model of the configs predicts it, that the step's slices are sized to fill, in
    /// `(0, 1]` (below 1 leaves room for the model's error).
    pub planned_fill: f64,
}

impl Default for DrafterTuning {
    fn default() -> Self {
        DrafterTuning {
            smooth_l1_beta: 1.0,
            buffer_rows: 256,
            cost_ema: 0.2,
            planned_fill: 0.9,
        }
    }
}

/// What the pairs of an unrolled step (`drafter.unroll ≥ 2`) attend to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnrollContext {
    /// The step's own other pairs, causally (features that are predictions too, where a
    /// proposal has the target's pairs before its chain): each step is a whole forward and
    /// backward of its own through the backends' causal attention.
    #[default]
    Causal,
    /// Exactly what a proposal attends to: the target's pairs before the chain (their keys
    /// and values constants to the unrolled steps), then the chain's own pairs
    /// (`drafter/masked.rs`); the steps run backward together. At d512 it drafted deeper
    /// than causal (chain bench 4.04 vs 3.50), at d256 less deep (2.57 vs 2.73; see
    /// `drafter/unroll.rs`).
    Exact,
}

impl UnrollContext {
    /// Why this context cannot train a drafter of `target`, if it cannot: the exact
    /// context's attention over the chain is plain multi-head attention, without biases,
    /// rotation or shared key/value heads.
    pub fn unsupported_for(self, target: &crate::model::GptConfig) -> Option<&'static str> {
        let plain = target.positions != crate::model::config::Positions::Rope
            && target.kv_heads() == target.heads
            && !target.qkv_bias;
        (self == UnrollContext::Exact && !plain).then_some(
            "= \"exact\" needs a target without rope, kv_heads < heads or qkv_bias; use \
             \"causal\" (the default)",
        )
    }
}

/// Which drafter work runs in which bubble of a pipelined run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FillMode {
    /// Slices sized to each bubble's measured idle time, rounds applied as soon as every
    /// replica posted them: the fullest bubbles, but what the drafter learns depends on
    /// timing, so it is not reproducible (nor bitwise across a resume).
    #[default]
    Measured,
    /// Each step's slices (count, sizes, order) come from the plan and the configs alone, each
    /// step's round is applied at the end of the next step, and slices sample only the
    /// previous step's rows: the drafter is the same bit for bit on every run and across a
    /// resume. Measured times decide only *when* a slice runs (in a bubble it fits, or at the
    /// step's end).
    Planned,
}

impl Default for DrafterConfig {
    fn default() -> Self {
        DrafterConfig {
            ce_weight: 1.0,
            hidden_weight: 1.0,
            refresh_every: 1,
            lr: 3e-3,
            weight_decay: 0.0,
            clip: 1.0,
            // Small slices (one sequence, a window of 16 positions, ~0.15 ms on the default
            // model's CPU stage) so they fit a pipeline's bubbles finely.
            batch_rows: 1,
            max_positions: 16,
            accumulation: 1,
            unroll: 2,
            unroll_context: UnrollContext::Causal,
            unroll_decay: 1.0,
            window: 32,
            seed: 0,
            placement: FillMode::Measured,
            advanced: DrafterTuning::default(),
        }
    }
}

impl DrafterConfig {
    /// Why this drafter cannot train on `target`, if it cannot: unrolled steps (`unroll`
    /// of 2 or more) in the exact context need the target's plain attention
    /// ([`UnrollContext::unsupported_for`]).
    pub fn unsupported_for(&self, target: &crate::model::GptConfig) -> Option<&'static str> {
        (self.unroll >= 2)
            .then(|| self.unroll_context.unsupported_for(target))
            .flatten()
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        let bad =
            |field: &'static str, reason: String| Err(ModelError::DrafterConfig { field, reason });
        for (field, v) in [
            ("drafter.ce_weight", self.ce_weight),
            ("drafter.hidden_weight", self.hidden_weight),
            ("drafter.lr", self.lr),
            ("drafter.weight_decay", self.weight_decay),
            ("drafter.clip", self.clip),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return bad(field, format!("{v} is not a finite number ≥ 0"));
            }
        }
        if self.ce_weight == 0.0 && self.hidden_weight == 0.0 {
            return bad(
                "drafter.ce_weight",
                "and hidden_weight are both 0 (no loss)".into(),
            );
        }
        let tuning = &self.advanced;
        if !(tuning.smooth_l1_beta > 0.0 && tuning.smooth_l1_beta.is_finite()) {
            let reason = format!("{} is not a positive number", tuning.smooth_l1_beta);
            return bad("drafter.advanced.smooth_l1_beta", reason);
        }
        for (field, v) in [
            ("drafter.refresh_every", self.refresh_every as usize),
            ("drafter.batch_rows", self.batch_rows),
            ("drafter.max_positions", self.max_positions),
            ("drafter.accumulation", self.accumulation),
            ("drafter.unroll", self.unroll),
            ("drafter.advanced.buffer_rows", tuning.buffer_rows),
            ("drafter.window", self.window),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1".into());
            }
        }
        if !(self.unroll_decay > 0.0 && self.unroll_decay <= 1.0) {
            let reason = format!("{} is not in (0, 1]", self.unroll_decay);
            return bad("drafter.unroll_decay", reason);
        }
        for (field, v) in [
            ("drafter.advanced.cost_ema", tuning.cost_ema),
            ("drafter.advanced.planned_fill", tuning.planned_fill),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return bad(field, format!("{v} is not in (0, 1]"));
            }
        }
        Ok(())
    }
}

/// Result of a drafter operation.
pub type Result<T> = std::result::Result<T, ModelError>;

/// The target's parameters the drafter reads, frozen ([`FrozenTables`]).
pub const FROZEN: [&str; 2] = ["embed.tok", "head.w"];
