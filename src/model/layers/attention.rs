//! Causal multi-head self-attention: `y = Attn(x·Wq, x·Wk, x·Wv)·Wo`, with the Llama-family
//! options of [`GptConfig`]: biases on `q`, `k`, `v` (`qkv_bias`), rotary positions on `q` and
//! `k` (`positions = "rope"`), and grouped-query attention (`kv_heads < heads`: `Wk`, `Wv` are
//! `[d_model, kv_heads·head_dim]`, each key/value head read by `heads / kv_heads` query heads).
//!
//! The attention kernel sees `heads` full heads: the shared key/value heads are repeated
//! before it ([`Backend::repeat_kv`]) and their gradients summed after it, RoPE is applied to
//! the projections (plus bias) and its transpose to their gradients, so I yields the
//! gradients of the projections' outputs and W only multiplies them by the saved input.

use super::{
    Elems, Held, Layer, Stash, activation, activations, gradient, gradients, keep,
    linear_bwd_input, linear_bwd_weight, linear_fwd, narrow,
};
use crate::model::config::Positions;
use crate::model::{GptConfig, Param, Result, Shape, init};
use crate::tensor::{AttnShape, Backend};

struct Saved<B: Backend> {
    x: B::Buf,
    /// The attention kernel's operands: rotated, and `k`, `v` repeated to `heads`.
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    /// The kernel's probabilities and output; `None` when I recomputes them
    /// ([`Attention::set_recompute_core`]).
    core: Option<(B::Buf, B::Buf)>,
    shape: AttnShape,
}

/// What W needs: the layer input, the attention output, and the gradients of the four
/// projections' outputs (`dk`, `dv` at `kv_heads` width).
struct ForW<B: Backend> {
    x: B::Buf,
    o: B::Buf,
    dy: B::Buf,
    dq: B::Buf,
    dk: B::Buf,
    dv: B::Buf,
    rows: usize,
}

impl<B: Backend> Elems<B> for Saved<B> {
    fn elems(&self, be: &B) -> usize {
        let core = self.core.as_ref().map_or(0, |(o, p)| be.len(o) + be.len(p));
        [&self.x, &self.q, &self.k, &self.v]
            .map(|b| be.len(b))
            .iter()
            .sum::<usize>()
            + core
    }
}

impl<B: Backend> Elems<B> for ForW<B> {
    fn elems(&self, be: &B) -> usize {
        [&self.x, &self.o, &self.dy, &self.dq, &self.dk, &self.dv]
            .map(|b| be.len(b))
            .iter()
            .sum()
    }
}

/// Causal self-attention with `heads` heads over `[batch, seq, d_model]` activations.
pub struct Attention<B: Backend> {
    pub wq: Param<B>,
    pub wk: Param<B>,
    pub wv: Param<B>,
    pub wo: Param<B>,
    /// `bq: [d_model]`, `bk`, `bv: [kv_heads·head_dim]` when `qkv_bias`.
    pub bias: Option<[Param<B>; 3]>,
    heads: usize,
    kv_heads: usize,
    /// The RoPE frequencies ([`GptConfig::rope_inv_freq`]), when positions are rotary.
    rope: Option<Vec<f32>>,
    /// Selective recomputation: F drops the kernel's probabilities and output, I runs the
    /// kernel again from `q`, `k`, `v` ([`crate::model::Recompute::Selective`]).
    recompute_core: bool,
    stash: Stash<Saved<B>, ForW<B>>,
}

impl<B: Backend> Attention<B> {
    /// Weights `{name}.wq|wo: [d_model, d_model]`, `{name}.wk|wv: [d_model, kv_dim]`, and
    /// with `qkv_bias` the biases `{name}.bq|bk|bv` (initialised to zero, not decayed).
    pub fn new(be: &B, name: &str, config: &GptConfig) -> Result<Self> {
        let (d, kv) = (config.d_model, config.kv_dim());
        let mk = |w: &str, cols: usize, std: f32| {
            let pname = format!("{name}.{w}");
            let values = init::normal(config.seed, &pname, d * cols, std);
            Param::new(be, pname, vec![d, cols], &values, true)
        };
        let bias = |w: &str, len: usize| {
            Param::new(be, format!("{name}.{w}"), vec![len], &vec![0.0; len], false)
        };
        let bias = if config.qkv_bias {
            Some([bias("bq", d)?, bias("bk", kv)?, bias("bv", kv)?])
        } else {
            None
        };
        Ok(Attention {
            wq: mk("wq", d, init::INIT_STD)?,
            wk: mk("wk", kv, init::INIT_STD)?,
            wv: mk("wv", kv, init::INIT_STD)?,
            wo: mk("wo", d, init::residual_std(config))?,
            bias,
            heads: config.heads,
            kv_heads: config.kv_heads(),
            rope: (config.positions == Positions::Rope).then(|| config.rope_inv_freq()),
            recompute_core: false,
            stash: Stash::new(name),
        })
    }

