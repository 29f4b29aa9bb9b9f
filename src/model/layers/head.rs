//! The LM head and the loss: `logits = x·Wᵀ` (`W: [vocab, d_model]`), `loss = mean
//! cross-entropy(logits, targets)` over the counted targets (those not equal to
//! [`crate::tensor::IGNORE_TARGET`]).
//!
//! **Fused and chunked over tokens** (as Liger's fused linear cross-entropy): a training
//! forward walks the micro-batch's tokens in chunks of [`chunk_rows`]; per chunk it computes
//! the logits, the loss, the logits' gradient in place of the logits, the chunk's rows of
//! `dx` and its share of `dW`, then drops the chunk. The `[tokens, vocab]` logits never exist
//! at once, forward or backward. The gradients are those of a loss scale of 1, since the
//! scale (`d objective / d loss`) only arrives with I: I multiplies the stashed `dx` by it and
//! W adds `scale·dW` to the weight's gradient, so the split I/W stays (W still touches the
//! weight's gradient, and only W) at no extra matrix product.
//!
//! Why the gradients are computed in F rather than in I or W: each other way computes the
//! chunk's logits again (once in I, or in I and in W), a product as large as the head's
//! forward (a fifth of a 135 M model's FLOPs at a 49K vocabulary); computed in F the head
//! costs its three products, as unfused. What waits for W is `dW` itself, `[vocab, d_model]`
//! in `f32` per micro-batch between F and W, the size of the head's own gradient, whatever
//! the micro-batch's tokens (the unfused head kept `[tokens, vocab]` probabilities from F to
//! I and as many logit gradients from I to W). An evaluation forward computes only the loss.
//!
//! A [`TokenLoss`] hook replaces the mean cross-entropy by any function of the counted
//! targets' log-probabilities (e.g. the GRPO objective with its per-token KL penalty, whose
//! gradient differs per token, which one loss scale per micro-batch cannot express). The
//! hooked path computes on the host; without a hook nothing changes (bitwise).

use std::sync::Arc;

use super::{Stash, activation, gradient};
use crate::model::ModelError;
use crate::model::{GptConfig, Param, Result, init};
use crate::tensor::{Backend, DType, Gemm, IGNORE_TARGET};

/// A micro-batch's loss as a function of its counted targets' log-probabilities.
pub trait TokenLoss: Send + Sync + std::fmt::Debug {
    /// Micro-batch `mb`'s loss and `d loss / d logp_t` for each counted target `t`, given
    /// their log-probabilities `logp` in row order.
    fn loss(&self, mb: usize, logp: &[f32]) -> std::result::Result<(f32, Vec<f32>), String>;
}

/// A hook seen through a micro-batch offset: micro-batch `mb` is the inner hook's
/// `mb + offset` (a data-parallel replica's share of a step).
#[derive(Debug)]
pub struct OffsetTokenLoss {
    pub inner: Arc<dyn TokenLoss>,
    pub offset: usize,
}

impl TokenLoss for OffsetTokenLoss {
    fn loss(&self, mb: usize, logp: &[f32]) -> std::result::Result<(f32, Vec<f32>), String> {
        self.inner.loss(mb + self.offset, logp)
    }
}

/// `log softmax(row)[t]` in `f64` (the hooked loss's log-probabilities).
pub fn log_prob(row: &[f32], t: usize) -> f32 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = row
        .iter()
        .map(|&x| f64::from(x - m).exp())
        .sum::<f64>()
        .ln();
    (f64::from(row[t] - m) - lse) as f32
}

/// Tokens per chunk of the fused head: `d_model` (so a chunk's logits are at most the size
/// of the head's weight, whatever the micro-batch's tokens; and a chunk's share of `dW`, a
/// product over the chunk's tokens whose `[vocab, d_model]` output is read and written once
/// per chunk, does `d_model` multiply-adds per element it moves), and at least as many as
/// make a chunk of 2^20 logits (at a small vocabulary one chunk holds the whole
/// micro-batch); a multiple of 16.
pub fn chunk_rows(d_model: usize, vocab: usize) -> usize {
    const MIN_LOGITS: usize = 1 << 20;
    let rows = d_model.max(MIN_LOGITS.div_ceil(vocab.max(1)));
    rows.div_ceil(16) * 16
}

