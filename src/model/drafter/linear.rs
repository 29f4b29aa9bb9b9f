//! [`Linear`]: `y = x·W` without bias, with the split backward of the target's layers. The
//! drafter's `fc` is one: `[2·d_model, d_model]`, fusing the token embedding with the
//! target's hidden state.

use crate::model::layers::{Stash, gradient, linear_bwd_input, linear_bwd_weight, linear_fwd};
use crate::model::{Param, Result, init};
use crate::tensor::Backend;

struct Saved<B: Backend> {
    x: B::Buf,
    rows: usize,
}

/// `{name}.w: [d_in, d_out]`, initialised `N(0, 0.02²)` from (seed, name).
pub struct Linear<B: Backend> {
    pub w: Param<B>,
    stash: Stash<Saved<B>, (Saved<B>, B::Buf)>,
}

impl<B: Backend> Linear<B> {
    pub fn new(be: &B, name: &str, d_in: usize, d_out: usize, seed: u64) -> Result<Self> {
        let pname = format!("{name}.w");
        let values = init::normal(seed, &pname, d_in * d_out, init::INIT_STD);
        Ok(Linear {
            w: Param::new(be, pname, vec![d_in, d_out], &values, true)?,
            stash: Stash::new(name),
        })
    }

    /// `y = x·W` for `x: [rows, d_in]`; stashes `x` under `mb`.
    pub fn forward(&mut self, be: &B, mb: usize, x: &B::Buf, rows: usize) -> Result<B::Buf> {
        let y = linear_fwd(be, x, &self.w, rows)?;
        self.stash.keep_for_i(
            mb,
            Saved {
                x: be.dup(x)?,
                rows,
            },
        );
        Ok(y)
    }

    /// I: `dx = dy·Wᵀ` when `need_dx` (the drafter's fc skips it: its input is data, and
    /// computing it would be wasted work); keeps `dy` for W either way.
    pub fn backward_input(
        &mut self,
        be: &B,
        mb: usize,
        dy: &B::Buf,
        need_dx: bool,
    ) -> Result<Option<B::Buf>> {
        let s = self.stash.take_for_i(mb)?;
        let dx = if need_dx {
            let w = &self.w;
            Some(gradient(be, s.rows * w.shape[0], |dx| {
                linear_bwd_input(be, dy, w, dx, s.rows, false)
            })?)
        } else {
            None
        };
        self.stash.keep_for_w(mb, (s, be.dup(dy)?));
        Ok(dx)
    }

    /// W: `dW += xᵀ·dy`.
    pub fn backward_weight(&mut self, be: &B, mb: usize) -> Result<()> {
        let (s, dy) = self.stash.take_for_w(mb)?;
        linear_bwd_weight(be, &s.x, &dy, &mut self.w, s.rows)
    }

    pub fn discard(&mut self, mb: usize) {
        self.stash.discard(mb);
    }

    pub fn stashed(&self) -> usize {
        self.stash.len()
    }

    pub fn params(&self) -> Vec<&Param<B>> {
        vec![&self.w]
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param<B>> {
        vec![&mut self.w]
    }
}
