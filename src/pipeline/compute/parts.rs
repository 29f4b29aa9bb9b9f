//! Kept ranks: a finished rank's chunks and optimizer moved out of it ([`RankParts`]) and
//! a later run's rank continuing from them ([`RankCompute::from_parts`]), so that runs of
//! one step each (the RL update's) neither export nor reload the model and its moments.

use std::collections::BTreeMap;
use std::sync::mpsc::Sender;

use super::{RankCompute, RankJob};
use crate::model::{AdamW, ModelChunk};
use crate::pipeline::error::PipelineError;
use crate::tensor::Backend;
use crate::train::reference::adamw_config;

/// A finished rank's state, moved out of it, not copied: its chunks (parameters on its
/// backend) and its optimizer (moments, step count).
pub(crate) struct RankParts<B: Backend> {
    pub(crate) rank: usize,
    pub(crate) backend: B,
    pub(crate) chunks: BTreeMap<u32, ModelChunk<B>>,
    pub(crate) optimizer: AdamW<B>,
}

impl<B: Backend> RankCompute<B> {
    /// Rank `parts.rank` of `run.plan` continuing from a kept rank's chunks and optimizer
    /// (see [`RankCompute::keep_into`]): what [`RankCompute::resumed`] builds from a checkpoint of them, without
    /// the copies. The plan must place the same stages on the rank, and the job's AdamW
    /// hyper-parameters must be the kept optimizer's.
    pub(crate) fn from_parts(run: RankJob<'_>, parts: RankParts<B>) -> Result<Self, PipelineError> {
        let rank = parts.rank;
        let placed = run.plan.stages_of(rank);
        if !parts.chunks.keys().copied().eq(placed.iter().copied()) {
            return Err(PipelineError::Config {
                field: "schedule",
                reason: format!(
                    "places stages {placed:?} on rank {rank}, whose kept chunks are stages {:?}",
                    parts.chunks.keys().collect::<Vec<_>>()
                ),
            });
        }
        if parts.optimizer.config() != &adamw_config(&run.job.train) {
            return Err(PipelineError::Config {
                field: "train",
                reason: format!(
                    "rank {rank}'s kept optimizer has other AdamW hyper-parameters than the job's"
                ),
            });
        }
        let state = (parts.backend, parts.chunks, parts.optimizer);
        RankCompute::assemble(run, rank, state)
    }

    /// After its last iteration the rank sends its chunks and optimizer to `keep` instead
    /// of depositing an exported copy of them as the run's final state.
    pub(crate) fn keep_into(&mut self, keep: Sender<RankParts<B>>) {
        self.keep = Some(keep);
    }

    /// Moves the chunks and optimizer to `keep` (after the last iteration).
    pub(super) fn send_parts(&mut self, keep: &Sender<RankParts<B>>) {
        let fresh = AdamW::new(self.optimizer.config().clone());
        let parts = RankParts {
            rank: self.rank,
            backend: self.backend.clone(),
            chunks: std::mem::take(&mut self.chunks),
            optimizer: std::mem::replace(&mut self.optimizer, fresh),
        };
        // Only a caller that gave up on the run has dropped the receiver.
        let _ = keep.send(parts);
    }
}
