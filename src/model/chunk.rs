//! [`ModelChunk`]: one pipeline stage's share of the GPT (the [`Cut`] that decides it is in
//! `cut.rs`).
//!
//! A chunk is a contiguous range of blocks; the first chunk also holds the embedding, the
//! last the final norm, the LM head and the loss. Its calls are exactly the pipeline actions
//! of one (stage, micro-batch): `forward` (F), `backward_input` (I), `backward_weight` (W)
//! and the fused `backward` (B = I then W). Micro-batches are independent: any number may
//! be in flight, and the I and W of different micro-batches may interleave in any order the
//! schedule chooses.
//!
//! With activation recomputation ([`ModelChunk::set_recompute`], [`super::recompute`]) a
//! `full` chunk keeps only each block's input from F and runs the block's forward again in
//! I, just before the block's I; `selective` leaves that to attention. Either way the
//! results are bitwise those without.
//!
//! The last chunk can also hand copies of what its forward computes anyway (final hidden
//! states, with the targets) to the drafter's training buffer
//! ([`ModelChunk::set_draft_sink`]); that changes no result.

use std::collections::HashMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

pub use super::cut::Cut;
use super::drafter::DraftBufferHandle;
use super::layers::{Block, Embedding, Head, Held, Layer, RmsNorm};
use super::{GptConfig, Recompute, Result};
use crate::model::ModelError;
use crate::tensor::Backend;

mod params;

/// Shape of one micro-batch: `batch` sequences of `seq ≤ config.seq_len` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shape {
    pub batch: usize,
    pub seq: usize,
}

impl Shape {
    /// Tokens in the micro-batch.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }
}

/// What a chunk's forward consumes.
pub enum ChunkInput<'a, B: Backend> {
    /// Token ids `[batch, seq]`: the first chunk's input.
    Tokens(&'a [u32]),
    /// Activations `[batch·seq, d_model]` from the previous stage.
    Hidden(B::Buf),
}

/// What a chunk's forward produces.
pub enum ChunkOutput<B: Backend> {
    /// Activations `[batch·seq, d_model]` for the next stage.
    Hidden(B::Buf),
    /// The last chunk with targets: the micro-batch's mean loss over `tokens` counted targets.
    Loss { loss: f32, tokens: usize },
    /// The last chunk without targets: logits `[batch·seq, vocab]`; nothing is stashed in
    /// this chunk (inference).
    Logits(B::Buf),
}

/// What a chunk's backward_input starts from.
pub enum ChunkGrad<B: Backend> {
    /// The last chunk: `d objective / d loss` of this micro-batch (e.g. `1/M` for `M`
    /// micro-batches of equal size).
    Loss(f32),
    /// Gradient w.r.t. this chunk's output `[batch·seq, d_model]`, from the next stage.
    Hidden(B::Buf),
}

/// Progress of one micro-batch through this chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Forwarded,
    InputDone,
}

/// One stage's share of the model, with its parameters, gradients and per-micro-batch stash.
pub struct ModelChunk<B: Backend> {
    be: B,
    config: GptConfig,
    stage: usize,
    stages: usize,
    range: Range<usize>,
    embed: Option<Embedding<B>>,
    blocks: Vec<Block<B>>,
    final_norm: Option<RmsNorm<B>>,
    head: Option<Head<B>>,
    in_flight: HashMap<usize, (Shape, Phase)>,
    recompute: Recompute,
    /// `Recompute::Full`: each in-flight micro-batch's block inputs, first block first,
    /// until its I.
    block_inputs: HashMap<usize, Vec<B::Buf>>,
    /// Where the last chunk copies its training forwards' hidden states and distributions.
    draft_sink: Option<DraftBufferHandle>,
}

