//! The GPT's layers. Each has three calls, per micro-batch `mb`:
//! - `forward`: the output, stashing what the backward needs under `mb` (`refill`: the
//!   stash alone, for full recomputation);
//! - `backward_input` (the I action): the gradient w.r.t. the layer's input. It computes no
//!   weight gradient; it drops what only I needed and keeps what W needs;
//! - `backward_weight` (the W action): accumulates the weight gradients into the parameters'
//!   `grad` and frees the micro-batch's stash.
//!
//! A full backward (B) is I then W. Calling I before F, or W before I, is a
//! [`ModelError::Order`] error, never a panic. Activations, and the gradients I keeps for W
//! (`keep`), are stored in the backend's storage type (bf16 under `train.precision =
//! "bf16"`); the gradients a backward computes and passes on, and the weight gradients, in
//! `f32`.
//!
//! The layers of the residual stream (`[rows, d_model]` in and out: [`RmsNorm`],
//! [`Attention`], [`Mlp`], and the [`Block`] composed of them) are a [`Layer`]; a composite
//! walks its parts for the parameters and the stash. The embedding and the head take ids and
//! targets, and keep calls of their own.

mod attention;
mod block;
mod embedding;
mod head;
#[cfg(test)]
mod head_tests;
mod mlp;
mod norm;
#[cfg(test)]
mod tests;

use crate::model::ModelError;
pub use attention::Attention;
pub use block::Block;
pub use embedding::Embedding;
pub use head::{Head, OffsetTokenLoss, TokenLoss, chunk_rows, initial_values, log_prob};
pub use mlp::Mlp;
pub use norm::RmsNorm;

use std::collections::HashMap;

use super::{Param, Result, Shape};
use crate::tensor::{Backend, DType, Gemm};

/// A layer of the residual stream: `[rows, d_model]` in and out, the rows `shape.batch`
/// sequences of `shape.seq` positions, its backward split into I and W (module docs).
pub trait Layer<B: Backend> {
    /// F: the output, stashing what the backward needs under `mb`.
    fn forward(&mut self, be: &B, mb: usize, x: &B::Buf, shape: Shape) -> Result<B::Buf>;
    /// F again before I, under full recomputation ([`crate::model::recompute`]): stashes
    /// what I needs, as `forward` does. The output is not returned, since I's gradient comes
    /// from above, so a layer may skip what computes only the output.
    fn refill(&mut self, be: &B, mb: usize, x: &B::Buf, shape: Shape) -> Result<()> {
        self.forward(be, mb, x, shape).map(drop)
    }
    /// I: the input gradient; keeps what W needs.
    fn backward_input(&mut self, be: &B, mb: usize, dy: &B::Buf) -> Result<B::Buf>;
    /// W: accumulates the weight gradients and frees `mb`'s stash.
    fn backward_weight(&mut self, be: &B, mb: usize) -> Result<()>;
    /// The parameters, in name order.
    fn params(&self) -> Vec<&Param<B>>;
    fn params_mut(&mut self) -> Vec<&mut Param<B>>;
    /// Drops whatever micro-batch `mb` left stashed.
    fn discard(&mut self, mb: usize);
    /// Micro-batches with something stashed (summed over a composite's parts).
    fn stashed(&self) -> usize;
    /// Activation and gradient elements stashed, for I and for W (summed over a
    /// composite's parts): what recomputation changes, measured.
    fn held(&self, be: &B) -> Held;
}

/// Elements a layer holds in its stash: from F for I, and from I for W.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub for_i: usize,
    pub for_w: usize,
}

impl std::ops::Add for Held {
    type Output = Held;
    fn add(self, o: Held) -> Held {
        Held {
            for_i: self.for_i + o.for_i,
            for_w: self.for_w + o.for_w,
        }
    }
}

impl std::iter::Sum for Held {
    fn sum<I: Iterator<Item = Held>>(it: I) -> Held {
        it.fold(Held::default(), |a, b| a + b)
    }
}

/// A stash entry's element count: the lengths of the buffers it holds.
pub(crate) trait Elems<B: Backend> {
    fn elems(&self, be: &B) -> usize;
}

/// Per-micro-batch storage of one layer's split backward: what F leaves for I (`F`), then
/// what I leaves for W (`W`). Taking what is not there is the layer's [`ModelError::Order`]
/// error, so every layer reports a call out of order alike.
pub(crate) struct Stash<F, W> {
    layer: String,
    for_i: HashMap<usize, F>,
    for_w: HashMap<usize, W>,
}

impl<F, W> Stash<F, W> {
    pub(crate) fn new(layer: &str) -> Self {
        Stash {
            layer: layer.to_string(),
            for_i: HashMap::new(),
            for_w: HashMap::new(),
        }
    }

    /// F: keeps what I of `mb` needs.
    pub(crate) fn keep_for_i(&mut self, mb: usize, item: F) {
        self.for_i.insert(mb, item);
    }

    /// I: takes what F of `mb` kept.
    pub(crate) fn take_for_i(&mut self, mb: usize) -> Result<F> {
        let item = self.for_i.remove(&mb);
        item.ok_or_else(|| self.order(mb, "backward_input", "forward"))
    }

    /// I: keeps what W of `mb` needs.
    pub(crate) fn keep_for_w(&mut self, mb: usize, item: W) {
        self.for_w.insert(mb, item);
    }

    /// W: takes what I of `mb` kept.
    pub(crate) fn take_for_w(&mut self, mb: usize) -> Result<W> {
        let item = self.for_w.remove(&mb);
        item.ok_or_else(|| self.order(mb, "backward_weight", "backward_input"))
    }

