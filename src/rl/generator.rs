//! What a GRPO step asks of a rollout generator and what it returns: [`RolloutRequest`],
//! [`Rollout`] (one sampled sequence), [`RolloutBatch`], and the [`RolloutGenerator`]
//! trait (the plain KV-cache sampler and the pipelined, speculative engine implement it).

use serde::{Deserialize, Serialize};

use crate::model::Gpt;
use crate::rl::RlError;
use crate::tensor::Backend;

/// One sampled sequence: `BOS` and the prompt's tokens, then the generated tokens (ending
/// in `EOS` unless the token budget cut it off).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollout {
    pub prompt: Vec<u32>,
    pub generated: Vec<u32>,
}

/// A rollout batch and how it was produced.
#[derive(Debug, Clone, Default)]
pub struct RolloutBatch {
    /// `group` rollouts of every prompt, group after group.
    pub rollouts: Vec<Rollout>,
    /// Live sequences (still generating) after each decode iteration: the long tail.
    pub live_batch: Vec<usize>,
    /// Share of the rollout's time its longest 10% of sequences ran alone (engines that time
    /// their steps only).
    pub tail_share: Option<f64>,
    /// Mean accepted draft tokens per verification + 1 (speculation only).
    pub acceptance_length: Option<f64>,
    /// Mean draft length the engine chose (speculation only).
    pub chosen_k: Option<f64>,
    /// Top-1 agreement of the drafter with the policy on this step's rollouts, before
    /// training on them (engines with a drafter only).
    pub drafter_agreement: Option<f64>,
    /// Seconds of drafter training inside `generate`, after the rollout proper.
    pub drafter_seconds: f64,
    /// Idle time of the rollout's stage threads (summed over stages), and the part of it
    /// filled with routed work (engines with stage threads only).
    pub idle_seconds: Option<f64>,
    pub idle_filled_seconds: Option<f64>,
    /// Drafter-training slices run in the stages' idle time.
    pub idle_drafter_slices: usize,
    /// The drafter's work of the step and where it ran (engines with an idle-work router).
    pub drafter_work: Option<crate::rl::rollout::idle::DrafterAccount>,
}

/// What a step asks of a [`RolloutGenerator`]: `group` completions of each of `prompts` (each
/// `BOS` + prompt tokens), each ending at `eos` (the prompts' tokenizer's) or after
/// `max_new` tokens; `step` seeds the sampling.
#[derive(Debug, Clone, Copy)]
pub struct RolloutRequest<'a> {
    pub prompts: &'a [Vec<u32>],
    pub group: usize,
    pub max_new: usize,
    pub eos: u32,
    pub step: u64,
}

impl<'a> RolloutRequest<'a> {
    /// The prompt of each sequence of the batch, in its order: every prompt `group` times,
    /// group after group (as [`RolloutBatch::rollouts`]).
    pub fn sequence_prompts(&self) -> impl Iterator<Item = &'a Vec<u32>> + 'a {
        let group = self.group;
        (self.prompts.iter()).flat_map(move |p| std::iter::repeat_n(p, group))
    }
}

/// Generates the rollouts of a step, on the policy's backend `B`.
pub trait RolloutGenerator<B: Backend> {
    /// The completions `request` asks for, under `policy`.
    fn generate(
        &mut self,
        policy: &Gpt<B>,
        request: RolloutRequest<'_>,
    ) -> Result<RolloutBatch, RlError>;

    /// Whether the engine decodes speculatively.
    fn speculative(&self) -> bool;
}
