//! The host path of [`InferStage`]: where the backend's buffers are host `f32` anyway
//! ([`streams_host_weights`](crate::model::infer::rowmul::streams_host_weights)) and a call
//! has at most [`ROWMUL_MAX_ROWS`] rows, its blocks run on plain slices: [`rowmul`] for
//! the products, the CPU backend's own kernels for the norms and the activation, and the
//! activations never pass through a backend buffer. The backend path copied every
//! product's input out of a buffer and its output into one (nine copies a block, plus a
//! zeroed buffer per op), a cost that grows with the rows (docs/benchmarks.md, "Smaller
//! figures behind design choices"). The same functions run in the same order on each
//! row, so the values are bitwise those of the backend path.

use super::{InferStage, RowLayout, Span, StageOutput};
use crate::model::Result;
use crate::model::infer::denormals::Flushed;
use crate::model::infer::rowmul::{Packed, ROWMUL_MAX_ROWS, rowmul};
use crate::tensor::Backend;
use crate::tensor::cpu::kernels;

/// Host copies of a block's parameters.
pub(super) struct HostBlock {
    pub norm1: Vec<f32>,
    pub norm2: Vec<f32>,
    /// `[wqkv, wo, w1, w2]`, packed for [`rowmul`]; with the gated MLP the third is
    /// `[w1 | w3]`, gate and up side by side.
    pub w: [Packed; 4],
}

/// Host copies of the final norm and the LM head.
pub(super) struct HostHead {
    pub norm: Vec<f32>,
    pub w: Packed,
}

/// `x + y`, elementwise (the CPU backend's `add`).
fn add(x: &[f32], y: &[f32]) -> Vec<f32> {
    x.iter().zip(y).map(|(a, b)| a + b).collect()
}

impl<B: Backend> InferStage<B> {
    /// Whether a call of `rows` rows takes the host path.
    pub(super) fn host_path(&self, rows: usize) -> bool {
        let host = match self.blocks.first() {
            Some(b) => b.host.is_some(),
            None => self.head_host.is_some(),
        };
        host && rows <= ROWMUL_MAX_ROWS
    }

    /// RMSNorm of each `d`-wide row of `x` with weight `w`.
    fn rmsnorm_host(&self, x: &[f32], w: &[f32]) -> Vec<f32> {
        let rows = x.len() / self.config.d_model;
        let (mut y, mut rstd) = (vec![0.0f32; x.len()], vec![0.0f32; rows]);
        kernels::rmsnorm_fwd(false, x, w, &mut y, &mut rstd, self.config.norm_eps);
        y
    }

    /// The blocks and the head (last stage) of [`InferStage::forward_with`] on the host,
    /// from the stage's input `x` (`[rows, d]`), the caches already rolled back.
    pub(super) fn forward_host(
        &mut self,
        spans: &[Span],
        layouts: &[Option<RowLayout>],
        x: &[f32],
        rows: usize,
    ) -> Result<StageOutput<B>> {
        // The norms and activations between the products too (see `denormals`).
        let _flushed = Flushed::subnormals();
        let mut x = self.block_host(0, spans, layouts, x)?;
        for li in 1..self.blocks.len() {
            x = self.block_host(li, spans, layouts, &x)?;
        }
        let Some(head) = &self.head_host else {
            return Ok(StageOutput::Hidden(
                self.be.from_host(&x, self.be.storage_dtype())?,
            ));
        };
        let hidden = self.rmsnorm_host(&x, &head.norm);
        let logits = rowmul(&hidden, &head.w, rows);
        Ok(StageOutput::Final { logits, hidden })
    }

    /// [`InferStage::block_forward`] on the host (block `li`; none: `x` itself).
    fn block_host(
        &mut self,
        li: usize,
        spans: &[Span],
        layouts: &[Option<RowLayout>],
        x: &[f32],
    ) -> Result<Vec<f32>> {
        let Some(hb) = self.blocks.get(li).and_then(|b| b.host.as_ref()) else {
            return Ok(x.to_vec());
        };
        let rows = x.len() / self.config.d_model;
        let a = self.rmsnorm_host(x, &hb.norm1);
        let qkv = rowmul(&a, &hb.w[0], rows);
        let o = self.attention(li, spans, layouts, &qkv)?;
        let hb = self.blocks[li].host.as_ref().expect("checked above");
        let h = add(x, &rowmul(&o, &hb.w[1], rows));
        let u = rowmul(&self.rmsnorm_host(&h, &hb.norm2), &hb.w[2], rows);
        let g = if self.config.activation.is_gated() {
            // `u` holds each row's gate `x·W1` then its up `x·W3` (see `HostBlock::w`):
            // `silu(gate) ∘ up`, the backend path's activation then `mul`.
            let hidden = self.config.mlp_hidden();
            let mut g = vec![0.0f32; rows * hidden];
            for (gr, ur) in g.chunks_exact_mut(hidden).zip(u.chunks_exact(2 * hidden)) {
                let (gate, up) = ur.split_at(hidden);
                kernels::activation_fwd(self.config.activation, gate, gr);
                gr.iter_mut().zip(up).for_each(|(g, &u)| *g *= u);
            }
            g
        } else {
            let mut g = vec![0.0f32; u.len()];
            kernels::activation_fwd(self.config.activation, &u, &mut g);
            g
        };
        Ok(add(&h, &rowmul(&g, &hb.w[3], rows)))
    }
}
