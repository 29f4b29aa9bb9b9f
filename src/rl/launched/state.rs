//! What a launched RL rank holds between steps ([`RankState`]), and where its next pipelined
//! run starts from ([`Start`]) and what that run leaves ([`Ended`]).
//!
//! With `keep_update_ranks` (the default, as in-process: [`RlTrainer::keep_update_ranks`])
//! a rank's update compute stays alive from step to step: a run ends by moving its chunks
//! and AdamW out ([`RankParts`]) and the next one continues from them
//! ([`RankCompute::from_parts`]), so no step re-creates the chunks, copies every parameter
//! and moment to the host and back, or rebuilds the optimizer. The weight sync then sends
//! rank 0 only what the rollouts need, the parameters; the moments go once, at the final
//! sync (rank 0 needs them only for the final checkpoint). Rank 0 refreshes its policy's
//! copy of its own stages buffer to buffer. Off, every run exports its stages and moments
//! to the host and the next one is rebuilt from them, as before; both give the same bits
//! (the same parameters, moments and step count: `tests/launch_rl.rs`).
//!
//! [`RlTrainer::keep_update_ranks`]: crate::rl::trainer::RlTrainer::keep_update_ranks
//! [`RankCompute::from_parts`]: crate::pipeline::RankCompute

use std::collections::BTreeMap;

use crate::model::ModelError;
use crate::model::checkpoint::HostTensor;
use crate::model::{Cut, Gpt, OptimizerState};
use crate::pipeline::compute::RankParts;
use crate::pipeline::shared::RankFinal;
use crate::tensor::Backend;

/// What a rank holds between steps.
pub(super) struct RankState<B: Backend> {
    /// A whole model: rank 0's policy, every stage current after each weight sync.
    /// Elsewhere what a rebuilt rank loads its stages from: only this rank's own stages are
    /// kept current here, and only while it holds no [`RankState::kept`] rank.
    pub model: Gpt<B>,
    /// `model`'s optimizer state, current as `model` is; with a kept rank, rank 0 has its
    /// peers' moments only after the final sync.
    pub optimizer: OptimizerState,
    /// The next optimizer step.
    pub step: u64,
    /// The last run's rank, alive: this rank's stages and moments are current there.
    pub kept: Option<RankParts<B>>,
    /// The last run's exported stages (no kept rank), for the next weight sync.
    pub exported: RankFinal,
}

/// Where a rank's pipelined run starts.
pub(super) enum Start<'a, B: Backend> {
    /// The job's initial model (the warm-up).
    Fresh,
    /// The stages and moments of a host copy (rank 0's whole state, or a rank's own).
    Host(&'a RankState<B>),
    /// The previous run's rank, alive.
    Kept(RankParts<B>),
}

/// What a rank's pipelined run leaves.
pub(super) enum Ended<B: Backend> {
    /// Host copies of its stages and moments.
    Exported(RankFinal),
    /// The rank, alive.
    Kept(RankParts<B>),
}

impl<B: Backend> RankState<B> {
    pub fn new(model: Gpt<B>, optimizer: OptimizerState, step: u64) -> Self {
        RankState {
            model,
            optimizer,
            step,
            kept: None,
            exported: RankFinal::default(),
        }
    }

    /// Where the next run starts: the kept rank, else the host copy. A plan that placed
    /// other stages on the rank than it keeps fails there with a clear error
    /// ([`RankCompute::from_parts`]): the host copy could not stand in, since a rank other
    /// than 0 holds only its own stages current (the update's placement is the schedule's,
    /// whatever the step's micro-batch count).
    ///
    /// [`RankCompute::from_parts`]: crate::pipeline::RankCompute
    pub fn start(&mut self) -> Start<'_, B> {
        match self.kept.take() {
            Some(parts) => Start::Kept(parts),
            None => Start::Host(self),
        }
    }

    /// Takes what a run left: the kept rank, or its exported stages (taken into the host
    /// copy too, and held for the next weight sync).
    pub fn ended(&mut self, ended: Ended<B>) -> Result<(), ModelError> {
        match ended {
            Ended::Kept(parts) => self.kept = Some(parts),
            Ended::Exported(fin) => {
                self.absorb(fin.clone())?;
                self.exported = fin;
            }
        }
        Ok(())
    }

    /// This rank's stages for a weight sync: the kept rank's parameters (and moments, at
    /// the `last` sync), else the last run's export.
    pub fn sync_wire(&mut self, last: bool) -> Result<RankFinal, ModelError> {
        match &self.kept {
            Some(parts) => wire_of(parts, last),
            None => Ok(std::mem::take(&mut self.exported)),
        }
    }

    /// Rank 0 before a weight sync: its own kept stages into the policy, buffer to buffer
    /// (and their moments into `optimizer` at the `last` sync). Without a kept rank the
    /// run's export is in already.
    pub fn refresh_own(&mut self, last: bool) -> Result<(), ModelError> {
        let Some(parts) = &self.kept else {
            return Ok(());
        };
        let mut params: BTreeMap<String, &mut crate::model::Param<B>> = self
            .model
            .params_mut()
            .into_iter()
            .map(|p| (p.name.clone(), p))
            .collect();
        for src in parts.chunks.values().flat_map(|c| c.params()) {
            let dst = params
                .get_mut(src.name.as_str())
                .ok_or_else(|| ModelError::UnknownParam(src.name.clone()))?;
            parts.backend.copy(&src.value, &mut dst.value)?;
        }
        if last {
            let moments = parts.optimizer.state(&parts.backend)?;
            self.absorb_moments(moments);
        }
        Ok(())
    }

    /// Takes `shard`'s stages and moments.
    pub fn absorb(&mut self, shard: RankFinal) -> Result<(), ModelError> {
        for t in shard.stages.into_iter().flat_map(|(_, ts)| ts) {
            self.model.set_param(&t.name, &t.data)?;
        }
        self.absorb_moments(shard.optimizer);
        Ok(())
    }

    fn absorb_moments(&mut self, moments: OptimizerState) {
        self.optimizer.step = self.optimizer.step.max(moments.step);
        self.optimizer.slots.extend(moments.slots);
    }

    /// A frozen copy of the whole model (the KL reference).
    pub fn frozen_model(&self, backend: &B) -> Result<Gpt<B>, ModelError> {
        let model = &self.model;
        let mut copy = Gpt::blank(model.config(), backend.clone(), &Cut::Even(1))?;
        for name in model.param_names() {
            copy.set_param(&name, &model.param_values(&name)?)?;
        }
        Ok(copy)
    }
}

