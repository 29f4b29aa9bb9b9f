//! [`StepFeed`]: the training data of every step, shared by the ranks that need it.
//!
//! Stage 0 needs each micro-batch's input tokens and the last stage its targets and loss
//! scale. Both read the same [`StepBatches`], built once per step by the reference
//! trainer's own functions ([`step_micro_batches`], [`loss_scales`]), so a pipelined step
//! sees exactly the data and scales the oracle sees.
//!
//! Building a step's batches costs CPU time; a rank asks for step `k + 1` at the end of its
//! optimizer step of `k` ([`StepFeed::prefetch`]) so that the cost never lands inside a
//! timed F or I.
//!
//! A feed can also be [`StepFeed::given`] its steps by the caller instead of building them
//! from the synthetic stream: the RL update hands over one step of rollout sequences and
//! their GRPO loss scales. A step it was not given has no micro-batches, which the ranks
//! report as an error naming the missing micro-batch.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::config::TrainConfig;
use crate::data::{MicroBatch, StepData};
use crate::model::layers::TokenLoss;
use crate::train::reference::{loss_scales, step_micro_batches};

/// One step's micro-batches and the `d objective / d loss` of each.
#[derive(Debug)]
pub struct StepBatches {
    pub batches: Vec<MicroBatch>,
    pub scales: Vec<f32>,
    /// Replaces the mean cross-entropy of each micro-batch at the last stage (e.g. the RL
    /// update's GRPO objective with a per-token KL penalty); `None`: plain training.
    pub token_loss: Option<Arc<dyn TokenLoss>>,
}

impl StepBatches {
    /// Target tokens of the whole step.
    pub fn tokens(&self) -> usize {
        self.batches.iter().map(MicroBatch::tokens).sum()
    }
}

/// Where a feed's steps come from. (One feed per run, so the synthetic variant's size
/// does not matter.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
enum Source {
    /// Built from the synthetic task stream, as the reference trainer builds them.
    Synthetic { data: StepData, train: TrainConfig },
    /// Handed over by the caller; nothing else exists.
    Given,
}

/// The data of every step, built on demand (or given) and kept until every rank is past it.
#[derive(Debug)]
pub struct StepFeed {
    source: Source,
    cache: Mutex<BTreeMap<u64, Arc<StepBatches>>>,
}

impl StepFeed {
    pub fn new(data: StepData, train: TrainConfig) -> Self {
        StepFeed {
            source: Source::Synthetic { data, train },
            cache: Mutex::new(BTreeMap::new()),
        }
    }

    /// A feed of exactly the steps `steps` (step number → batches and loss scales).
    pub fn given(steps: impl IntoIterator<Item = (u64, StepBatches)>) -> Self {
        StepFeed {
            source: Source::Given,
            cache: Mutex::new(steps.into_iter().map(|(k, b)| (k, Arc::new(b))).collect()),
        }
    }

    /// Step `step`'s batches (built now if no rank asked before). A given feed answers a
    /// step it was not given with no batches.
    pub fn get(&self, step: u64) -> Arc<StepBatches> {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(entry) = cache.get(&step) {
            return Arc::clone(entry);
        }
        match &self.source {
            Source::Synthetic { data, train } => {
                let batches = step_micro_batches(data, train, step);
                let scales = loss_scales(&batches);
                let entry = Arc::new(StepBatches {
                    batches,
                    scales,
                    token_loss: None,
                });
                cache.insert(step, Arc::clone(&entry));
                entry
            }
            Source::Given => Arc::new(StepBatches {
                batches: Vec::new(),
                scales: Vec::new(),
                token_loss: None,
            }),
        }
    }

    /// Builds step `step`'s batches ahead of time (nothing to build for a given feed).
    pub fn prefetch(&self, step: u64) {
        if matches!(self.source, Source::Synthetic { .. }) {
            self.get(step);
        }
    }

    /// Forgets every step before `step` (the ranks that read them are past them).
    pub fn evict_before(&self, step: u64) {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        *cache = cache.split_off(&step);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::DataConfig;

    #[test]
    fn steps_are_the_reference_trainers_and_evicted_when_done() {
        let train = TrainConfig {
            micro_batches: 3,
            micro_batch_size: 2,
            ..TrainConfig::default()
        };
        let data = StepData::new(DataConfig::default(), 8, 7).unwrap();
        let feed = StepFeed::new(data.clone(), train.clone());
        let step = feed.get(4);
        assert_eq!(step.batches, step_micro_batches(&data, &train, 4));
        assert_eq!(step.scales, loss_scales(&step.batches));
        assert_eq!(step.tokens(), 3 * 2 * 8);
        assert!(Arc::ptr_eq(&step, &feed.get(4)), "built once");
        feed.prefetch(5);
        feed.evict_before(5);
        let cache = feed.cache.lock().unwrap();
        assert_eq!(cache.keys().copied().collect::<Vec<_>>(), vec![5]);
    }

    #[test]
    fn a_given_feed_serves_only_its_own_steps() {
        let mb = MicroBatch {
            rows: 1,
            seq_len: 2,
            inputs: vec![1, 5],
            targets: vec![crate::tensor::IGNORE_TARGET, 2],
        };
        let step = StepBatches {
            batches: vec![mb.clone(), mb],
            scales: vec![0.5, -0.25],
            token_loss: None,
        };
        let feed = StepFeed::given([(7, step)]);
        feed.prefetch(8);
        let got = feed.get(7);
        assert_eq!(got.scales, [0.5, -0.25], "the caller's scales, untouched");
        assert_eq!(got.batches.len(), 2);
        assert!(Arc::ptr_eq(&got, &feed.get(7)));
        assert!(
            feed.get(8).batches.is_empty(),
            "a step not given has no batches"
        );
        feed.evict_before(8);
        assert!(feed.get(7).batches.is_empty(), "evicted");
    }
}
