//! Tied input and output embeddings (`tie_embeddings`, Hugging Face's
//! `tie_word_embeddings`).
//!
//! The first stage owns the token embedding `embed.tok: [vocab, d_model]`; the last stage
//! holds a copy of it as the LM head `head.w: [d_model, vocab]` (transposed, so the head
//! computes `x·W` like any other linear layer and everything that reads `head.w` — KV-cache
//! inference, the drafter's frozen head, export — needs no second code path). As in
//! Megatron-LM, both copies are trained: before each optimizer step their gradients are
//! summed (`g = g_embed + g_headᵀ`) and each copy takes the sum, so the same AdamW update
//! keeps them bitwise equal. The sum is one `f32` addition per element, which commutes
//! exactly, so the single-device reference and a pipeline whose first and last stages sit
//! on different ranks get bitwise the same gradient.

use super::{ModelChunk, Param, Result};
use crate::model::ModelError;
use crate::tensor::Backend;

/// The token embedding's name.
pub const EMBED: &str = "embed.tok";
/// The LM head's name.
pub const HEAD: &str = "head.w";

/// `values: [rows, cols]` transposed to `[cols, rows]`.
pub fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    transpose_into(values, rows, cols, &mut out);
    out
}

/// [`transpose`] into `out`, of `values`' length.
///
/// In tiles of 128 × 128 elements, each output row's part of a tile written in one run: at
/// a real vocabulary the tied pair is transposed twice a step (`[vocab, d]`, 28 M elements
/// for SmolLM-135M), and there writes down a column of the output, each to another page,
/// cost more than reads down a column of the input. 75 and 64 ms for SmolLM-135M's two
/// transposes, against 119 and 116 ms with 32 × 32 tiles written down their columns
/// (docs/benchmarks.md, "The tied pair's transposes").
pub fn transpose_into(values: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    for r0 in (0..rows).step_by(TILE) {
        let r1 = (r0 + TILE).min(rows);
        for c0 in (0..cols).step_by(TILE) {
            for c in c0..(c0 + TILE).min(cols) {
                let run = &mut out[c * rows + r0..c * rows + r1];
                for (i, o) in run.iter_mut().enumerate() {
                    *o = values[(r0 + i) * cols + c];
                }
            }
        }
    }
}

/// The side of [`transpose`]'s tiles.
const TILE: usize = 128;

/// The host table a tied pair's gradient sum reuses from one step to the next, so that a
/// step's sum allocates nothing: a `[vocab, d]` table made anew each step faulted its pages
/// in each time (docs/benchmarks.md, "Where the gap to torch was").
#[derive(Debug, Default)]
pub struct TieScratch(Vec<f32>);

impl TieScratch {
    /// The kept table, `len` long (made the first time).
    fn take(&mut self, len: usize) -> Vec<f32> {
        let mut table = std::mem::take(&mut self.0);
        table.resize(len, 0.0);
        table
    }
}

/// A tied pair's side held in one place: the embedding's or the head's copy.
pub enum Side<'a, B: Backend> {
    Embed(&'a mut Param<B>),
    Head(&'a mut Param<B>),
}

impl<B: Backend> Side<'_, B> {
    /// Takes the copy's gradient out, in the embedding's `[vocab, d_model]` layout (moved,
    /// not copied, where the backend's buffers are host memory); the copy holds no gradient
    /// until [`Side::set_grad`].
    pub fn take_grad(&mut self, be: &B, scratch: &mut TieScratch) -> Result<Vec<f32>> {
        let (Side::Embed(p) | Side::Head(p)) = self;
        let empty = be.from_host(&[], be.dtype(&p.grad))?;
        let grad = be.take_host(std::mem::replace(&mut p.grad, empty))?;
        Ok(match self {
            Side::Embed(_) => grad,
            Side::Head(p) => {
                let mut out = scratch.take(grad.len());
                transpose_into(&grad, p.shape[0], p.shape[1], &mut out);
                scratch.0 = grad;
                out
            }
        })
    }

    /// Sets the copy's gradient to `sum` (in the embedding's layout). The head's copy
    /// transposes it into `scratch`'s table and leaves `sum` there for the next step.
    pub fn set_grad(&mut self, be: &B, sum: Vec<f32>, scratch: &mut TieScratch) -> Result<()> {
        match self {
            Side::Embed(p) => p.grad = be.from_host_vec(sum, be.dtype(&p.grad))?,
            Side::Head(_) => {
                let table = scratch.take(sum.len());
                self.set_transposed(be, &sum, table)?;
                scratch.0 = sum;
            }
        }
        Ok(())
    }

    /// The head's copy: its gradient set to `sum` (in the embedding's layout) transposed
    /// into `table`, which it keeps.
    fn set_transposed(&mut self, be: &B, sum: &[f32], mut table: Vec<f32>) -> Result<()> {
        let (Side::Embed(p) | Side::Head(p)) = self;
        let (d, v) = (p.shape[0], p.shape[1]);
        transpose_into(sum, v, d, &mut table);
        p.grad = be.from_host_vec(table, be.dtype(&p.grad))?;
        Ok(())
    }
}

/// The sides of the tied pair among `chunks` (the chunks one rank holds): the first
/// stage's `embed.tok` and the last stage's tied `head.w`, each `None` where that chunk is
/// held elsewhere. Both `None` when the model is not tied.
pub fn sides<'a, B: Backend + 'a>(
    chunks: impl IntoIterator<Item = &'a mut ModelChunk<B>>,
) -> (Option<Side<'a, B>>, Option<Side<'a, B>>) {
    let (mut embed, mut head) = (None, None);
    for chunk in chunks {
        if !chunk.config().tie_embeddings {
            continue;
        }
        for p in chunk.params_mut() {
            if p.name == EMBED {
                embed = Some(Side::Embed(p));
            } else if p.name == HEAD && p.tied {
                head = Some(Side::Head(p));
            }
        }
    }
    (embed, head)
}

/// Sums the tied pair's gradients when one rank holds both copies (the reference trainer,
/// a one-rank pipeline, a V-shaped placement), through `scratch`'s table; a no-op when it
/// holds neither. Holding one copy only is an error: the sum needs the other rank
/// ([`sides`] and a collective).
pub fn sum_local<'a, B: Backend + 'a>(
    be: &B,
    chunks: impl IntoIterator<Item = &'a mut ModelChunk<B>>,
    scratch: &mut TieScratch,
) -> Result<()> {
    match sides(chunks) {
        (None, None) => Ok(()),
        (Some(mut e), Some(mut h)) => {
            let mut sum = e.take_grad(be, scratch)?;
            let head = h.take_grad(be, scratch)?;
            for (s, g) in sum.iter_mut().zip(&head) {
                *s += g;
            }
            // Both copies take the sum: the head's transposed into `head`'s table.
            h.set_transposed(be, &sum, head)?;
            e.set_grad(be, sum, scratch)
        }
        _ => Err(ModelError::Tied(
            "these chunks hold one copy of the tied embedding only; its gradient must be \
             summed with the other stage's"
                .into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::transpose;

    #[test]
    fn transposes_any_shape_across_tile_edges() {
        for (rows, cols) in [(1, 1), (3, 5), (128, 128), (129, 300), (300, 129), (1, 257)] {
            let values: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let t = transpose(&values, rows, cols);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(t[c * rows + r], values[r * cols + c], "{rows} × {cols}");
                }
            }
            assert_eq!(transpose(&t, cols, rows), values);
        }
    }
}
