//! [`PlainSampler`]: the RL loop's rollout engine without speculation: every sequence of
//! the batch is prefilled in one call, then decoded one token per live sequence per call
//! through the KV-cache inference stages ([`crate::model::infer`]), sampling at the job's
//! temperature. Sequences leave the batch at `EOS` or at the token budget, so the recorded
//! live-batch curve is the rollout's long tail.
//!
//! Sampling is seeded by `(seed, step, sequence)`: each sequence has its own stream, so a
//! sequence's tokens do not depend on which others are still live.

use std::time::Instant;

use super::accept::{sample, softmax};
use super::generator::{Rollout, RolloutBatch, RolloutGenerator, RolloutRequest};
use crate::data::SplitMix64;
use crate::model::infer::{InferStage, Span, run_stages};
use crate::model::{Cut, Gpt};
use crate::rl::RlError;
use crate::rl::rollout::{LivePoint, tail_share};
use crate::tensor::Backend;

/// Plain (non-speculative) sampling at `temperature`.
#[derive(Debug, Clone)]
pub struct PlainSampler {
    pub temperature: f32,
    pub seed: u64,
}

impl<B: Backend> RolloutGenerator<B> for PlainSampler {
    fn generate(
        &mut self,
        policy: &Gpt<B>,
        request: RolloutRequest<'_>,
    ) -> Result<RolloutBatch, RlError> {
        let (max_new, eos) = (request.max_new, request.eos);
        let vocab = policy.config().vocab;
        let mut stages = InferStage::stages_of(policy, &Cut::Even(1))?;
        let mut seqs: Vec<Rollout> = request
            .sequence_prompts()
            .map(|p| Rollout {
                prompt: p.clone(),
                generated: Vec::with_capacity(max_new),
            })
            .collect();
        let step_seed = SplitMix64::derive(self.seed, request.step).next_u64();
        let mut rngs: Vec<SplitMix64> = (0..seqs.len() as u64)
            .map(|i| SplitMix64::derive(step_seed, i))
            .collect();
        // Prefill: every prompt's positions; then one new position per live sequence.
        let mut live: Vec<usize> = (0..seqs.len()).collect();
        let mut spans: Vec<Span> = live
            .iter()
            .map(|&slot| Span {
                slot,
                start: 0,
                len: seqs[slot].prompt.len(),
            })
            .collect();
        let mut ids: Vec<u32> = seqs.iter().flat_map(|s| s.prompt.clone()).collect();
        // The live batch after each iteration, in time (for the tail's share).
        let (started, mut curve, mut tokens) = (Instant::now(), Vec::with_capacity(max_new), 0);
        while !live.is_empty() {
            let (logits, _) = run_stages(&mut stages, &spans, &ids)?;
            let mut row = 0;
            let mut next_live = Vec::with_capacity(live.len());
            for (span, &slot) in spans.iter().zip(&live) {
                row += span.len;
                let last = &logits[(row - 1) * vocab..row * vocab];
                let token = sample(&softmax(last, self.temperature), &mut rngs[slot]);
                let s = &mut seqs[slot];
                s.generated.push(token);
                if token != eos && s.generated.len() < max_new {
                    next_live.push(slot);
                } else {
                    for stage in &mut stages {
                        stage.release(slot);
                    }
                }
            }
            tokens += spans.len();
            live = next_live;
            curve.push(LivePoint {
                t: started.elapsed().as_secs_f64(),
                live: live.len(),
                tokens,
            });
            spans = live
                .iter()
                .map(|&slot| Span {
                    slot,
                    start: seqs[slot].prompt.len() + seqs[slot].generated.len() - 1,
                    len: 1,
                })
                .collect();
            ids = live
                .iter()
                .map(|&slot| *seqs[slot].generated.last().expect("one token sampled"))
                .collect();
        }
        let seconds = started.elapsed().as_secs_f64();
        Ok(RolloutBatch {
            tail_share: Some(tail_share(&curve, seqs.len(), seconds)),
            rollouts: seqs,
            live_batch: curve.iter().map(|p| p.live).collect(),
            ..RolloutBatch::default()
        })
    }

    fn speculative(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::tokenizer;
    use crate::model::GptConfig;
    use crate::tensor::CpuBackend;

    #[test]
    fn groups_of_samples_stop_at_eos_or_the_budget_and_repeat_with_the_seed() {
        let cfg = GptConfig {
            layers: 2,
            d_model: 16,
            heads: 2,
            seq_len: 24,
            ..GptConfig::default()
        };
        let gpt = Gpt::new(&cfg, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
        let prompts = vec![vec![tokenizer::BOS, 20, 21], vec![tokenizer::BOS, 30]];
        let mut engine = PlainSampler {
            temperature: 1.0,
            seed: 4,
        };
        let request = RolloutRequest {
            prompts: &prompts,
            group: 3,
            max_new: 6,
            eos: tokenizer::EOS,
            step: 0,
        };
        let batch = engine.generate(&gpt, request).unwrap();
        assert_eq!(batch.rollouts.len(), 6);
        for (i, r) in batch.rollouts.iter().enumerate() {
            assert_eq!(r.prompt, prompts[i / 3]);
            let eos = r.generated.iter().position(|&t| t == tokenizer::EOS);
            match eos {
                Some(at) => assert_eq!(at + 1, r.generated.len(), "nothing after EOS"),
                None => assert_eq!(r.generated.len(), 6, "cut at the budget"),
            }
        }
        // The live batch only shrinks, to 0, one entry per decode call.
        assert!(batch.live_batch.windows(2).all(|w| w[0] >= w[1]));
        assert_eq!(batch.live_batch.last(), Some(&0));
        let longest = batch.rollouts.iter().map(|r| r.generated.len()).max();
        assert_eq!(Some(batch.live_batch.len()), longest);
        // An untrained model's samples differ within a group; the seed repeats them.
        let again = engine.generate(&gpt, request).unwrap();
        assert_eq!(again.rollouts, batch.rollouts);
        assert_ne!(batch.rollouts[0], batch.rollouts[1]);
        let other = engine
            .generate(&gpt, RolloutRequest { step: 1, ..request })
            .unwrap();
        assert_ne!(other.rollouts, batch.rollouts);
    }
}