/// The initial values of the head `name` (`[vocab, d_model]`): with `tie_embeddings`, the
/// token embedding's draw; otherwise its own, drawn in the `[d_model, vocab]` order the head
/// had until checkpoint version 2, so a seed still names the same model. The drafter's
/// frozen head starts from these too.
pub fn initial_values(config: &GptConfig, name: &str) -> Vec<f32> {
    let (d, v) = (config.d_model, config.vocab);
    if config.tie_embeddings {
        init::normal(config.seed, crate::model::tie::EMBED, v * d, init::INIT_STD)
    } else {
        let drawn = init::normal(config.seed, name, d * v, init::INIT_STD);
        crate::model::tie::transpose(&drawn, d, v)
    }
}

/// What a training forward leaves for I: the gradients of a loss scale of 1.
struct Saved<B: Backend> {
    /// `[rows, d_model]`.
    dx: B::Buf,
    /// `[vocab, d_model]`.
    dw: B::Buf,
}

/// What I leaves for W: `dW` and the scale it is added with.
struct ForW<B: Backend> {
    dw: B::Buf,
    scale: f32,
}

/// `head.w: [vocab, d_model]` and the cross-entropy loss: `logits = x·Wᵀ`. The weight has
/// the token embedding's layout (and Hugging Face's `lm_head.weight`'s), so a tied head is
/// the embedding's table as it is: the pair's gradients sum and their values stay equal
/// without a transpose (`model/tie.rs`).
pub struct Head<B: Backend> {
    pub w: Param<B>,
    stash: Stash<Saved<B>, ForW<B>>,
    token_loss: Option<Arc<dyn TokenLoss>>,
    /// `dW` buffers W has finished with, for the next forwards: a forward overwrites one
    /// rather than allocating (and zeroing) `[vocab, d_model]` per micro-batch.
    spare: Vec<B::Buf>,
    /// One chunk's buffers (its rows of `x`, its logits, its rows of `dx`), kept from one
    /// forward to the next: a chunk's logits are as big as the weight, and making them anew
    /// per micro-batch cost a page fault per 4 KiB (docs/benchmarks.md, "Where the gap to
    /// torch was").
    chunk: Option<(B::Buf, B::Buf, B::Buf)>,
}

impl<B: Backend> Head<B> {
    /// `{name}.w: [vocab, d_model]`; with `tie_embeddings` a copy of the token embedding
    /// (`embed.tok`'s draw), marked [`Param::tied`].
    pub fn new(be: &B, name: &str, config: &GptConfig) -> Result<Self> {
        let (d, v) = (config.d_model, config.vocab);
        let pname = format!("{name}.w");
        let values = initial_values(config, &pname);
        let mut w = Param::new(be, pname, vec![v, d], &values, true)?;
        w.tied = config.tie_embeddings;
        Ok(Head {
            w,
            stash: Stash::new(name),
            token_loss: None,
            spare: Vec::new(),
            chunk: None,
        })
    }

    /// Sets (or clears) the hook that replaces the mean cross-entropy of the micro-batches
    /// forwarded from now on.
    pub fn set_token_loss(&mut self, hook: Option<Arc<dyn TokenLoss>>) {
        self.token_loss = hook;
    }

    /// Logits `[rows, vocab]` of `x: [rows, d_model]`, nothing stashed (inference).
    pub fn logits(&self, be: &B, x: &B::Buf, rows: usize) -> Result<B::Buf> {
        let (vocab, d) = (self.w.shape[0], self.w.shape[1]);
        activation(be, rows * vocab, |y| {
            Ok(be.matmul(x, &self.w.value, y, Gemm::nn(rows, d, vocab).trans_b())?)
        })
    }

