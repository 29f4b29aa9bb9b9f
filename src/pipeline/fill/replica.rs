//! A rank's drafter replica behind one object type ([`ReplicaTrainer`]), whatever backend it
//! computes on: the fill keeps one per rank, each on its rank's device, without every type
//! that holds the fill being generic over the backend.

use crate::data::SplitMix64;
use crate::model::OptimizerState;
use crate::model::drafter::{
    DrafterError, DrafterGrads, DrafterTrainer, DrafterWeights, SliceStats,
};
use crate::tensor::Backend;

type Result<T> = std::result::Result<T, DrafterError>;

/// What the fill asks of a replica's [`DrafterTrainer`] (each method is the trainer's own).
pub(super) trait ReplicaTrainer: Send {
    fn version(&self) -> u64;
    fn max_slice_rows(&self) -> usize;
    fn slice_size(&self, rows: usize) -> usize;
    fn slice_within(&mut self, rows: usize) -> Result<SliceStats>;
    fn slice_of_step(&mut self, rows: usize, step: u64) -> Result<SliceStats>;
    fn take_grads(&mut self) -> Result<DrafterGrads>;
    fn step_with(&mut self, grads: &[DrafterGrads]) -> Result<u64>;
    fn weights(&self) -> Result<DrafterWeights>;
    /// Refreshes the frozen copy `name` (`embed.tok` or `head.w`) as of target step `step`.
    fn refresh(&mut self, name: &str, values: &[f32], step: u64) -> Result<()>;
    fn sampler(&self) -> SplitMix64;
    fn export_state(&self) -> Result<(DrafterWeights, OptimizerState)>;
    fn import_state(
        &mut self,
        weights: &DrafterWeights,
        optimizer: &OptimizerState,
        sampler: SplitMix64,
    ) -> Result<()>;
}

impl<B: Backend> ReplicaTrainer for DrafterTrainer<B> {
    fn version(&self) -> u64 {
        DrafterTrainer::version(self)
    }
    fn max_slice_rows(&self) -> usize {
        DrafterTrainer::max_slice_rows(self)
    }
    fn slice_size(&self, rows: usize) -> usize {
        DrafterTrainer::slice_size(self, rows)
    }
    fn slice_within(&mut self, rows: usize) -> Result<SliceStats> {
        DrafterTrainer::slice_within(self, rows)
    }
    fn slice_of_step(&mut self, rows: usize, step: u64) -> Result<SliceStats> {
        DrafterTrainer::slice_of_step(self, rows, step)
    }
    fn take_grads(&mut self) -> Result<DrafterGrads> {
        DrafterTrainer::take_grads(self)
    }
    fn step_with(&mut self, grads: &[DrafterGrads]) -> Result<u64> {
        DrafterTrainer::step_with(self, grads)
    }
    fn weights(&self) -> Result<DrafterWeights> {
        DrafterTrainer::weights(self)
    }
    fn refresh(&mut self, name: &str, values: &[f32], step: u64) -> Result<()> {
        self.drafter_mut().refresh(name, values, step)
    }
    fn sampler(&self) -> SplitMix64 {
        DrafterTrainer::sampler(self)
    }
    fn export_state(&self) -> Result<(DrafterWeights, OptimizerState)> {
        DrafterTrainer::export_state(self)
    }
    fn import_state(
        &mut self,
        weights: &DrafterWeights,
        optimizer: &OptimizerState,
        sampler: SplitMix64,
    ) -> Result<()> {
        DrafterTrainer::import_state(self, weights, optimizer, sampler)
    }
}