impl<B: Backend> ModelChunk<B> {
    /// Chunk `stage` of the model cut by `cut`. Parameters are initialised from
    /// (config.seed, name), so every chunk equals the same part of the uncut model, or
    /// imported from `config.from`'s directory.
    pub fn new(config: &GptConfig, backend: B, cut: &Cut, stage: usize) -> Result<Self> {
        config.validate()?;
        let ranges = cut.ranges(config.layers)?;
        let Some(range) = ranges.get(stage).cloned() else {
            return Err(ModelError::Cut {
                layers: config.layers,
                cut: format!("{cut:?}"),
                reason: format!("there is no chunk {stage} of {}", ranges.len()),
            });
        };
        let stages = ranges.len();
        let be = &backend;
        let (first, last) = (stage == 0, stage + 1 == stages);
        let embed = if first {
            Some(Embedding::new(be, "embed", config)?)
        } else {
            None
        };
        let blocks = range
            .clone()
            .map(|i| Block::new(be, i, config))
            .collect::<Result<_>>()?;
        let (final_norm, head) = if last {
            let norm = RmsNorm::new(be, "final_norm", config.d_model, config.norm_eps)?;
            (Some(norm), Some(Head::new(be, "head", config)?))
        } else {
            (None, None)
        };
        let mut chunk = ModelChunk {
            config: config.clone(),
            stage,
            stages,
            range,
            embed,
            blocks,
            final_norm,
            head,
            in_flight: HashMap::new(),
            recompute: Recompute::None,
            block_inputs: HashMap::new(),
            draft_sink: None,
            be: backend,
        };
        // An imported model starts from its directory's weights (this chunk's only), unless
        // the caller overwrites every parameter anyway (a resumed run).
        if let Some(dir) = &config.from
            && !super::init::overwriting()
        {
            super::hf::HfModel::open(dir)
                .and_then(|model| model.load_chunk(&mut chunk))
                .map_err(|e| ModelError::Import(e.to_string()))?;
        }
        Ok(chunk)
    }

    /// Chunk `stage` as [`ModelChunk::new`] builds it, but with placeholder parameters
    /// (zeros; a norm's gain ones) instead of the seeded draws, for a caller that sets every
    /// parameter at once (a resumed rank): see [`super::init::overwritten`].
    pub fn blank(config: &GptConfig, backend: B, cut: &Cut, stage: usize) -> Result<Self> {
        super::init::overwritten(|| Self::new(config, backend, cut, stage))
    }

