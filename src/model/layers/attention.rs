//! Causal multi-head self-attention: `y = Attn(x·Wq, x·Wk, x·Wv)·Wo` (no biases).

use super::{Stash, activation, gradient, linear_bwd_input, linear_bwd_weight, linear_fwd};
use crate::model::{GptConfig, Param, Result, init};
use crate::tensor::{AttnShape, Backend};

struct Saved<B: Backend> {
    x: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    probs: B::Buf,
    o: B::Buf,
    shape: AttnShape,
}

/// What W needs: the layer input, the attention output, and the four gradients.
struct ForW<B: Backend> {
    x: B::Buf,
    o: B::Buf,
    dy: B::Buf,
    dq: B::Buf,
    dk: B::Buf,
    dv: B::Buf,
    rows: usize,
}

/// Causal self-attention with `heads` heads over `[batch, seq, d_model]` activations.
pub struct Attention<B: Backend> {
    pub wq: Param<B>,
    pub wk: Param<B>,
    pub wv: Param<B>,
    pub wo: Param<B>,
    heads: usize,
    fwd: Stash<Saved<B>>,
    for_w: Stash<ForW<B>>,
}

impl<B: Backend> Attention<B> {
    /// Weights `{name}.wq|wk|wv|wo`, each `[d_model, d_model]`.
    pub fn new(be: &B, name: &str, config: &GptConfig) -> Result<Self> {
        let d = config.d_model;
        let mk = |w: &str, std: f32| {
            let pname = format!("{name}.{w}");
            let values = init::normal(config.seed, &pname, d * d, std);
            Param::new(be, pname, vec![d, d], &values, true)
        };
        Ok(Attention {
            wq: mk("wq", init::INIT_STD)?,
            wk: mk("wk", init::INIT_STD)?,
            wv: mk("wv", init::INIT_STD)?,
            wo: mk("wo", init::residual_std(config))?,
            heads: config.heads,
            fwd: Stash::new(name),
            for_w: Stash::new(name),
        })
    }

    fn d(&self) -> usize {
        self.wq.shape[0]
    }

    /// `y = attn(x)` for `x: [batch·seq, d_model]`.
    pub fn forward(
        &mut self,
        be: &B,
        mb: usize,
        x: &B::Buf,
        batch: usize,
        seq: usize,
    ) -> Result<B::Buf> {
        let rows = batch * seq;
        let shape = AttnShape {
            batch,
            seq,
            heads: self.heads,
            head_dim: self.d() / self.heads,
        };
        let q = linear_fwd(be, x, &self.wq, rows)?;
        let k = linear_fwd(be, x, &self.wk, rows)?;
        let v = linear_fwd(be, x, &self.wv, rows)?;
        let mut o = activation(be, rows * self.d())?;
        let mut probs = activation(be, shape.probs_len())?;
        be.attention_fwd(&q, &k, &v, &mut o, &mut probs, shape)?;
        let y = linear_fwd(be, &o, &self.wo, rows)?;
        self.fwd.put(
            mb,
            Saved {
                x: be.dup(x)?,
                q,
                k,
                v,
                probs,
                o,
                shape,
            },
        );
        Ok(y)
    }

    /// I: `dx` from `dy`; keeps `x`, `o` and the projection gradients for W.
    pub fn backward_input(&mut self, be: &B, mb: usize, dy: &B::Buf) -> Result<B::Buf> {
        let s = self.fwd.take(mb, "backward_input", "forward")?;
        let rows = s.shape.batch * s.shape.seq;
        let n = rows * self.d();
        let mut d_o = gradient(be, n)?;
        linear_bwd_input(be, dy, &self.wo, &mut d_o, rows, false)?;
        let (mut dq, mut dk, mut dv) = (gradient(be, n)?, gradient(be, n)?, gradient(be, n)?);
        be.attention_bwd(
            &s.q, &s.k, &s.v, &s.probs, &d_o, &mut dq, &mut dk, &mut dv, s.shape,
        )?;
        let mut dx = gradient(be, n)?;
        linear_bwd_input(be, &dq, &self.wq, &mut dx, rows, false)?;
        linear_bwd_input(be, &dk, &self.wk, &mut dx, rows, true)?;
        linear_bwd_input(be, &dv, &self.wv, &mut dx, rows, true)?;
        let for_w = ForW {
            x: s.x,
            o: s.o,
            dy: be.dup(dy)?,
            dq,
            dk,
            dv,
            rows,
        };
        self.for_w.put(mb, for_w);
        Ok(dx)
    }

    /// W: accumulates the gradients of `wq`, `wk`, `wv`, `wo`.
    pub fn backward_weight(&mut self, be: &B, mb: usize) -> Result<()> {
        let s = self.for_w.take(mb, "backward_weight", "backward_input")?;
        linear_bwd_weight(be, &s.o, &s.dy, &mut self.wo, s.rows)?;
        linear_bwd_weight(be, &s.x, &s.dq, &mut self.wq, s.rows)?;
        linear_bwd_weight(be, &s.x, &s.dk, &mut self.wk, s.rows)?;
        linear_bwd_weight(be, &s.x, &s.dv, &mut self.wv, s.rows)?;
        Ok(())
    }

    pub fn discard(&mut self, mb: usize) {
        self.fwd.remove(mb);
        self.for_w.remove(mb);
    }

    pub fn stashed(&self) -> usize {
        self.fwd.len() + self.for_w.len()
    }

    pub fn params(&self) -> Vec<&Param<B>> {
        vec![&self.wq, &self.wk, &self.wv, &self.wo]
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param<B>> {
        vec![&mut self.wq, &mut self.wk, &mut self.wv, &mut self.wo]
    }
}
