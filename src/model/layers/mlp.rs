//! The MLP: `y = act(x·W1)·W2` (no biases), hidden width [`GptConfig::mlp_hidden`]; with
//! `activation = "swiglu"` Llama's gated MLP `y = (silu(x·W1) ∘ (x·W3))·W2`, in Meta's names:
//! `W1` the gate, `W3` the up and `W2` the down projection.

use super::{
    Elems, Held, Layer, Stash, activation, gradient, keep, linear_bwd_input, linear_bwd_weight,
    linear_fwd, narrow,
};
use crate::model::{GptConfig, Param, Result, Shape, init};
use crate::tensor::{Activation, Backend};

struct Saved<B: Backend> {
    x: B::Buf,
    /// `x·W1`, before the activation.
    u: B::Buf,
    /// The input of `W2`: `act(u)`, or `silu(u) ∘ up` when gated.
    g: B::Buf,
    /// When gated: `silu(u)` and `up = x·W3`.
    gate: Option<(B::Buf, B::Buf)>,
    rows: usize,
}

/// What W needs: the inputs of both products and their output gradients.
struct ForW<B: Backend> {
    x: B::Buf,
    g: B::Buf,
    du: B::Buf,
    /// When gated, the gradient of `up = x·W3`.
    d_up: Option<B::Buf>,
    dy: B::Buf,
    rows: usize,
}

impl<B: Backend> Elems<B> for Saved<B> {
    fn elems(&self, be: &B) -> usize {
        let gate = self.gate.as_ref().map_or(0, |(a, u)| be.len(a) + be.len(u));
        be.len(&self.x) + be.len(&self.u) + be.len(&self.g) + gate
    }
}

impl<B: Backend> Elems<B> for ForW<B> {
    fn elems(&self, be: &B) -> usize {
        let up = self.d_up.as_ref().map_or(0, |b| be.len(b));
        be.len(&self.x) + be.len(&self.g) + be.len(&self.du) + be.len(&self.dy) + up
    }
}

/// Two-layer perceptron with a GELU or SiLU in between, or the gated SwiGLU.
pub struct Mlp<B: Backend> {
    pub w1: Param<B>,
    pub w2: Param<B>,
    /// The up projection `[d_model, hidden]` of the gated MLP.
    pub w3: Option<Param<B>>,
    act: Activation,
    stash: Stash<Saved<B>, ForW<B>>,
}

impl<B: Backend> Mlp<B> {
    /// Weights `{name}.w1: [d_model, hidden]` and `{name}.w2: [hidden, d_model]`, and when
    /// gated `{name}.w3: [d_model, hidden]`.
    pub fn new(be: &B, name: &str, config: &GptConfig) -> Result<Self> {
        let (d, h) = (config.d_model, config.mlp_hidden());
        let mk = |w: &str, shape: [usize; 2], std: f32| {
            let pname = format!("{name}.{w}");
            let values = init::normal(config.seed, &pname, shape[0] * shape[1], std);
            Param::new(be, pname, shape.to_vec(), &values, true)
        };
        Ok(Mlp {
            w1: mk("w1", [d, h], init::INIT_STD)?,
            w2: mk("w2", [h, d], init::residual_std(config))?,
            w3: if config.activation.is_gated() {
                Some(mk("w3", [d, h], init::INIT_STD)?)
            } else {
                None
            },
            act: config.activation,
            stash: Stash::new(name),
        })
    }
}

impl<B: Backend> Mlp<B> {
    /// What I needs of `x`: `x·W1`, the activation (gated: `silu(x·W1)` and `x·W3`), and
    /// `W2`'s input.
    fn hidden(&self, be: &B, x: &B::Buf, rows: usize) -> Result<Saved<B>> {
        let u = linear_fwd(be, x, &self.w1, rows)?;
        let mut g = activation(be, be.len(&u), |g| Ok(be.activation_fwd(self.act, &u, g)?))?;
        let mut gate = None;
        if let Some(w3) = &self.w3 {
            let up = linear_fwd(be, x, w3, rows)?;
            let h = activation(be, be.len(&u), |h| Ok(be.mul(&g, &up, h)?))?;
            gate = Some((std::mem::replace(&mut g, h), up));
        }
        Ok(Saved {
            x: be.dup(x)?,
            u,
            g,
            gate,
            rows,
        })
    }
}