    fn order(&self, mb: usize, action: &'static str, missing: &'static str) -> ModelError {
        ModelError::Order {
            layer: self.layer.clone(),
            action,
            mb,
            missing,
        }
    }

    /// Drops whatever `mb` left, for I or for W.
    pub(crate) fn discard(&mut self, mb: usize) {
        self.for_i.remove(&mb);
        self.for_w.remove(&mb);
    }

    /// Entries kept, for I and for W together.
    pub(crate) fn len(&self) -> usize {
        self.for_i.len() + self.for_w.len()
    }

    /// Elements kept, for I and for W.
    pub(crate) fn held<B: Backend>(&self, be: &B) -> Held
    where
        F: Elems<B>,
        W: Elems<B>,
    {
        Held {
            for_i: self.for_i.values().map(|e| e.elems(be)).sum(),
            for_w: self.for_w.values().map(|e| e.elems(be)).sum(),
        }
    }
}

/// A new activation of `len` elements in the backend's storage type, written whole by
/// `write`: not zeroed first ([`Backend::uninit`]). `write` must overwrite every element
/// (its first operation on the buffer overwrites rather than accumulates), as the poisoned
/// backend's tests check for every layer.
pub(crate) fn activation<B: Backend>(
    be: &B,
    len: usize,
    write: impl FnOnce(&mut B::Buf) -> Result<()>,
) -> Result<B::Buf> {
    let [out] = activations(be, [len], |[out]| write(out))?;
    Ok(out)
}

/// As [`activation`], several buffers one operation writes (attention's output and
/// probabilities).
pub(crate) fn activations<B: Backend, const N: usize>(
    be: &B,
    lens: [usize; N],
    write: impl FnOnce(&mut [B::Buf; N]) -> Result<()>,
) -> Result<[B::Buf; N]> {
    written(be, lens, be.storage_dtype(), write)
}

/// As [`activation`], a gradient (`f32`).
pub(crate) fn gradient<B: Backend>(
    be: &B,
    len: usize,
    write: impl FnOnce(&mut B::Buf) -> Result<()>,
) -> Result<B::Buf> {
    let [out] = gradients(be, [len], |[out]| write(out))?;
    Ok(out)
}

/// As [`activations`], gradients (`f32`).
pub(crate) fn gradients<B: Backend, const N: usize>(
    be: &B,
    lens: [usize; N],
    write: impl FnOnce(&mut [B::Buf; N]) -> Result<()>,
) -> Result<[B::Buf; N]> {
    written(be, lens, DType::F32, write)
}

fn written<B: Backend, const N: usize>(
    be: &B,
    lens: [usize; N],
    dtype: DType,
    write: impl FnOnce(&mut [B::Buf; N]) -> Result<()>,
) -> Result<[B::Buf; N]> {
    let mut made = Vec::with_capacity(N);
    for len in lens {
        // SAFETY: `write` overwrites every element (the callers' contract, above) before the
        // buffers leave here; if it fails, they are dropped unread.
        made.push(unsafe { be.uninit(len, dtype)? });
    }
    let Ok(mut out) = <[B::Buf; N]>::try_from(made) else {
        unreachable!("one buffer for each of the N lengths")
    };
    write(&mut out)?;
    Ok(out)
}

/// A copy of gradient `g` that I keeps for W, in the backend's storage type: the backward's
/// stash is bf16 in a bf16 run as the forward's is (W's products still accumulate in f32,
/// into the f32 weight gradients); in f32 it is [`Backend::dup`].
pub(crate) fn keep<B: Backend>(be: &B, g: &B::Buf) -> Result<B::Buf> {
    activation(be, be.len(g), |out| Ok(be.copy(g, out)?))
}

/// Gradient `g`, which I has finished with, kept for W as [`keep`] keeps a copy.
pub(crate) fn narrow<B: Backend>(be: &B, g: B::Buf) -> Result<B::Buf> {
    match be.dtype(&g) == be.storage_dtype() {
        true => Ok(g),
        false => keep(be, &g),
    }
}

/// `y = x·W` with `x: [rows, in]`, `W: [in, out]`.
pub(crate) fn linear_fwd<B: Backend>(
    be: &B,
    x: &B::Buf,
    w: &Param<B>,
    rows: usize,
) -> Result<B::Buf> {
    let (din, dout) = (w.shape[0], w.shape[1]);
    activation(be, rows * dout, |y| {
        Ok(be.matmul(x, &w.value, y, Gemm::nn(rows, din, dout))?)
    })
}

/// `dx (+)= dy·Wᵀ`: the input gradient of [`linear_fwd`].
pub(crate) fn linear_bwd_input<B: Backend>(
    be: &B,
    dy: &B::Buf,
    w: &Param<B>,
    dx: &mut B::Buf,
    rows: usize,
    accumulate: bool,
) -> Result<()> {
    let (din, dout) = (w.shape[0], w.shape[1]);
    let mut g = Gemm::nn(rows, dout, din).trans_b();
    g.accumulate = accumulate;
    be.matmul(dy, &w.value, dx, g)?;
    Ok(())
}

/// `dW += xᵀ·dy`: the weight gradient of [`linear_fwd`].
pub(crate) fn linear_bwd_weight<B: Backend>(
    be: &B,
    x: &B::Buf,
    dy: &B::Buf,
    w: &mut Param<B>,
    rows: usize,
) -> Result<()> {
    let (din, dout) = (w.shape[0], w.shape[1]);
    be.matmul(
        x,
        dy,
        &mut w.grad,
        Gemm::nn(din, rows, dout).trans_a().accumulate(),
    )?;
    Ok(())
}
