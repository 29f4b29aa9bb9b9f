//! One transformer block: `h = x + Attn(RMSNorm(x))`, `y = h + MLP(RMSNorm(h))`.
//!
//! The residual additions have no parameters; the block's I adds the skip gradients, its W
//! runs its four layers' W, and its parameters and stash are its layers', in order.

use super::{Attention, Held, Layer, Mlp, RmsNorm, activation};
use crate::model::{GptConfig, Param, Result, Shape};
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

    /// Its layers, in parameter order.
    fn layers(&self) -> [&dyn Layer<B>; 4] {
        [&self.norm1, &self.attn, &self.norm2, &self.mlp]
    }

    /// The attention branch: `h = x + Attn(RMSNorm(x))` and the MLP's input `RMSNorm(h)`.
    fn attend(&mut self, be: &B, mb: usize, x: &B::Buf, shape: Shape) -> Result<(B::Buf, B::Buf)> {
        let a = self.norm1.forward(be, mb, x, shape)?;
        let y = self.attn.forward(be, mb, &a, shape)?;
        let h = activation(be, be.len(x), |h| Ok(be.add(x, &y, h)?))?;
        let c = self.norm2.forward(be, mb, &h, shape)?;
        Ok((h, c))
    }

    fn layers_mut(&mut self) -> [&mut dyn Layer<B>; 4] {
        [
            &mut self.norm1,
            &mut self.attn,
            &mut self.norm2,
            &mut self.mlp,
        ]
    }
}

impl<B: Backend> Layer<B> for Block<B> {
    fn forward(&mut self, be: &B, mb: usize, x: &B::Buf, shape: Shape) -> Result<B::Buf> {
        let (h, c) = self.attend(be, mb, x, shape)?;
        let z = self.mlp.forward(be, mb, &c, shape)?;
        activation(be, be.len(x), |out| Ok(be.add(&h, &z, out)?))
    }

    /// The stash without the MLP's down projection and the last residual addition: the
    /// block's output is not needed again.
    fn refill(&mut self, be: &B, mb: usize, x: &B::Buf, shape: Shape) -> Result<()> {
        let (_, c) = self.attend(be, mb, x, shape)?;
        self.mlp.refill(be, mb, &c, shape)
    }

    /// I: `dx` from `dy` through both residual branches.
    fn backward_input(&mut self, be: &B, mb: usize, dy: &B::Buf) -> Result<B::Buf> {
        let dc = self.mlp.backward_input(be, mb, dy)?;
        let mut dh = self.norm2.backward_input(be, mb, &dc)?;
        be.axpy(1.0, dy, &mut dh)?;
        let da = self.attn.backward_input(be, mb, &dh)?;
        let mut dx = self.norm1.backward_input(be, mb, &da)?;
        be.axpy(1.0, &dh, &mut dx)?;
        Ok(dx)
    }

    /// W of the four layers, last first (as their I ran).
    fn backward_weight(&mut self, be: &B, mb: usize) -> Result<()> {
        self.layers_mut()
            .into_iter()
            .rev()
            .try_for_each(|l| l.backward_weight(be, mb))
    }

    fn discard(&mut self, mb: usize) {
        self.layers_mut().into_iter().for_each(|l| l.discard(mb));
    }

    fn stashed(&self) -> usize {
        self.layers().into_iter().map(|l| l.stashed()).sum()
    }

    fn held(&self, be: &B) -> Held {
        self.layers().into_iter().map(|l| l.held(be)).sum()
    }

    fn params(&self) -> Vec<&Param<B>> {
        self.layers().into_iter().flat_map(|l| l.params()).collect()
    }

    fn params_mut(&mut self) -> Vec<&mut Param<B>> {
        self.layers_mut()
            .into_iter()
            .flat_map(|l| l.params_mut())
            .collect()
    }
}