    /// The mean loss over counted targets (0 when none counts) and the count. With `grad`
    /// (a training forward) the gradients are computed and kept for I and W (module docs);
    /// without, only the loss.
    pub fn forward(
        &mut self,
        be: &B,
        mb: usize,
        x: &B::Buf,
        targets: &[u32],
        grad: bool,
    ) -> Result<(f32, usize)> {
        let count = targets.iter().filter(|&&t| t != IGNORE_TARGET).count();
        let hook = self.token_loss.clone();
        let (loss, saved) = match hook {
            None => {
                let per_token = if count == 0 { 0.0 } else { 1.0 / count as f32 };
                let vocab = self.w.shape[0];
                let mut sum = 0.0f64;
                let saved = self.chunked(be, x, targets, grad, |logits, rows| {
                    let (s, _) = be.cross_entropy_grad(logits, &targets[rows], vocab, per_token)?;
                    sum += f64::from(s);
                    Ok(())
                })?;
                let loss = if count == 0 {
                    0.0
                } else {
                    sum as f32 / count as f32
                };
                (loss, saved)
            }
            Some(hook) => self.hooked(be, mb, x, targets, grad, hook.as_ref())?,
        };
        if let Some(saved) = saved {
            self.stash.keep_for_i(mb, saved);
        }
        Ok((loss, count))
    }

    /// The forward under a [`TokenLoss`]: the hook needs every counted target's
    /// log-probability before any gradient, so the chunks' logits are computed twice (once
    /// for the log-probabilities, on the host, once for the gradients).
    fn hooked(
        &mut self,
        be: &B,
        mb: usize,
        x: &B::Buf,
        targets: &[u32],
        grad: bool,
        hook: &dyn TokenLoss,
    ) -> Result<(f32, Option<Saved<B>>)> {
        let vocab = self.w.shape[0];
        let mut logp = Vec::new();
        self.chunked(be, x, targets, false, |logits, rows| {
            let host = be.to_host(logits)?;
            let counted = (targets[rows].iter().enumerate()).filter(|&(_, &t)| t != IGNORE_TARGET);
            logp.extend(
                counted.map(|(r, &t)| log_prob(&host[r * vocab..(r + 1) * vocab], t as usize)),
            );
            Ok(())
        })?;
        let input = |reason: String| ModelError::Input {
            stage: 0,
            mb,
            reason,
        };
        let (loss, dlogp) = hook
            .loss(mb, &logp)
            .map_err(|reason| input(format!("token loss: {reason}")))?;
        if dlogp.len() != logp.len() {
            let (got, want) = (dlogp.len(), logp.len());
            return Err(input(format!(
                "token loss gave {got} gradients for {want} counted targets"
            )));
        }
        if !grad {
            return Ok((loss, None));
        }
        // The counted targets' gradients, in row order across the chunks.
        let mut g = dlogp.iter();
        let saved = self.chunked(be, x, targets, true, |logits, rows| {
            let t = &targets[rows];
            let probs = gradient(be, t.len() * vocab, |probs| {
                be.cross_entropy_fwd(logits, t, probs, vocab)?;
                Ok(())
            })?;
            let probs = be.to_host(&probs)?;
            let mut host = vec![0.0f32; t.len() * vocab];
            // d logp_t / d logits = onehot(t) − probs, so the row gets −g_t·(probs − onehot).
            for (r, &t) in t.iter().enumerate().filter(|&(_, &t)| t != IGNORE_TARGET) {
                let c = -g.next().copied().unwrap_or(0.0);
                let out = &mut host[r * vocab..(r + 1) * vocab];
                let p = &probs[r * vocab..(r + 1) * vocab];
                out.iter_mut().zip(p).for_each(|(o, &p)| *o = c * p);
                out[t as usize] -= c;
            }
            *logits = be.from_host(&host, DType::F32)?;
            Ok(())
        })?;
        Ok((loss, saved))
    }

