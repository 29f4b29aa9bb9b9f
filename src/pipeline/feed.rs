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

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::data::{MicroBatch, StepData};
use crate::train::TrainConfig;
use crate::train::reference::{loss_scales, step_micro_batches};

/// One step's micro-batches and the `d objective / d loss` of each.
#[derive(Debug)]
pub struct StepBatches {
    pub batches: Vec<MicroBatch>,
    pub scales: Vec<f32>,
}

impl StepBatches {
    /// Target tokens of the whole step.
    pub fn tokens(&self) -> usize {
        self.batches.iter().map(MicroBatch::tokens).sum()
    }
}

/// The data of every step, built on demand and kept until every rank is past it.
#[derive(Debug)]
pub struct StepFeed {
    data: StepData,
    train: TrainConfig,
    cache: Mutex<BTreeMap<u64, Arc<StepBatches>>>,
}

impl StepFeed {
    pub fn new(data: StepData, train: TrainConfig) -> Self {
        StepFeed {
            data,
            train,
            cache: Mutex::new(BTreeMap::new()),
        }
    }

    /// Step `step`'s batches (built now if no rank asked before).
    pub fn get(&self, step: u64) -> Arc<StepBatches> {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = cache.entry(step).or_insert_with(|| {
            let batches = step_micro_batches(&self.data, &self.train, step);
            let scales = loss_scales(&batches);
            Arc::new(StepBatches { batches, scales })
        });
        Arc::clone(entry)
    }

    /// Builds step `step`'s batches ahead of time.
    pub fn prefetch(&self, step: u64) {
        self.get(step);
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
}