/// Host copies of a kept rank's parameters (and its moments with `moments`; else none and
/// step 0, which [`RankState::absorb`] leaves as they are).
fn wire_of<B: Backend>(parts: &RankParts<B>, moments: bool) -> Result<RankFinal, ModelError> {
    let mut stages = Vec::with_capacity(parts.chunks.len());
    for (&stage, chunk) in &parts.chunks {
        let tensors = chunk
            .params()
            .into_iter()
            .map(|p| {
                Ok(HostTensor {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    data: parts.backend.to_host(&p.value)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        stages.push((stage, tensors));
    }
    let optimizer = if moments {
        parts.optimizer.state(&parts.backend)?
    } else {
        OptimizerState::default()
    };
    Ok(RankFinal { stages, optimizer })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{AdamW, AdamWConfig, GptConfig, ModelChunk, SlotState};
    use crate::tensor::CpuBackend;

    fn config() -> GptConfig {
        GptConfig {
            vocab: 11,
            d_model: 8,
            heads: 2,
            layers: 2,
            seq_len: 6,
            ..GptConfig::default()
        }
    }

    /// A rank kept with stage 1 of 2 (fresh random parameters) and moments of 1s and 2s at
    /// optimizer step 7.
    fn kept(be: &CpuBackend) -> RankParts<CpuBackend> {
        let chunk = ModelChunk::new(&config(), be.clone(), &Cut::Even(2), 1).unwrap();
        let mut moments = OptimizerState {
            step: 7,
            ..OptimizerState::default()
        };
        for p in chunk.params() {
            let n = p.shape.iter().product();
            let slot = SlotState {
                m: vec![1.0; n],
                v: vec![2.0; n],
                master: None,
            };
            moments.slots.insert(p.name.clone(), slot);
        }
        let mut optimizer = AdamW::new(AdamWConfig::default());
        optimizer.load_state(be, &moments).unwrap();
        RankParts {
            rank: 1,
            backend: be.clone(),
            chunks: BTreeMap::from([(1, chunk)]),
            optimizer,
        }
    }

    #[test]
    fn a_kept_rank_syncs_its_parameters_and_its_moments_only_at_the_last_sync() {
        let be = CpuBackend::new(1).unwrap();
        let parts = kept(&be);
        let want: Vec<(String, Vec<f32>)> = parts.chunks[&1]
            .params()
            .iter()
            .map(|p| (p.name.clone(), be.to_host(&p.value).unwrap()))
            .collect();
        let model = Gpt::blank(&config(), be.clone(), &Cut::Even(1)).unwrap();
        let mut state = RankState::new(model, OptimizerState::default(), 3);
        state.kept = Some(parts);

        let mid = state.sync_wire(false).unwrap();
        let sent: Vec<(String, Vec<f32>)> = mid.stages[0]
            .1
            .iter()
            .map(|t| (t.name.clone(), t.data.clone()))
            .collect();
        assert_eq!((mid.stages.len(), mid.stages[0].0), (1, 1));
        assert_eq!(sent, want);
        assert_eq!(mid.optimizer, OptimizerState::default());
        let last = state.sync_wire(true).unwrap();
        assert_eq!(last.optimizer.step, 7);
        assert_eq!(last.optimizer.slots.len(), want.len());
        assert!(state.kept.is_some(), "a sync leaves the rank alive");

        // Rank 0's view: its own kept stages refresh the policy buffer to buffer.
        state.refresh_own(false).unwrap();
        for (name, data) in &want {
            assert_eq!(&state.model.param_values(name).unwrap(), data, "{name}");
        }
        assert!(state.optimizer.slots.is_empty());
        state.refresh_own(true).unwrap();
        assert_eq!(state.optimizer, last.optimizer);

        // The next run takes the rank, and gets it back at its end.
        assert!(matches!(state.start(), Start::Kept(_)));
        assert!(state.kept.is_none());
        assert!(matches!(state.start(), Start::Host(_)));
        state.ended(Ended::Kept(kept(&be))).unwrap();
        assert!(state.kept.is_some());
    }
}
