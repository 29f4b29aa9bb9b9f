//! [`Gpt`]: every chunk of one model on one backend, run in order. This is what the
//! single-device reference trainer uses, and what pipelined training must reproduce.

use super::chunk::{ChunkGrad, ChunkInput, ChunkOutput, Cut, ModelChunk, Shape};
use super::{GptConfig, Param, Result};
use crate::model::ModelError;
use crate::tensor::Backend;

/// The whole model, as one or more chunks on the same backend.
pub struct Gpt<B: Backend> {
    config: GptConfig,
    chunks: Vec<ModelChunk<B>>,
}

impl<B: Backend> Gpt<B> {
    /// The backend the model computes on (every chunk's).
    pub fn backend(&self) -> &B {
        self.chunks[0].backend()
    }

    /// The model of `config`, cut into chunks by `cut` (use `Cut::Even(1)` for one piece).
    pub fn new(config: &GptConfig, backend: B, cut: &Cut) -> Result<Self> {
        let stages = cut.ranges(config.layers)?.len();
        let chunks = (0..stages)
            .map(|s| ModelChunk::new(config, backend.clone(), cut, s))
            .collect::<Result<_>>()?;
        Ok(Gpt {
            config: config.clone(),
            chunks,
        })
    }

    /// The model of `config` as [`Gpt::new`] builds it, but with placeholder parameters
    /// (zeros; a norm's gain ones) instead of the seeded draws, for a caller that sets every
    /// parameter at once (a checkpoint's restore): see [`super::init::overwritten`].
    pub fn blank(config: &GptConfig, backend: B, cut: &Cut) -> Result<Self> {
        super::init::overwritten(|| Self::new(config, backend, cut))
    }

    pub fn config(&self) -> &GptConfig {
        &self.config
    }
    pub fn chunks(&self) -> &[ModelChunk<B>] {
        &self.chunks
    }
    pub fn chunks_mut(&mut self) -> &mut [ModelChunk<B>] {
        &mut self.chunks
    }
    /// The chunks, e.g. to hand each to a pipeline stage.
    pub fn into_chunks(self) -> Vec<ModelChunk<B>> {
        self.chunks
    }

    /// F of every chunk (with `grad` a training forward, else an evaluation's); returns the
    /// last chunk's output.
    fn forward_all(
        &mut self,
        mb: usize,
        shape: Shape,
        ids: &[u32],
        targets: Option<&[u32]>,
        grad: bool,
    ) -> Result<ChunkOutput<B>> {
        let last = self.chunks.len() - 1;
        let mut out = None;
        for (i, chunk) in self.chunks.iter_mut().enumerate() {
            let input = match out.take() {
                None => ChunkInput::Tokens(ids),
                Some(ChunkOutput::Hidden(h)) => ChunkInput::Hidden(h),
                Some(_) => unreachable!("only the last chunk returns a loss or logits"),
            };
            let targets = if i == last { targets } else { None };
            out = Some(if grad {
                chunk.forward(mb, shape, input, targets)?
            } else {
                chunk.evaluate(mb, shape, input, targets)?
            });
        }
        Ok(out.expect("a model has at least one chunk"))
    }

    /// F then B (I then W) of micro-batch `mb` through every chunk; gradients accumulate.
    /// `scale` is `d objective / d loss` (see the module docs). Returns the mean loss.
    pub fn forward_backward(
        &mut self,
        mb: usize,
        shape: Shape,
        ids: &[u32],
        targets: &[u32],
        scale: f32,
    ) -> Result<f32> {
        let loss = match self.forward_all(mb, shape, ids, Some(targets), true)? {
            ChunkOutput::Loss { loss, .. } => loss,
            _ => unreachable!("the last chunk with targets returns its loss"),
        };
        let mut grad = ChunkGrad::Loss(scale);
        for chunk in self.chunks.iter_mut().rev() {
            match chunk.backward(mb, grad)? {
                Some(g) => grad = ChunkGrad::Hidden(g),
                None => break,
            }
        }
        Ok(loss)
    }

    /// The mean loss of one micro-batch, without touching gradients (evaluation).
    pub fn loss(&mut self, shape: Shape, ids: &[u32], targets: &[u32]) -> Result<f32> {
        const EVAL_MB: usize = usize::MAX;
        let out = self.forward_all(EVAL_MB, shape, ids, Some(targets), false);
        self.chunks.iter_mut().for_each(|c| c.discard(EVAL_MB));
        match out? {
            ChunkOutput::Loss { loss, .. } => Ok(loss),
            _ => unreachable!("the last chunk with targets returns its loss"),
        }
    }

    /// Logits `[batch·seq, vocab]` on the host (inference; nothing stashed).
    pub fn logits(&mut self, shape: Shape, ids: &[u32]) -> Result<Vec<f32>> {
        const EVAL_MB: usize = usize::MAX;
        let out = self.forward_all(EVAL_MB, shape, ids, None, false);
        self.chunks.iter_mut().for_each(|c| c.discard(EVAL_MB));
        match out? {
            ChunkOutput::Logits(l) => Ok(self.chunks[0].backend().to_host(&l)?),
            _ => unreachable!("the last chunk without targets returns logits"),
        }
    }

    /// Every parameter, in model order.
    pub fn params(&self) -> Vec<&Param<B>> {
        self.chunks.iter().flat_map(|c| c.params()).collect()
    }

    /// Every parameter, mutable, in model order.
    pub fn params_mut(&mut self) -> Vec<&mut Param<B>> {
        self.chunks
            .iter_mut()
            .flat_map(|c| c.params_mut())
            .collect()
    }

    /// The chunk holding parameter `name`.
    fn owner(&self, name: &str) -> Result<usize> {
        self.chunks
            .iter()
            .position(|c| c.param(name).is_ok())
            .ok_or_else(|| ModelError::UnknownParam(name.to_string()))
    }

    pub fn param_names(&self) -> Vec<String> {
        self.chunks.iter().flat_map(|c| c.param_names()).collect()
    }
    pub fn param_values(&self, name: &str) -> Result<Vec<f32>> {
        self.chunks[self.owner(name)?].param_values(name)
    }
    pub fn grad_values(&self, name: &str) -> Result<Vec<f32>> {
        self.chunks[self.owner(name)?].grad_values(name)
    }
    pub fn set_param(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let i = self.owner(name)?;
        self.chunks[i].set_param(name, values)
    }

    /// Sets every chunk's activation recomputation ([`ModelChunk::set_recompute`]).
    pub fn set_recompute(&mut self, recompute: super::Recompute) -> Result<()> {
        self.chunks
            .iter_mut()
            .try_for_each(|c| c.set_recompute(recompute))
    }

    pub fn zero_grads(&mut self) -> Result<()> {
        self.chunks.iter_mut().try_for_each(|c| c.zero_grads())
    }

    /// The global gradient norm `√Σ g²` over every chunk.
    pub fn grad_norm(&self) -> Result<f64> {
        let mut sum = 0.0;
        for c in &self.chunks {
            sum += c.grad_sq_norm()?;
        }
        Ok(sum.sqrt())
    }
}

impl<B: Backend> std::fmt::Debug for Gpt<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt")
            .field("config", &self.config)
            .field("chunks", &self.chunks)
            .finish()
    }
}