    /// Whether F keeps the attention kernel's probabilities and output (`false`) or I
    /// recomputes them from `q`, `k`, `v` (`true`); either gives bitwise the same gradients.
    pub fn set_recompute_core(&mut self, recompute: bool) {
        self.recompute_core = recompute;
    }

    fn d(&self) -> usize {
        self.wq.shape[0]
    }

    /// The kernel's output and probabilities for `q`, `k`, `v`.
    fn core(
        &self,
        be: &B,
        q: &B::Buf,
        k: &B::Buf,
        v: &B::Buf,
        shape: AttnShape,
    ) -> Result<(B::Buf, B::Buf)> {
        let rows = shape.batch * shape.seq;
        let [o, probs] = activations(be, [rows * self.d(), shape.probs_len()], |[o, p]| {
            Ok(be.attention_fwd(q, k, v, o, p, shape)?)
        })?;
        Ok((o, probs))
    }

    fn head_dim(&self) -> usize {
        self.d() / self.heads
    }

    /// Query heads per key/value head.
    fn rep(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// The position of every row: `t` for row `b·seq + t`.
    fn positions(batch: usize, seq: usize) -> Vec<u32> {
        (0..batch * seq).map(|r| (r % seq) as u32).collect()
    }

    /// `x·W (+ b)`, then rotated when positions are rotary (`heads` of the output's width).
    fn project(
        &self,
        be: &B,
        x: &B::Buf,
        w: &Param<B>,
        b: Option<&Param<B>>,
        rotate: Option<&[u32]>,
        rows: usize,
    ) -> Result<B::Buf> {
        let mut y = linear_fwd(be, x, w, rows)?;
        if let Some(b) = b {
            be.add_broadcast_rows(&b.value, &mut y, rows, w.shape[1])?;
        }
        match (&self.rope, rotate) {
            (Some(freq), Some(pos)) => {
                let hd = self.head_dim();
                activation(be, be.len(&y), |r| {
                    Ok(be.rope(&y, r, pos, w.shape[1] / hd, hd, freq, false)?)
                })
            }
            _ => Ok(y),
        }
    }

    /// `k` or `v` at `kv_heads` width repeated to `heads` (itself without sharing).
    fn repeat(&self, be: &B, x: B::Buf, rows: usize) -> Result<B::Buf> {
        if self.rep() == 1 {
            return Ok(x);
        }
        let (kv_heads, rep, hd) = (self.kv_heads, self.rep(), self.head_dim());
        activation(be, rows * self.d(), |out| {
            Ok(be.repeat_kv(&x, out, rows, kv_heads, rep, hd)?)
        })
    }

    /// The gradient of a `heads`-wide `dk` or `dv` at `kv_heads` width, un-rotated when
    /// `rotate` (the transpose of [`Attention::project`]'s rotation).
    fn unshare(
        &self,
        be: &B,
        g: B::Buf,
        rotate: Option<&[u32]>,
        rows: usize,
        width: usize,
    ) -> Result<B::Buf> {
        let hd = self.head_dim();
        let g = if width == self.d() {
            g
        } else {
            let (kv_heads, rep) = (self.kv_heads, self.rep());
            gradient(be, rows * width, |out| {
                Ok(be.repeat_kv_bwd(&g, out, rows, kv_heads, rep, hd)?)
            })?
        };
        match (&self.rope, rotate) {
            (Some(freq), Some(pos)) => gradient(be, rows * width, |out| {
                Ok(be.rope(&g, out, pos, width / hd, hd, freq, true)?)
            }),
            _ => Ok(g),
        }
    }
}

impl<B: Backend> Layer<B> for Attention<B> {
    /// `y = attn(x)` for `x: [batch·seq, d_model]`.
    fn forward(&mut self, be: &B, mb: usize, x: &B::Buf, s: Shape) -> Result<B::Buf> {
        let (Shape { batch, seq }, rows) = (s, s.tokens());
        let shape = AttnShape {
            batch,
            seq,
            heads: self.heads,
            head_dim: self.head_dim(),
        };
        let pos = self.rope.as_ref().map(|_| Self::positions(batch, seq));
        let pos = pos.as_deref();
        let b = self.bias.as_ref();
        let q = self.project(be, x, &self.wq, b.map(|b| &b[0]), pos, rows)?;
        let k = self.project(be, x, &self.wk, b.map(|b| &b[1]), pos, rows)?;
        let v = self.project(be, x, &self.wv, b.map(|b| &b[2]), None, rows)?;
        let (k, v) = (self.repeat(be, k, rows)?, self.repeat(be, v, rows)?);
        let (o, probs) = self.core(be, &q, &k, &v, shape)?;
        let y = linear_fwd(be, &o, &self.wo, rows)?;
        let core = (!self.recompute_core).then_some((o, probs));
        self.stash.keep_for_i(
            mb,
            Saved {
                x: be.dup(x)?,
                q,
                k,
                v,
                core,
                shape,
            },
        );
        Ok(y)
    }

