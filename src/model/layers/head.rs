//! The LM head and the loss: `logits = x·W`, `loss = mean cross-entropy(logits, targets)`
//! over the counted targets (those not equal to [`crate::tensor::IGNORE_TARGET`]).

use super::{Stash, activation, gradient, linear_bwd_input, linear_bwd_weight, linear_fwd};
use crate::model::{GptConfig, Param, Result, init};
use crate::tensor::Backend;

struct Saved<B: Backend> {
    x: B::Buf,
    probs: B::Buf,
    targets: Vec<u32>,
    count: usize,
}

struct ForW<B: Backend> {
    x: B::Buf,
    dlogits: B::Buf,
    rows: usize,
}

/// `head.w: [d_model, vocab]` and the cross-entropy loss.
pub struct Head<B: Backend> {
    pub w: Param<B>,
    fwd: Stash<Saved<B>>,
    for_w: Stash<ForW<B>>,
}

impl<B: Backend> Head<B> {
    pub fn new(be: &B, name: &str, config: &GptConfig) -> Result<Self> {
        let (d, v) = (config.d_model, config.vocab);
        let pname = format!("{name}.w");
        let values = init::normal(config.seed, &pname, d * v, init::INIT_STD);
        Ok(Head {
            w: Param::new(be, pname, vec![d, v], &values, true)?,
            fwd: Stash::new(name),
            for_w: Stash::new(name),
        })
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
        let (loss, count, _) = self.forward_capture(be, mb, x, targets, false)?;
        Ok((loss, count))
    }

    /// [`Head::forward`], also returning, when `capture`, a host copy of the next-token
    /// distributions `[rows, vocab]` it computes for the loss anyway (the drafter's training
    /// targets): a copy, nothing recomputed.
    pub fn forward_capture(
        &mut self,
        be: &B,
        mb: usize,
        x: &B::Buf,
        targets: &[u32],
        capture: bool,
    ) -> Result<(f32, usize, Option<Vec<f32>>)> {
        let rows = targets.len();
        let logits = linear_fwd(be, x, &self.w, rows)?;
        let mut probs = activation(be, be.len(&logits))?;
        let (sum, count) = be.cross_entropy_fwd(&logits, targets, &mut probs, self.w.shape[1])?;
        let captured = if capture {
            Some(be.to_host(&probs)?)
        } else {
            None
        };
        let saved = Saved {
            x: be.dup(x)?,
            probs,
            targets: targets.to_vec(),
            count,
        };
        self.fwd.put(mb, saved);
        let loss = if count == 0 { 0.0 } else { sum / count as f32 };
        Ok((loss, count, captured))
    }

    /// I: `dx` from `scale = d objective / d loss`.
    pub fn backward_input(&mut self, be: &B, mb: usize, scale: f32) -> Result<B::Buf> {
        let s = self.fwd.take(mb, "backward_input", "forward")?;
        let rows = s.targets.len();
        let vocab = self.w.shape[1];
        let mut dlogits = gradient(be, rows * vocab)?;
        let per_token = if s.count == 0 {
            0.0
        } else {
            scale / s.count as f32
        };
        be.cross_entropy_bwd(&s.probs, &s.targets, &mut dlogits, vocab, per_token)?;
        let mut dx = gradient(be, rows * self.w.shape[0])?;
        linear_bwd_input(be, &dlogits, &self.w, &mut dx, rows, false)?;
        self.for_w.put(
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
        let s = self.for_w.take(mb, "backward_weight", "backward_input")?;
        linear_bwd_weight(be, &s.x, &s.dlogits, &mut self.w, s.rows)
    }

    pub fn discard(&mut self, mb: usize) {
        self.fwd.remove(mb);
        self.for_w.remove(mb);
    }

    pub fn stashed(&self) -> usize {
        self.fwd.len() + self.for_w.len()
    }

    pub fn params(&self) -> Vec<&Param<B>> {
        vec![&self.w]
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param<B>> {
        vec![&mut self.w]
    }
}
