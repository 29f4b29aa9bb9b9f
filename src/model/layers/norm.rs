//! RMSNorm with a learned gain: `y = x / rms(x) · g`.

use super::{Elems, Held, Layer, Stash, activation, gradient, keep};
use crate::model::{Param, Result, Shape};
use crate::tensor::{Backend, DType};

struct Saved<B: Backend> {
    x: B::Buf,
    rstd: B::Buf,
    rows: usize,
}

impl<B: Backend> Elems<B> for Saved<B> {
    fn elems(&self, be: &B) -> usize {
        be.len(&self.x) + be.len(&self.rstd)
    }
}

impl<B: Backend> Elems<B> for (Saved<B>, B::Buf) {
    fn elems(&self, be: &B) -> usize {
        self.0.elems(be) + be.len(&self.1)
    }
}

/// RMSNorm over the last dimension of `[rows, dim]` activations.
pub struct RmsNorm<B: Backend> {
    pub weight: Param<B>,
    eps: f32,
    /// W needs the forward's saved tensors and the output gradient.
    stash: Stash<Saved<B>, (Saved<B>, B::Buf)>,
}

impl<B: Backend> RmsNorm<B> {
    /// A norm named `name` (its gain is `{name}.weight`, initialised to 1).
    pub fn new(be: &B, name: &str, dim: usize, eps: f32) -> Result<Self> {
        let weight = Param::new(
            be,
            format!("{name}.weight"),
            vec![dim],
            &vec![1.0; dim],
            false,
        )?;
        Ok(RmsNorm {
            weight,
            eps,
            stash: Stash::new(name),
        })
    }

    fn dim(&self) -> usize {
        self.weight.shape[0]
    }
}

impl<B: Backend> Layer<B> for RmsNorm<B> {
    /// `y = rmsnorm(x)` for `x: [rows, dim]`.
    fn forward(&mut self, be: &B, mb: usize, x: &B::Buf, shape: Shape) -> Result<B::Buf> {
        let rows = shape.tokens();
        let dim = self.dim();
        let mut rstd = be.zeros(rows, DType::F32)?;
        let y = activation(be, rows * dim, |y| {
            let w = &self.weight.value;
            Ok(be.rmsnorm_fwd(x, w, y, &mut rstd, rows, dim, self.eps)?)
        })?;
        self.stash.keep_for_i(
            mb,
            Saved {
                x: be.dup(x)?,
                rstd,
                rows,
            },
        );
        Ok(y)
    }

    /// I: `dx` from `dy`.
    fn backward_input(&mut self, be: &B, mb: usize, dy: &B::Buf) -> Result<B::Buf> {
        let s = self.stash.take_for_i(mb)?;
        let dim = self.dim();
        let dx = gradient(be, s.rows * dim, |dx| {
            let w = &self.weight.value;
            Ok(be.rmsnorm_bwd_input(&s.x, w, &s.rstd, dy, dx, s.rows, dim)?)
        })?;
        self.stash.keep_for_w(mb, (s, keep(be, dy)?));
        Ok(dx)
    }

    /// W: accumulates the gain's gradient.
    fn backward_weight(&mut self, be: &B, mb: usize) -> Result<()> {
        let (s, dy) = self.stash.take_for_w(mb)?;
        let dim = self.dim();
        be.rmsnorm_bwd_weight(&s.x, &s.rstd, &dy, &mut self.weight.grad, s.rows, dim)?;
        Ok(())
    }

    /// Drops whatever is stashed for `mb`.
    fn discard(&mut self, mb: usize) {
        self.stash.discard(mb);
    }

    /// Micro-batches with something stashed.
    fn stashed(&self) -> usize {
        self.stash.len()
    }

    fn held(&self, be: &B) -> Held {
        self.stash.held(be)
    }

    fn params(&self) -> Vec<&Param<B>> {
        vec![&self.weight]
    }

    fn params_mut(&mut self) -> Vec<&mut Param<B>> {
        vec![&mut self.weight]
    }
}