    /// I: `dx` from `dy`; keeps `x`, `o` and the projection gradients for W.
    fn backward_input(&mut self, be: &B, mb: usize, dy: &B::Buf) -> Result<B::Buf> {
        let s = self.stash.take_for_i(mb)?;
        let rows = s.shape.batch * s.shape.seq;
        let n = rows * self.d();
        let (o, probs) = match s.core {
            Some(core) => core,
            None => self.core(be, &s.q, &s.k, &s.v, s.shape)?,
        };
        let d_o = gradient(be, n, |d_o| {
            linear_bwd_input(be, dy, &self.wo, d_o, rows, false)
        })?;
        let [dq, dk, dv] = gradients(be, [n; 3], |[dq, dk, dv]| {
            let (q, k, v) = (&s.q, &s.k, &s.v);
            Ok(be.attention_bwd(q, k, v, &probs, &d_o, dq, dk, dv, s.shape)?)
        })?;
        drop(probs);
        let pos = self
            .rope
            .as_ref()
            .map(|_| Self::positions(s.shape.batch, s.shape.seq));
        let pos = pos.as_deref();
        let kv = self.wk.shape[1];
        let dq = self.unshare(be, dq, pos, rows, self.d())?;
        let dk = self.unshare(be, dk, pos, rows, kv)?;
        let dv = self.unshare(be, dv, None, rows, kv)?;
        let dx = gradient(be, n, |dx| {
            linear_bwd_input(be, &dq, &self.wq, dx, rows, false)?;
            linear_bwd_input(be, &dk, &self.wk, dx, rows, true)?;
            linear_bwd_input(be, &dv, &self.wv, dx, rows, true)
        })?;
        let for_w = ForW {
            x: s.x,
            o,
            dy: keep(be, dy)?,
            dq: narrow(be, dq)?,
            dk: narrow(be, dk)?,
            dv: narrow(be, dv)?,
            rows,
        };
        self.stash.keep_for_w(mb, for_w);
        Ok(dx)
    }

    /// W: accumulates the gradients of `wq`, `wk`, `wv`, `wo` (and of the biases).
    fn backward_weight(&mut self, be: &B, mb: usize) -> Result<()> {
        let s = self.stash.take_for_w(mb)?;
        linear_bwd_weight(be, &s.o, &s.dy, &mut self.wo, s.rows)?;
        linear_bwd_weight(be, &s.x, &s.dq, &mut self.wq, s.rows)?;
        linear_bwd_weight(be, &s.x, &s.dk, &mut self.wk, s.rows)?;
        linear_bwd_weight(be, &s.x, &s.dv, &mut self.wv, s.rows)?;
        if let Some([bq, bk, bv]) = &mut self.bias {
            for (b, g) in [(bq, &s.dq), (bk, &s.dk), (bv, &s.dv)] {
                let width = b.numel();
                be.sum_rows(g, &mut b.grad, s.rows, width)?;
            }
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

    /// `wq, wk, wv, wo`, then `bq, bk, bv` when there are biases.
    fn params(&self) -> Vec<&Param<B>> {
        let mut v = vec![&self.wq, &self.wk, &self.wv, &self.wo];
        v.extend(self.bias.iter().flatten());
        v
    }

    fn params_mut(&mut self) -> Vec<&mut Param<B>> {
        let mut v = vec![&mut self.wq, &mut self.wk, &mut self.wv, &mut self.wo];
        v.extend(self.bias.iter_mut().flatten());
        v
    }
}