    /// Walks `x: [rows, d_model]` in chunks of [`chunk_rows`]: computes each chunk's logits
    /// (`f32`) and hands them to `f` with the chunk's rows. With `grad`, `f` leaves the
    /// logits' gradient in their place, and the chunk's rows of `dx` and its share of `dW`
    /// are computed from it: the returned [`Saved`].
    fn chunked(
        &mut self,
        be: &B,
        x: &B::Buf,
        targets: &[u32],
        grad: bool,
        mut f: impl FnMut(&mut B::Buf, std::ops::Range<usize>) -> Result<()>,
    ) -> Result<Option<Saved<B>>> {
        let (vocab, d, rows) = (self.w.shape[0], self.w.shape[1], targets.len());
        let step = chunk_rows(d, vocab);
        let mut saved = if grad {
            let dw = match self.spare.pop() {
                Some(dw) => dw,
                None => be.zeros(d * vocab, DType::F32)?,
            };
            let dx = be.zeros(rows * d, DType::F32)?;
            Some(Saved { dx, dw })
        } else {
            None
        };
        // One chunk's buffers, made again only for a chunk of another length.
        let mut bufs = self.chunk.take();
        for start in (0..rows).step_by(step) {
            let n = step.min(rows - start);
            let fits = |(xc, l, _): &(B::Buf, B::Buf, B::Buf)| {
                be.len(l) == n * vocab && be.dtype(xc) == be.dtype(x)
            };
            if !bufs.as_ref().is_some_and(fits) {
                let xc = be.zeros(n * d, be.dtype(x))?;
                let (logits, dxc) = (
                    be.zeros(n * vocab, DType::F32)?,
                    be.zeros(n * d, DType::F32)?,
                );
                bufs = Some((xc, logits, dxc));
            }
            let Some((xc, logits, dxc)) = bufs.as_mut() else {
                unreachable!("made above")
            };
            // The whole micro-batch in one chunk reads x itself.
            let whole = n == rows;
            if !whole {
                be.copy_range(x, start * d, xc, 0, n * d)?;
            }
            let xc = if whole { x } else { &*xc };
            be.matmul(xc, &self.w.value, logits, Gemm::nn(n, d, vocab).trans_b())?;
            f(logits, start..start + n)?;
            let Some(s) = saved.as_mut() else { continue };
            let back = Gemm::nn(n, vocab, d);
            if whole {
                be.matmul(logits, &self.w.value, &mut s.dx, back)?;
            } else {
                be.matmul(logits, &self.w.value, dxc, back)?;
                be.copy_range(dxc, 0, &mut s.dx, start * d, n * d)?;
            }
            // The first chunk overwrites the (reused) buffer, the others add to it.
            let mut g = Gemm::nn(vocab, n, d).trans_a();
            g.accumulate = start > 0;
            be.matmul(logits, xc, &mut s.dw, g)?;
        }
        self.chunk = bufs;
        if let Some(s) = saved.as_mut().filter(|_| rows == 0) {
            // No chunk overwrote the reused buffer.
            be.fill(&mut s.dw, 0.0)?;
        }
        Ok(saved)
    }

    /// I: `dx` for `scale = d objective / d loss`.
    pub fn backward_input(&mut self, be: &B, mb: usize, scale: f32) -> Result<B::Buf> {
        let Saved { mut dx, dw } = self.stash.take_for_i(mb)?;
        be.scale(&mut dx, scale)?;
        self.stash.keep_for_w(mb, ForW { dw, scale });
        Ok(dx)
    }

    /// W: accumulates the gradient of `head.w`.
    pub fn backward_weight(&mut self, be: &B, mb: usize) -> Result<()> {
        let s = self.stash.take_for_w(mb)?;
        be.axpy(s.scale, &s.dw, &mut self.w.grad)?;
        self.spare.push(s.dw);
        Ok(())
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
