//! [`PipelineRollouts`]: the RL loop's rollouts through the rollout engine
//! ([`super::rollout`]): the policy cut into the job's stages, groups of sequences in
//! flight one behind another, and, with `rl.speculation`, lossless speculative decoding
//! whose draft length a bandit picks while the live batch is at most `rl.spec_threshold`.
//!
//! The drafter adapts to the moving policy: every rollout records its sequences' final
//! hidden states and next-token distributions ([`DraftRow`]s, computed anyway), and after
//! the rollout the drafter trains `drafter_slices` slices on them (this step's rows and the
//! previous step's, [`crate::model::drafter::DraftBuffer`]), with its frozen embedding and
//! head copies refreshed from the new policy. The slices run on the caller's thread after
//! the rollout (reported apart, as `drafter_seconds`), not yet inside the long tail's idle
//! time or the update's bubbles. With speculation off no drafter is recorded or trained.
//!
//! Speculation never changes what is sampled (acceptance is lossless), so the reward curve
//! is the same in distribution with it on or off; only the time differs.

use std::time::Instant;

use super::rollout::{
    AdaptiveConfig, Request, RolloutConfig, RolloutEngine as Engine, RolloutError, Speculation,
};
use super::speculative::Proposer;
use super::trainer::{RlError, Rollout, RolloutBatch, RolloutEngine};
use crate::config::JobConfig;
use crate::data::{SplitMix64, tokenizer};
use crate::model::drafter::{DraftBufferHandle, DraftRow, Drafter, DrafterConfig, DrafterTrainer};
use crate::model::infer::InferStage;
use crate::model::{Cut, Gpt};
use crate::rl::config::RlConfig;
use crate::tensor::CpuBackend;

impl From<RolloutError> for RlError {
    fn from(e: RolloutError) -> Self {
        RlError::Rollout(e.to_string())
    }
}

impl From<crate::model::drafter::DrafterError> for RlError {
    fn from(e: crate::model::drafter::DrafterError) -> Self {
        RlError::Rollout(format!("drafter: {e}"))
    }
}

/// Rollouts through the pipelined rollout engine, speculative or plain, with a drafter
/// trained on every step's rollouts.
pub struct PipelineRollouts {
    rl: RlConfig,
    stages: usize,
    speculation: Speculation,
    /// Trains on the rollouts' rows.
    trainer: DrafterTrainer<CpuBackend>,
    /// Proposes during the rollout, loaded with the trainer's weights before each one.
    proposer: Drafter<CpuBackend>,
}

impl PipelineRollouts {
    /// The engine for `job`'s `[rl]`: its model cut into `job.stages` stages, its
    /// `[drafter]` trained on the rollouts.
    pub fn new(job: &JobConfig) -> Result<Self, RlError> {
        let (model, rl, stages) = (&job.model, &job.rl, job.stages);
        let config: &DrafterConfig = &job.drafter;
        config.validate()?;
        let be = || CpuBackend::new(1).map_err(crate::model::ModelError::from);
        let buffer = DraftBufferHandle::new(model, config);
        let trainer = DrafterTrainer::new(Drafter::new(model, config, be()?)?, buffer, 0, 1)?;
        let speculation = if rl.speculation {
            Speculation::Adaptive(AdaptiveConfig {
                threshold: rl.spec_threshold,
                ks: (1..=rl.draft_k).collect(),
                ..AdaptiveConfig::default()
            })
        } else {
            Speculation::Off
        };
        Ok(PipelineRollouts {
            proposer: Drafter::new(model, config, be()?)?,
            rl: rl.clone(),
            stages,
            speculation,
            trainer,
        })
    }
}

impl RolloutEngine for PipelineRollouts {
    fn generate(
        &mut self,
        policy: &Gpt<CpuBackend>,
        prompts: &[Vec<u32>],
        group: usize,
        max_new: usize,
        step: u64,
    ) -> Result<RolloutBatch, RlError> {
        let stages = InferStage::stages_of(policy, &Cut::Even(self.stages))?;
        let mut engine = Engine::new(stages)?;
        let requests: Vec<Request> = prompts
            .iter()
            .flat_map(|p| {
                (0..group).map(|_| Request {
                    prompt: p.clone(),
                    max_new,
                })
            })
            .collect();
        let speculate = !matches!(self.speculation, Speculation::Off);
        if speculate {
            self.proposer.load_weights(&self.trainer.weights()?)?;
            self.proposer.refresh_from_gpt(policy, step)?;
        }
        let config = RolloutConfig {
            eos: tokenizer::EOS,
            temperature: self.rl.temperature,
            groups: self.stages.max(1),
            seed: SplitMix64::derive(self.rl.seed, step).next_u64(),
            speculation: self.speculation.clone(),
            record_rows: speculate,
            step,
        };
        let proposer = speculate.then_some(&mut self.proposer as &mut dyn Proposer);
        let out = engine.run(&requests, &config, proposer)?;

        // The drafter follows the policy: agreement on this step's rows before training
        // on them (how well it matched the policy that sampled them), then slices. Without
        // speculation nothing would use it, so it is left alone.
        let drafted = Instant::now();
        let agreement = if speculate {
            self.trainer.drafter_mut().refresh_from_gpt(policy, step)?;
            let held: Vec<DraftRow> = out.rows.iter().take(4).cloned().collect();
            let agreement = self.trainer.agreement(&held)?;
            let buffer = self.trainer.buffer().clone();
            buffer.begin_step(step);
            {
                let mut b = buffer.lock();
                for row in &out.rows {
                    b.push(row.clone())?;
                }
            }
            for _ in 0..self.rl.drafter_slices {
                self.trainer.slice()?;
            }
            Some(agreement)
        } else {
            None
        };
        let drafter_seconds = drafted.elapsed().as_secs_f64();

        let rollouts = (0..requests.len())
            .map(|i| Rollout {
                prompt: out.sequences[i][..out.prompt_lens[i]].to_vec(),
                generated: out.completion(i).to_vec(),
            })
            .collect();
        let s = &out.stats;
        let chosen_k = (!out.choices.is_empty()).then(|| {
            out.choices.iter().map(|c| c.k as f64).sum::<f64>() / out.choices.len() as f64
        });
        Ok(RolloutBatch {
            rollouts,
            live_batch: out.live_curve.iter().map(|p| p.live).collect(),
            acceptance_length: (s.verifications > 0).then(|| s.acceptance_length()),
            chosen_k,
            drafter_agreement: agreement,
            drafter_seconds,
            ..RolloutBatch::default()
        })
    }

    fn speculative(&self) -> bool {
        !matches!(self.speculation, Speculation::Off)
    }
}
