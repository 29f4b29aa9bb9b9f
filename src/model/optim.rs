//! The optimizer: AdamW (decoupled weight decay, none on norm gains), global gradient-norm
//! clipping, and the warmup + cosine learning-rate schedule.
//!
//! One [`AdamW`] holds the state of the parameters it has stepped, keyed by name, so a
//! pipeline stage's optimizer covers just its chunks and a checkpoint can gather every
//! stage's [`OptimizerState`] by name. Clipping is global: each stage contributes its
//! `Σ g²` ([`super::ModelChunk::grad_sq_norm`]), the sum gives the norm, and [`clip_scale`]
//! turns it into the factor every stage passes to [`AdamW::step`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{ModelChunk, Param, Result};
use crate::model::ModelError;
use crate::tensor::{AdamWStep, Backend, DType};

/// AdamW hyper-parameters (the learning rate comes from [`LrSchedule`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled weight decay of matrices and embeddings (norm gains are never decayed).
    pub weight_decay: f32,
    /// Global gradient-norm limit; 0 disables clipping.
    pub max_grad_norm: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            max_grad_norm: 1.0,
        }
    }
}

/// Linear warmup to `peak_lr` over `warmup_steps`, then cosine decay to `min_lr` at
/// `total_steps` (and `min_lr` after).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LrSchedule {
    pub peak_lr: f32,
    pub min_lr: f32,
    pub warmup_steps: u64,
    pub total_steps: u64,
}

impl Default for LrSchedule {
    fn default() -> Self {
        LrSchedule {
            peak_lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 20,
            total_steps: 300,
        }
    }
}

impl LrSchedule {
    /// Learning rate of 0-based step `step`.
    pub fn lr(&self, step: u64) -> f32 {
        if step < self.warmup_steps {
            return self.peak_lr * (step + 1) as f32 / self.warmup_steps as f32;
        }
        if step >= self.total_steps {
            return self.min_lr;
        }
        let span = (self.total_steps - self.warmup_steps).max(1) as f64;
        let progress = (step - self.warmup_steps) as f64 / span;
        let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min_lr + (self.peak_lr - self.min_lr) * cos as f32
    }
}

/// The factor that brings a gradient of global norm `norm` down to `max_norm`
/// (1 when it is already within, or when `max_norm` is 0 = no clipping).
pub fn clip_scale(norm: f64, max_norm: f32) -> f32 {
    if max_norm > 0.0 && norm > f64::from(max_norm) {
        (f64::from(max_norm) / norm) as f32
    } else {
        1.0
    }
}

/// Device state of one parameter: the moments and, for non-`f32` storage, the master copy.
struct Slot<B: Backend> {
    m: B::Buf,
    v: B::Buf,
    master: Option<B::Buf>,
}

/// Host copy of one parameter's optimizer state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlotState {
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// `f32` master weights when the parameter is stored in a narrower type.
    pub master: Option<Vec<f32>>,
}

/// One part of a parameter's optimizer state ([`AdamW::slot_part`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotPart {
    /// The first moment.
    M,
    /// The second moment.
    V,
    /// The `f32` master weights (parameters stored in a narrower type only).
    Master,
}

/// Host copy of an optimizer's whole state, by parameter name (what checkpoints store).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OptimizerState {
    /// Steps taken so far.
    pub step: u64,
    pub slots: BTreeMap<String, SlotState>,
}

/// AdamW over named parameters. Deterministic: the same gradients give the same update.
pub struct AdamW<B: Backend> {
    config: AdamWConfig,
    step: u64,
    slots: BTreeMap<String, Slot<B>>,
}

impl<B: Backend> AdamW<B> {
    pub fn new(config: AdamWConfig) -> Self {
        AdamW {
            config,
            step: 0,
            slots: BTreeMap::new(),
        }
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// One update of `params` with learning rate `lr`, gradients multiplied by `grad_scale`
    /// (the [`clip_scale`]). Moments are created on a parameter's first step.
    pub fn step<'a>(
        &mut self,
        be: &B,
        params: impl IntoIterator<Item = &'a mut Param<B>>,
        lr: f32,
        grad_scale: f32,
    ) -> Result<()> {
        self.begin_step();
        for p in params {
            self.step_param(be, p, lr, grad_scale)?;
        }
        Ok(())
    }

    /// Begins one update: [`AdamW::step_param`] then updates each parameter with this
    /// update's step count (what [`AdamW::step`] does for all of its parameters at once;
    /// the sharded optimizer steps its pieces one by one, each made just before its update).
    pub fn begin_step(&mut self) {
        self.step += 1;
    }

