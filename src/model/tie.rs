//! Tied input and output embeddings (`tie_embeddings`, Hugging Face's
//! `tie_word_embeddings`).
//!
//! The first stage owns the token embedding `embed.tok: [vocab, d_model]`; the last stage
//! holds a copy of it as the LM head `head.w`, in the same layout (the head computes
//! `x·Wᵀ`, as Hugging Face's `lm_head.weight` is laid out). As in Megatron-LM, both copies
//! are trained: before each optimizer step their gradients are summed (`g = g_embed +
//! g_head`) and each copy takes the sum, so the same AdamW update keeps them bitwise equal.
//! The sum is one `f32` addition per element, which commutes exactly, so the single-device
//! reference and a pipeline whose first and last stages sit on different ranks get bitwise
//! the same gradient. The copies share a layout, so the sum moves the gradients out and back
//! without a transpose (until session 47 the head was `[d_model, vocab]` and a step
//! transposed the pair twice: 1.7% of a SmolLM-135M step; docs/benchmarks.md).

use super::{ModelChunk, Param, Result};
use crate::model::ModelError;
use crate::tensor::Backend;

/// The token embedding's name.
pub const EMBED: &str = "embed.tok";
/// The LM head's name.
pub const HEAD: &str = "head.w";

/// `values: [rows, cols]` transposed to `[cols, rows]` (Hugging Face's `[out, in]` linear
/// weights to this crate's `[in, out]`, and back).
pub fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
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
    out
}

/// The side of [`transpose`]'s tiles: each output row's part of a tile is written in one
/// run (docs/benchmarks.md, "The tied pair's transposes").
const TILE: usize = 128;

/// A tied pair's side held in one place: the embedding's or the head's copy.
pub enum Side<'a, B: Backend> {
    Embed(&'a mut Param<B>),
    Head(&'a mut Param<B>),
}

impl<B: Backend> Side<'_, B> {
    /// Takes the copy's gradient out (moved, not copied, where the backend's buffers are
    /// host memory); the copy holds no gradient until [`Side::set_grad`].
    pub fn take_grad(&mut self, be: &B) -> Result<Vec<f32>> {
        let (Side::Embed(p) | Side::Head(p)) = self;
        let empty = be.from_host(&[], be.dtype(&p.grad))?;
        Ok(be.take_host(std::mem::replace(&mut p.grad, empty))?)
    }

    /// Sets the copy's gradient to `sum`.
    pub fn set_grad(&mut self, be: &B, sum: Vec<f32>) -> Result<()> {
        let (Side::Embed(p) | Side::Head(p)) = self;
        p.grad = be.from_host_vec(sum, be.dtype(&p.grad))?;
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
/// a one-rank pipeline, a V-shaped placement); a no-op when it holds neither. Holding one
/// copy only is an error: the sum needs the other rank ([`sides`] and a collective).
pub fn sum_local<'a, B: Backend + 'a>(
    be: &B,
    chunks: impl IntoIterator<Item = &'a mut ModelChunk<B>>,
) -> Result<()> {
    match sides(chunks) {
        (None, None) => Ok(()),
        (Some(mut e), Some(mut h)) => {
            let mut sum = e.take_grad(be)?;
            let mut head = h.take_grad(be)?;
            for (s, g) in sum.iter_mut().zip(&mut head) {
                *s += *g;
                *g = *s;
            }
            h.set_grad(be, head)?;
            e.set_grad(be, sum)
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