impl<B: Backend> Layer<B> for Mlp<B> {
    /// `y = mlp(x)` for `x: [rows, d_model]`.
    fn forward(&mut self, be: &B, mb: usize, x: &B::Buf, shape: Shape) -> Result<B::Buf> {
        let saved = self.hidden(be, x, shape.tokens())?;
        let y = linear_fwd(be, &saved.g, &self.w2, saved.rows)?;
        self.stash.keep_for_i(mb, saved);
        Ok(y)
    }

    /// The stash without the down projection `g·W2`, whose output I does not read: a
    /// third (gated) or half of the MLP's multiply-adds not run again.
    fn refill(&mut self, be: &B, mb: usize, x: &B::Buf, shape: Shape) -> Result<()> {
        let saved = self.hidden(be, x, shape.tokens())?;
        self.stash.keep_for_i(mb, saved);
        Ok(())
    }

    /// I: `dx` from `dy`.
    fn backward_input(&mut self, be: &B, mb: usize, dy: &B::Buf) -> Result<B::Buf> {
        let s = self.stash.take_for_i(mb)?;
        let (d, h) = (self.w1.shape[0], self.w1.shape[1]);
        let rows = s.rows;
        let mut dg = gradient(be, rows * h, |dg| {
            linear_bwd_input(be, dy, &self.w2, dg, rows, false)
        })?;
        let mut d_up = None;
        if let Some((act, up)) = &s.gate {
            let du3 = gradient(be, rows * h, |du3| Ok(be.mul(&dg, act, du3)?))?;
            dg = gradient(be, rows * h, |d_act| Ok(be.mul(&dg, up, d_act)?))?;
            d_up = Some(du3);
        }
        let du = gradient(be, rows * h, |du| {
            Ok(be.activation_bwd(self.act, &s.u, &dg, du)?)
        })?;
        let dx = gradient(be, rows * d, |dx| {
            linear_bwd_input(be, &du, &self.w1, dx, rows, false)?;
            if let (Some(w3), Some(du3)) = (&self.w3, &d_up) {
                linear_bwd_input(be, du3, w3, dx, rows, true)?;
            }
            Ok(())
        })?;
        let for_w = ForW {
            x: s.x,
            g: s.g,
            du: narrow(be, du)?,
            d_up: d_up.map(|g| narrow(be, g)).transpose()?,
            dy: keep(be, dy)?,
            rows: s.rows,
        };
        self.stash.keep_for_w(mb, for_w);
        Ok(dx)
    }

    /// W: accumulates the gradients of `w1` and `w2` (and `w3`).
    fn backward_weight(&mut self, be: &B, mb: usize) -> Result<()> {
        let s = self.stash.take_for_w(mb)?;
        linear_bwd_weight(be, &s.g, &s.dy, &mut self.w2, s.rows)?;
        linear_bwd_weight(be, &s.x, &s.du, &mut self.w1, s.rows)?;
        if let (Some(w3), Some(du3)) = (&mut self.w3, &s.d_up) {
            linear_bwd_weight(be, &s.x, du3, w3, s.rows)?;
        }
        Ok(())
    }

    fn discard(&mut self, mb: usize) {
        self.stash.discard(mb);
    }

    fn stashed(&self) -> usize {
        self.stash.len()
    }

    fn held(&self, be: &B) -> Held {
        self.stash.held(be)
    }

    /// `w1, w2`, then `w3` when gated.
    fn params(&self) -> Vec<&Param<B>> {
        let mut v = vec![&self.w1, &self.w2];
        v.extend(self.w3.as_ref());
        v
    }

    fn params_mut(&mut self) -> Vec<&mut Param<B>> {
        let mut v = vec![&mut self.w1, &mut self.w2];
        v.extend(self.w3.as_mut());
        v
    }
}
