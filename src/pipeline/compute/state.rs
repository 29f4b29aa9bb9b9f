//! A rank's state in and out: a resumed rank loads its share of a checkpoint's model and
//! moments, a finished (or checkpointing) rank exports its parameters and moments.

use super::{RankCompute, RankFinal};
use crate::model::ModelError;
use crate::model::OptimizerState;
use crate::model::checkpoint::HostTensor;
use crate::pipeline::error::PipelineError;
use crate::tensor::Backend;

impl<B: Backend> RankCompute<B> {
    /// Loads this rank's share of a resumed model and optimizer state: the parameters of the
    /// chunks it holds and their AdamW moments (the other ranks' slots are left out).
    pub(crate) fn load_resumed<G: Backend>(
        &mut self,
        model: &crate::model::Gpt<G>,
        state: &OptimizerState,
    ) -> Result<(), PipelineError> {
        let mut names = Vec::new();
        for chunk in self.chunks.values_mut() {
            for name in chunk.param_names() {
                chunk.set_param(&name, &model.param_values(&name)?)?;
                names.push(name);
            }
        }
        let own = match &self.zero {
            // A replica of a sharded optimizer keeps its chunk of the moments.
            Some(zero) => zero.own_state(self.rank, state)?,
            None => OptimizerState {
                step: state.step,
                slots: names
                    .iter()
                    .filter_map(|n| state.slots.get(n).map(|s| (n.clone(), s.clone())))
                    .collect(),
            },
        };
        self.optimizer.load_state(&self.backend, &own)?;
        Ok(())
    }

    /// [`RankCompute::export`] after the rank's last step: the moments move out
    /// ([`crate::model::AdamW::take_state`]) instead of being copied beside the live ones,
    /// so the run's end does not hold them twice. The rank takes no further step.
    pub(super) fn export_final(&mut self) -> Result<RankFinal, PipelineError> {
        if self.zero.is_some() {
            return self.export();
        }
        let optimizer = self.optimizer.take_state(&self.backend)?;
        Ok(RankFinal {
            stages: self.export_params()?,
            optimizer,
        })
    }

    /// The final parameters and optimizer state of this rank.
    pub(super) fn export(&self) -> Result<RankFinal, PipelineError> {
        let optimizer = match &self.zero {
            Some(zero) => {
                zero.gather_state(self.rank, &self.backend, &self.optimizer, &self.chunks)?
            }
            None => self.optimizer.state(&self.backend)?,
        };
        Ok(RankFinal {
            stages: self.export_params()?,
            optimizer,
        })
    }

    /// The parameters of every chunk of this rank, copied to the host, by stage.
    fn export_params(&self) -> Result<Vec<(u32, Vec<HostTensor>)>, PipelineError> {
        let mut stages = Vec::with_capacity(self.chunks.len());
        for (&stage, chunk) in &self.chunks {
            let mut params = Vec::new();
            for p in chunk.params() {
                params.push(HostTensor {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    data: self.backend.to_host(&p.value).map_err(ModelError::from)?,
                });
            }
            stages.push((stage, params));
        }
        Ok(stages)
    }
}