    /// Updates `p` within the update [`AdamW::begin_step`] began.
    pub fn step_param(&mut self, be: &B, p: &mut Param<B>, lr: f32, grad_scale: f32) -> Result<()> {
        let c = &self.config;
        let slot = match self.slots.get_mut(&p.name) {
            Some(slot) => slot,
            None => {
                let n = p.numel();
                let slot = Slot {
                    m: be.zeros(n, DType::F32)?,
                    v: be.zeros(n, DType::F32)?,
                    master: None,
                };
                self.slots.entry(p.name.clone()).or_insert(slot)
            }
        };
        // A narrower parameter keeps an f32 master, from its value on its first step (or the
        // first after an f32 run's state was loaded: that state has none).
        if slot.master.is_none() && be.dtype(&p.value) != DType::F32 {
            slot.master = Some(be.from_host(&be.to_host(&p.value)?, DType::F32)?);
        }
        let hp = AdamWStep {
            lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: if p.decay { c.weight_decay } else { 0.0 },
            step: self.step,
            grad_scale,
        };
        be.adamw_step(
            &mut p.value,
            slot.master.as_mut(),
            &p.grad,
            &mut slot.m,
            &mut slot.v,
            hp,
        )?;
        Ok(())
    }

    /// Clips by the global norm of `chunks` (all on this optimizer) and steps them all;
    /// a tied embedding's two copies first take the sum of their gradients
    /// ([`super::tie::sum_local`]). Returns the gradient norm before clipping.
    pub fn step_chunks(&mut self, chunks: &mut [ModelChunk<B>], lr: f32) -> Result<f64> {
        if let Some(be) = chunks.first().map(|c| c.backend().clone()) {
            super::tie::sum_local(&be, chunks.iter_mut())?;
        }
        let mut sq = 0.0;
        for c in chunks.iter() {
            sq += c.grad_sq_norm()?;
        }
        let norm = sq.sqrt();
        let scale = clip_scale(norm, self.config.max_grad_norm);
        let Some(be) = chunks.first().map(|c| c.backend().clone()) else {
            return Ok(norm);
        };
        let params = chunks.iter_mut().flat_map(|c| c.params_mut());
        self.step(&be, params, lr, scale)?;
        Ok(norm)
    }

    /// The state, copied to the host.
    pub fn state(&self, be: &B) -> Result<OptimizerState> {
        let mut slots = BTreeMap::new();
        for (name, s) in &self.slots {
            let master = s.master.as_ref().map(|m| be.to_host(m)).transpose()?;
            slots.insert(
                name.clone(),
                SlotState {
                    m: be.to_host(&s.m)?,
                    v: be.to_host(&s.v)?,
                    master,
                },
            );
        }
        Ok(OptimizerState {
            step: self.step,
            slots,
        })
    }

    /// [`AdamW::state`], moved out rather than copied where the backend allows
    /// ([`Backend::take_host`]): for the end of a run. The optimizer is left without
    /// moments; a step after this would start them again from zero.
    pub fn take_state(&mut self, be: &B) -> Result<OptimizerState> {
        let mut slots = BTreeMap::new();
        for (name, s) in std::mem::take(&mut self.slots) {
            let master = s.master.map(|m| be.take_host(m)).transpose()?;
            slots.insert(
                name,
                SlotState {
                    m: be.take_host(s.m)?,
                    v: be.take_host(s.v)?,
                    master,
                },
            );
        }
        Ok(OptimizerState {
            step: self.step,
            slots,
        })
    }

    /// One part of parameter `name`'s state copied to the host, without copying the rest
    /// (`None`: it has not been stepped, or has no master copy).
    pub fn slot_part(&self, be: &B, name: &str, part: SlotPart) -> Result<Option<Vec<f32>>> {
        let Some(s) = self.slots.get(name) else {
            return Ok(None);
        };
        let buf = match part {
            SlotPart::M => Some(&s.m),
            SlotPart::V => Some(&s.v),
            SlotPart::Master => s.master.as_ref(),
        };
        Ok(buf.map(|b| be.to_host(b)).transpose()?)
    }

    /// Restores a state saved by [`AdamW::state`]; slot lengths must be consistent.
    pub fn load_state(&mut self, be: &B, state: &OptimizerState) -> Result<()> {
        let mut slots = BTreeMap::new();
        for (name, s) in &state.slots {
            let bad_master = s.master.as_ref().is_some_and(|m| m.len() != s.m.len());
            if s.m.len() != s.v.len() || bad_master {
                return Err(ModelError::OptimizerState(format!(
                    "`{name}`: moments and master weights differ in length"
                )));
            }
            let master = s
                .master
                .as_ref()
                .map(|m| be.from_host(m, DType::F32))
                .transpose()?;
            let m = be.from_host(&s.m, DType::F32)?;
            slots.insert(
                name.clone(),
                Slot {
                    m,
                    v: be.from_host(&s.v, DType::F32)?,
                    master,
                },
            );
        }
        self.slots = slots;
        self.step = state.step;
        Ok(())
    }
}
