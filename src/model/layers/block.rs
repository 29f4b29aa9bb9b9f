//! One transformer block: `h = x + Attn(RMSNorm(x))`, `y = h + MLP(RMSNorm(h))`.
//!
//! The residual additions have no parameters; the block's I adds the skip gradients, its W
//! runs its four layers' W.

use super::{Attention, Mlp, RmsNorm, activation};
use crate::model::{GptConfig, Param, Result};
use crate::tensor::Backend;

/// Block `i`, with parameters named `blocks.{i}.{norm1,attn,norm2,mlp}.…`.
pub struct Block<B: Backend> {
    pub norm1: RmsNorm<B>,
    pub attn: Attention<B>,
    pub norm2: RmsNorm<B>,
    pub mlp: Mlp<B>,
}

impl<B: Backend> Block<B> {
    pub fn new(be: &B, index: usize, config: &GptConfig) -> Result<Self> {
        let p = format!("blocks.{index}");
        Ok(Block {
            norm1: RmsNorm::new(be, &format!("{p}.norm1"), config.d_model, config.norm_eps)?,
            attn: Attention::new(be, &format!("{p}.attn"), config)?,
            norm2: RmsNorm::new(be, &format!("{p}.norm2"), config.d_model, config.norm_eps)?,
            mlp: Mlp::new(be, &format!("{p}.mlp"), config)?,
        })
    }

    /// `x: [batch·seq, d_model]` → same shape.
    pub fn forward(
        &mut self,
        be: &B,
        mb: usize,
        x: &B::Buf,
        batch: usize,
        seq: usize,
    ) -> Result<B::Buf> {
        let rows = batch * seq;
        let a = self.norm1.forward(be, mb, x, rows)?;
        let y = self.attn.forward(be, mb, &a, batch, seq)?;
        let mut h = activation(be, be.len(x))?;
        be.add(x, &y, &mut h)?;
        let c = self.norm2.forward(be, mb, &h, rows)?;
        let z = self.mlp.forward(be, mb, &c, rows)?;
        let mut out = activation(be, be.len(x))?;
        be.add(&h, &z, &mut out)?;
        Ok(out)
    }

    /// I: `dx` from `dy` through both residual branches.
    pub fn backward_input(&mut self, be: &B, mb: usize, dy: &B::Buf) -> Result<B::Buf> {
        let dc = self.mlp.backward_input(be, mb, dy)?;
        let mut dh = self.norm2.backward_input(be, mb, &dc)?;
        be.axpy(1.0, dy, &mut dh)?;
        let da = self.attn.backward_input(be, mb, &dh)?;
        let mut dx = self.norm1.backward_input(be, mb, &da)?;
        be.axpy(1.0, &dh, &mut dx)?;
        Ok(dx)
    }

    /// W of the four layers.
    pub fn backward_weight(&mut self, be: &B, mb: usize) -> Result<()> {
        self.mlp.backward_weight(be, mb)?;
        self.norm2.backward_weight(be, mb)?;
        self.attn.backward_weight(be, mb)?;
        self.norm1.backward_weight(be, mb)
    }

    pub fn discard(&mut self, mb: usize) {
        self.norm1.discard(mb);
        self.attn.discard(mb);
        self.norm2.discard(mb);
        self.mlp.discard(mb);
    }

    pub fn stashed(&self) -> usize {
        self.norm1.stashed() + self.attn.stashed() + self.norm2.stashed() + self.mlp.stashed()
    }

    pub fn params(&self) -> Vec<&Param<B>> {
        let mut v = self.norm1.params();
        v.extend(self.attn.params());
        v.extend(self.norm2.params());
        v.extend(self.mlp.params());
        v
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param<B>> {
        let mut v = self.norm1.params_mut();
        v.extend(self.attn.params_mut());
        v.extend(self.norm2.params_mut());
        v.extend(self.mlp.params_mut());
        v
    }
}