    pub fn config(&self) -> &GptConfig {
        &self.config
    }
    pub fn backend(&self) -> &B {
        &self.be
    }
    /// Index of this chunk among `stages()`.
    pub fn stage(&self) -> usize {
        self.stage
    }
    pub fn stages(&self) -> usize {
        self.stages
    }
    /// The blocks this chunk holds (global indices).
    pub fn blocks(&self) -> Range<usize> {
        self.range.clone()
    }
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }
    /// Sets (or clears) the buffer into which every training forward of this chunk (one with
    /// targets) copies its final hidden states `[tokens, d_model]` and targets, for the
    /// drafter. Only the last chunk computes them;
    /// the buffer must be for this model's width and vocabulary.
    pub fn set_draft_sink(&mut self, sink: Option<DraftBufferHandle>) -> Result<()> {
        if let Some(s) = &sink {
            if !self.is_last() {
                let reason = "only the last chunk has final hidden states".to_string();
                return Err(self.input_err(0, reason));
            }
            let (d, v) = {
                let b = s.lock();
                (b.d_model(), b.vocab())
            };
            if (d, v) != (self.config.d_model, self.config.vocab) {
                let reason = format!(
                    "draft buffer for d_model {d}, vocab {v}; the model has {}, {}",
                    self.config.d_model, self.config.vocab
                );
                return Err(self.input_err(0, reason));
            }
        }
        self.draft_sink = sink;
        Ok(())
    }

    /// Sets (or clears) the [`crate::model::layers::TokenLoss`] that replaces the mean
    /// cross-entropy of this chunk's training forwards (the last chunk only).
    pub fn set_token_loss(
        &mut self,
        hook: Option<std::sync::Arc<dyn crate::model::layers::TokenLoss>>,
    ) -> Result<()> {
        match &mut self.head {
            Some(head) => {
                head.set_token_loss(hook);
                Ok(())
            }
            None if hook.is_none() => Ok(()),
            None => Err(self.input_err(0, "only the last chunk has a loss".into())),
        }
    }

    /// Sets what this chunk's forwards keep and its I's recompute ([`Recompute`]); only
    /// between steps (no micro-batch in flight), since a micro-batch's I must find what its
    /// F kept.
    pub fn set_recompute(&mut self, recompute: Recompute) -> Result<()> {
        if let Some(&mb) = self.in_flight.keys().next() {
            let reason = "cannot change recomputation while micro-batches are in flight";
            return Err(self.input_err(mb, reason.into()));
        }
        for block in &mut self.blocks {
            block
                .attn
                .set_recompute_core(recompute == Recompute::Selective);
        }
        self.recompute = recompute;
        Ok(())
    }

    /// What this chunk's forwards keep and its I's recompute.
    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// Elements the blocks hold for the micro-batches in flight: from F for I (the block
    /// inputs a `full` chunk keeps included), and from I for W. The embedding's and the
    /// head's stashes are not counted (recomputation leaves them as they are).
    pub fn held(&self) -> Held {
        let inputs = self.block_inputs.values().flatten().map(|x| self.be.len(x));
        let kept = Held {
            for_i: inputs.sum(),
            for_w: 0,
        };
        self.blocks.iter().map(|b| b.held(&self.be)).sum::<Held>() + kept
    }

    /// Micro-batches forwarded whose W has not run yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    fn input_err(&self, mb: usize, reason: String) -> ModelError {
        ModelError::Input {
            stage: self.stage,
            mb,
            reason,
        }
    }

    /// F: runs micro-batch `mb` through the chunk. The first chunk takes
    /// [`ChunkInput::Tokens`], the others [`ChunkInput::Hidden`]; the last chunk takes
    /// `targets` (`[batch, seq]`) and returns the loss, or without targets the logits.
    pub fn forward(
        &mut self,
        mb: usize,
        shape: Shape,
        input: ChunkInput<'_, B>,
        targets: Option<&[u32]>,
    ) -> Result<ChunkOutput<B>> {
        self.forward_with(mb, shape, input, targets, true)
    }

    /// F for evaluation: as [`ModelChunk::forward`], but the head computes only the loss (no
    /// gradient kept for a backward that will not come); discard `mb` afterwards.
    pub fn evaluate(
        &mut self,
        mb: usize,
        shape: Shape,
        input: ChunkInput<'_, B>,
        targets: Option<&[u32]>,
    ) -> Result<ChunkOutput<B>> {
        self.forward_with(mb, shape, input, targets, false)
    }

    fn forward_with(
        &mut self,
        mb: usize,
        shape: Shape,
        input: ChunkInput<'_, B>,
        targets: Option<&[u32]>,
        grad: bool,
    ) -> Result<ChunkOutput<B>> {
        let be = self.be.clone();
        let (d, n) = (self.config.d_model, shape.tokens());
        if self.in_flight.contains_key(&mb) {
            return Err(self.input_err(mb, "this micro-batch is already in flight".into()));
        }
        if shape.seq == 0 || shape.batch == 0 || shape.seq > self.config.seq_len {
            let reason = format!("shape {shape:?} (seq must be 1..={})", self.config.seq_len);
            return Err(self.input_err(mb, reason));
        }
        if targets.is_some() && !self.is_last() {
            return Err(self.input_err(mb, "targets given to a chunk without the head".into()));
        }
        let x = match (input, &mut self.embed) {
            (ChunkInput::Tokens(ids), Some(embed)) => {
                if ids.len() != n {
                    let reason = format!("{} token ids for {} positions", ids.len(), n);
                    return Err(self.input_err(mb, reason));
                }
                embed.forward(&be, mb, ids, shape.batch, shape.seq)?
            }
            (ChunkInput::Hidden(h), None) => {
                if be.len(&h) != n * d {
                    let reason = format!("{} activations, expected {}", be.len(&h), n * d);
                    return Err(self.input_err(mb, reason));
                }
                h
            }
            (ChunkInput::Tokens(_), None) => {
                return Err(
                    self.input_err(mb, "token ids given to a chunk without embedding".into())
                );
            }
            (ChunkInput::Hidden(_), Some(_)) => {
                return Err(self.input_err(mb, "activations given to the first chunk".into()));
            }
        };
        let result = self.forward_blocks(&be, mb, shape, x, targets, grad);
        if result.is_err() {
            self.discard(mb);
        }
        result
    }

    fn forward_blocks(
        &mut self,
        be: &B,
        mb: usize,
        shape: Shape,
        mut x: B::Buf,
        targets: Option<&[u32]>,
        grad: bool,
    ) -> Result<ChunkOutput<B>> {
        self.in_flight.insert(mb, (shape, Phase::Forwarded));
        let full = self.recompute == Recompute::Full;
        let mut inputs = Vec::new();
        for block in &mut self.blocks {
            let y = block.forward(be, mb, &x, shape)?;
            if full {
                // Only the input stays; I runs this forward again.
                block.discard(mb);
                inputs.push(std::mem::replace(&mut x, y));
            } else {
                x = y;
            }
        }
        if full {
            self.block_inputs.insert(mb, inputs);
        }
        let (Some(norm), Some(head)) = (&mut self.final_norm, &mut self.head) else {
            return Ok(ChunkOutput::Hidden(x));
        };
        let h = norm.forward(be, mb, &x, shape)?;
        match targets {
            Some(t) if t.len() != shape.tokens() => {
                let reason = format!("{} targets for {} positions", t.len(), shape.tokens());
                Err(self.input_err(mb, reason))
            }
            Some(t) => {
                let (loss, tokens) = head.forward(be, mb, &h, t, grad)?;
                if let Some(sink) = self.draft_sink.clone() {
                    let hidden = be.to_host(&h)?;
                    sink.push_micro_batch(shape, &hidden, t)
                        .map_err(|e| self.input_err(mb, e.to_string()))?;
                }
                Ok(ChunkOutput::Loss { loss, tokens })
            }
            None => {
                let logits = head.logits(be, &h, shape.tokens())?;
                self.discard(mb);
                Ok(ChunkOutput::Logits(logits))
            }
        }
    }

    /// I: the gradient w.r.t. this chunk's input, from `grad` (the loss scale for the last
    /// chunk, the next stage's gradient otherwise). The first chunk returns `None` (token ids
    /// have no gradient). Computes no weight gradient.
    pub fn backward_input(&mut self, mb: usize, grad: ChunkGrad<B>) -> Result<Option<B::Buf>> {
        let be = self.be.clone();
        let shape = match self.in_flight.get(&mb) {
            Some((shape, Phase::Forwarded)) => *shape,
            Some((_, Phase::InputDone)) => {
                return Err(self.input_err(mb, "backward_input already ran".into()));
            }
            None => return Err(self.order_err(mb, "backward_input", "forward")),
        };
        let n = shape.tokens() * self.config.d_model;
        let mut dy = match (grad, &mut self.head, &mut self.final_norm) {
            (ChunkGrad::Loss(scale), Some(head), Some(norm)) => {
                let dh = head.backward_input(&be, mb, scale)?;
                norm.backward_input(&be, mb, &dh)?
            }
            (ChunkGrad::Hidden(g), None, _) if be.len(&g) == n => g,
            (ChunkGrad::Hidden(g), None, _) => {
                let reason = format!("{} output gradients, expected {n}", be.len(&g));
                return Err(self.input_err(mb, reason));
            }
            (ChunkGrad::Hidden(_), Some(_), _) | (ChunkGrad::Loss(_), _, _) => {
                let reason = "the last chunk starts from ChunkGrad::Loss, the others from Hidden";
                return Err(self.input_err(mb, reason.into()));
            }
        };
        let mut inputs = match self.recompute {
            Recompute::Full => match self.block_inputs.remove(&mb) {
                Some(inputs) if inputs.len() == self.blocks.len() => Some(inputs),
                _ => return Err(self.order_err(mb, "backward_input", "forward")),
            },
            _ => None,
        };
        for block in self.blocks.iter_mut().rev() {
            if let Some(x) = inputs.as_mut().and_then(|i| i.pop()) {
                block.refill(&be, mb, &x, shape)?;
            }
            dy = block.backward_input(&be, mb, &dy)?;
        }
        self.in_flight.insert(mb, (shape, Phase::InputDone));
        match &mut self.embed {
            Some(embed) => {
                embed.backward_input(&be, mb, &dy)?;
                Ok(None)
            }
            None => Ok(Some(dy)),
        }
    }

    /// W: accumulates every weight gradient of micro-batch `mb` and frees its stash.
    pub fn backward_weight(&mut self, mb: usize) -> Result<()> {
        match self.in_flight.get(&mb) {
            Some((_, Phase::InputDone)) => {}
            _ => return Err(self.order_err(mb, "backward_weight", "backward_input")),
        }
        let be = &self.be;
        if let (Some(head), Some(norm)) = (&mut self.head, &mut self.final_norm) {
            head.backward_weight(be, mb)?;
            norm.backward_weight(be, mb)?;
        }
        for block in self.blocks.iter_mut().rev() {
            block.backward_weight(be, mb)?;
        }
        if let Some(embed) = &mut self.embed {
            embed.backward_weight(be, mb)?;
        }
        self.in_flight.remove(&mb);
        Ok(())
    }

    /// B: I then W.
    pub fn backward(&mut self, mb: usize, grad: ChunkGrad<B>) -> Result<Option<B::Buf>> {
        let dx = self.backward_input(mb, grad)?;
        self.backward_weight(mb)?;
        Ok(dx)
    }

    /// Forgets micro-batch `mb` (after an evaluation-only forward, or an aborted step).
    pub fn discard(&mut self, mb: usize) {
        self.in_flight.remove(&mb);
        self.block_inputs.remove(&mb);
        if let Some(e) = &mut self.embed {
            e.discard(mb);
        }
        self.blocks.iter_mut().for_each(|b| b.discard(mb));
        if let Some(n) = &mut self.final_norm {
            n.discard(mb);
        }
        if let Some(h) = &mut self.head {
            h.discard(mb);
        }
    }

    /// Number of layer stashes held, a `full` chunk's kept block inputs counted as one per
    /// micro-batch (0 once every micro-batch's W has run).
    pub fn stashed(&self) -> usize {
        self.block_inputs.len()
            + self.embed.as_ref().map_or(0, |e| e.stashed())
            + self.blocks.iter().map(|b| b.stashed()).sum::<usize>()
            + self.final_norm.as_ref().map_or(0, |n| n.stashed())
            + self.head.as_ref().map_or(0, |h| h.stashed())
    }

    fn order_err(&self, mb: usize, action: &'static str, missing: &'static str) -> ModelError {
        ModelError::Order {
            layer: format!("stage {}", self.stage),
            action,
            mb,
            missing,
        }
    }
}

impl<B: Backend> std::fmt::Debug for ChunkOutput<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChunkOutput::Hidden(_) => f.write_str("Hidden(..)"),
            ChunkOutput::Loss { loss, tokens } => f
                .debug_struct("Loss")
                .field("loss", loss)
                .field("tokens", tokens)
                .finish(),
            ChunkOutput::Logits(_) => f.write_str("Logits(..)"),
        }
    }
}

impl<B: Backend> std::fmt::Debug for ModelChunk<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelChunk")
            .field("stage", &self.stage)
            .field("stages", &self.stages)
            .field("blocks", &self.range)
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}
