//! The LM head and the loss: `logits = x·W`, `loss = mean cross-entropy(logits, targets)`
//! over the counted targets (those not equal to [`crate::tensor::IGNORE_TARGET`]).
//!
//! A [`TokenLoss`] hook replaces the mean cross-entropy by any function of the counted
//! targets' log-probabilities (e.g. the GRPO objective with its per-token KL penalty, whose
//! gradient differs per token, which one loss scale per micro-batch cannot express). The
//! hooked path computes on the host; without a hook nothing changes (bitwise).

use std::sync::Arc;

use super::{Stash, activation, gradient, linear_bwd_input, linear_bwd_weight, linear_fwd};
use crate::model::{GptConfig, ModelError, Param, Result, init};
use crate::tensor::{Backend, DType, IGNORE_TARGET};

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

struct Saved<B: Backend> {
    x: B::Buf,
    probs: B::Buf,
    targets: Vec<u32>,
    count: usize,
    /// With a [`TokenLoss`]: `d loss / d logp` of each counted target.
    dlogp: Option<Vec<f32>>,
}

struct ForW<B: Backend> {
    x: B::Buf,
    dlogits: B::Buf,
    rows: usize,
}

/// `head.w: [d_model, vocab]` and the cross-entropy loss.
pub struct Head<B: Backend> {
    pub w: Param<B>,
    stash: Stash<Saved<B>, ForW<B>>,
    token_loss: Option<Arc<dyn TokenLoss>>,
}

impl<B: Backend> Head<B> {
    /// `{name}.w: [d_model, vocab]`; with `tie_embeddings` a copy of the token embedding
    /// (`embed.tok`'s draw, transposed), marked [`Param::tied`].
    pub fn new(be: &B, name: &str, config: &GptConfig) -> Result<Self> {
        let (d, v) = (config.d_model, config.vocab);
        let pname = format!("{name}.w");
        let values = if config.tie_embeddings {
            let tok = init::normal(config.seed, crate::model::tie::EMBED, v * d, init::INIT_STD);
            crate::model::tie::transpose(&tok, v, d)
        } else {
            init::normal(config.seed, &pname, d * v, init::INIT_STD)
        };
        let mut w = Param::new(be, pname, vec![d, v], &values, true)?;
        w.tied = config.tie_embeddings;
        Ok(Head {
            w,
            stash: Stash::new(name),
            token_loss: None,
        })
    }

    /// Sets (or clears) the hook that replaces the mean cross-entropy of the micro-batches
    /// forwarded from now on.
    pub fn set_token_loss(&mut self, hook: Option<Arc<dyn TokenLoss>>) {
        self.token_loss = hook;
    }

    /// Logits `[rows, vocab]` of `x: [rows, d_model]`, nothing stashed (inference).
    pub fn logits(&self, be: &B, x: &B::Buf, rows: usize) -> Result<B::Buf> {
        linear_fwd(be, x, &self.w, rows)
    }

    /// The mean loss over counted targets (0 when none counts) and the count.
    pub fn forward(
        &mut self,
        be: &B,
        mb: usize,
        x: &B::Buf,
        targets: &[u32],
    ) -> Result<(f32, usize)> {
        let rows = targets.len();
        let logits = linear_fwd(be, x, &self.w, rows)?;
        let mut probs = activation(be, be.len(&logits))?;
        let vocab = self.w.shape[1];
        let (sum, count) = be.cross_entropy_fwd(&logits, targets, &mut probs, vocab)?;
        let hooked = match &self.token_loss {
            Some(hook) => {
                let host = be.to_host(&logits)?;
                let logp: Vec<f32> = (targets.iter().enumerate())
                    .filter(|&(_, &t)| t != IGNORE_TARGET)
                    .map(|(r, &t)| log_prob(&host[r * vocab..(r + 1) * vocab], t as usize))
                    .collect();
                let (loss, dlogp) = hook.loss(mb, &logp).map_err(|reason| ModelError::Input {
                    stage: 0,
                    mb,
                    reason: format!("token loss: {reason}"),
                })?;
                if dlogp.len() != logp.len() {
                    let reason = format!(
                        "token loss gave {} gradients for {} counted targets",
                        dlogp.len(),
                        logp.len()
                    );
                    return Err(ModelError::Input {
                        stage: 0,
                        mb,
                        reason,
                    });
                }
                Some((loss, dlogp))
            }
            None => None,
        };
        let saved = Saved {
            x: be.dup(x)?,
            probs,
            targets: targets.to_vec(),
            count,
            dlogp: hooked.as_ref().map(|(_, d)| d.clone()),
        };
        self.stash.keep_for_i(mb, saved);
        let loss = match hooked {
            Some((loss, _)) => loss,
            None if count == 0 => 0.0,
            None => sum / count as f32,
        };
        Ok((loss, count))
    }

    /// I: `dx` from `scale = d objective / d loss`.
    pub fn backward_input(&mut self, be: &B, mb: usize, scale: f32) -> Result<B::Buf> {
        let s = self.stash.take_for_i(mb)?;
        let rows = s.targets.len();
        let vocab = self.w.shape[1];
        let dlogits = match &s.dlogp {
            // d logp_t / d logits = onehot(t) − probs, so the row gets −scale·g_t·(probs − onehot).
            Some(dlogp) => {
                let probs = be.to_host(&s.probs)?;
                let mut host = vec![0.0f32; rows * vocab];
                let counted = s
                    .targets
                    .iter()
                    .enumerate()
                    .filter(|&(_, &t)| t != IGNORE_TARGET);
                for ((r, &t), &g) in counted.zip(dlogp) {
                    let c = -scale * g;
                    let out = &mut host[r * vocab..(r + 1) * vocab];
                    let p = &probs[r * vocab..(r + 1) * vocab];
                    out.iter_mut().zip(p).for_each(|(o, &p)| *o = c * p);
                    out[t as usize] -= c;
                }
                be.from_host(&host, DType::F32)?
            }
            None => {
                let mut dlogits = gradient(be, rows * vocab)?;
                let per_token = if s.count == 0 {
                    0.0
                } else {
                    scale / s.count as f32
                };
                be.cross_entropy_bwd(&s.probs, &s.targets, &mut dlogits, vocab, per_token)?;
                dlogits
            }
        };
        let mut dx = gradient(be, rows * self.w.shape[0])?;
        linear_bwd_input(be, &dlogits, &self.w, &mut dx, rows, false)?;
        self.stash.keep_for_w(
            mb,
            ForW {
                x: s.x,
                dlogits,
                rows,
            },
        );
        Ok(dx)
    }

    /// W: accumulates the gradient of `head.w`.
    pub fn backward_weight(&mut self, be: &B, mb: usize) -> Result<()> {
        let s = self.stash.take_for_w(mb)?;
        linear_bwd_weight(be, &s.x, &s.dlogits, &mut self.w, s.rows)
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
