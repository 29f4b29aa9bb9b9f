//! A chunk's parameters by name and in model order, their values and gradients: what the
//! optimizer, checkpoints and the drafter's frozen copies read and write.

use super::ModelChunk;
use crate::model::ModelError;
use crate::model::layers::Layer;
use crate::model::{Param, Result};
use crate::tensor::Backend;

impl<B: Backend> ModelChunk<B> {
    /// Every parameter, in model order (embedding, blocks, final norm, head).
    pub fn params(&self) -> Vec<&Param<B>> {
        let mut v = self.embed.as_ref().map(|e| e.params()).unwrap_or_default();
        self.blocks.iter().for_each(|b| v.extend(b.params()));
        if let (Some(n), Some(h)) = (&self.final_norm, &self.head) {
            v.extend(n.params());
            v.extend(h.params());
        }
        v
    }

    /// Every parameter, mutable, in model order.
    pub fn params_mut(&mut self) -> Vec<&mut Param<B>> {
        let mut v = self
            .embed
            .as_mut()
            .map(|e| e.params_mut())
            .unwrap_or_default();
        self.blocks
            .iter_mut()
            .for_each(|b| v.extend(b.params_mut()));
        if let (Some(n), Some(h)) = (&mut self.final_norm, &mut self.head) {
            v.extend(n.params_mut());
            v.extend(h.params_mut());
        }
        v
    }

    /// The parameter called `name`.
    pub fn param(&self, name: &str) -> Result<&Param<B>> {
        let found = self.params().into_iter().find(|p| p.name == name);
        found.ok_or_else(|| ModelError::UnknownParam(name.to_string()))
    }

    /// The parameter called `name`, mutable.
    pub fn param_mut(&mut self, name: &str) -> Result<&mut Param<B>> {
        let found = self.params_mut().into_iter().find(|p| p.name == name);
        found.ok_or_else(|| ModelError::UnknownParam(name.to_string()))
    }

    /// The names of every parameter, in model order.
    pub fn param_names(&self) -> Vec<String> {
        self.params().iter().map(|p| p.name.clone()).collect()
    }

    /// A parameter's value, on the host.
    pub fn param_values(&self, name: &str) -> Result<Vec<f32>> {
        Ok(self.be.to_host(&self.param(name)?.value)?)
    }

    /// A parameter's accumulated gradient, on the host.
    pub fn grad_values(&self, name: &str) -> Result<Vec<f32>> {
        Ok(self.be.to_host(&self.param(name)?.grad)?)
    }

    /// Overwrites a parameter's value (e.g. from a checkpoint). An optimizer's `f32` master
    /// copy of it is not touched: restore the optimizer's state with it.
    pub fn set_param(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let be = self.be.clone();
        let p = self.param_mut(name)?;
        if values.len() != p.numel() {
            let (expected, got) = (p.numel(), values.len());
            return Err(ModelError::ParamLen {
                name: name.to_string(),
                expected,
                got,
            });
        }
        p.value = be.from_host(values, be.dtype(&p.value))?;
        Ok(())
    }

    /// Sets every gradient to zero (start of a step).
    pub fn zero_grads(&mut self) -> Result<()> {
        let be = self.be.clone();
        for p in self.params_mut() {
            be.fill(&mut p.grad, 0.0)?;
        }
        Ok(())
    }

    /// `Σ g²` over this chunk's gradients; the global norm is `√` of the sum over chunks.
    /// A tied copy ([`Param::tied`]) is not counted: its original is.
    pub fn grad_sq_norm(&self) -> Result<f64> {
        let mut sum = 0.0;
        for p in self.params().into_iter().filter(|p| !p.tied) {
            sum += self.be.sum_squares(&p.grad)?;
        }
        Ok(sum)
    }
}
