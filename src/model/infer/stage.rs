//! [`InferStage`]: one pipeline stage's share of the GPT for generation: the same
//! arithmetic as [`ModelChunk::forward`](crate::model::ModelChunk::forward), but nothing is
//! stashed for a backward, and attention runs against a [`KvCache`] so that each call only
//! computes the *new* positions of each sequence.
//!
//! One call takes several sequences at once, each with any number of new positions
//! ([`Span`]): a prompt (prefill), one token (decode) or K+1 tokens (speculative
//! verification). Every span first rolls its sequence's cache back to `span.start`, so a
//! verification that rejected draft positions is undone by the next call's span alone.
//! [`InferStage::forward_with`] also takes a [`TreeStep`]: spans holding a draft tree
//! (rows attending to their ancestors only) and the compaction of an earlier tree's cache.
//!
//! On the CPU backend in f32, a call of a few rows (decode, verification) runs its blocks
//! on host slices (the `host` submodule); larger calls (prefill) and other backends run
//! the backend's ops and GEMM.

use std::ops::Range;

use super::attend::{Heads, Visible, attend_span};
use super::kv::KvCache;
use super::rowmul::{Packed, Precision, concat_cols, streams_host_weights};
use super::tree::{RowLayout, TreeStep, layout};
use crate::model::ModelError;
use crate::model::config::Positions;
use crate::model::{Cut, Gpt, GptConfig, ModelChunk, Result};
use crate::tensor::cpu::kernels;
use crate::tensor::{Activation, Backend, DType, Gemm};
use host::{HostBlock, HostHead};

mod host;

/// New positions `start..start + len` of sequence `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub slot: usize,
    pub start: usize,
    pub len: usize,
}

impl Span {
    /// The same positions `start..start + len` of sequences `0..count` (a timed step of a
    /// group whose sequences are all as long).
    pub fn each(count: usize, start: usize, len: usize) -> Vec<Span> {
        (0..count).map(|slot| Span { slot, start, len }).collect()
    }
}

/// What a stage consumes: token ids (first stage) or the previous stage's activations,
/// `[rows, d_model]` with the spans' rows in order.
pub enum StageInput<'a, B: Backend> {
    Tokens(&'a [u32]),
    Hidden(B::Buf),
}

/// What a stage produces.
pub enum StageOutput<B: Backend> {
    /// Activations `[rows, d_model]` for the next stage.
    Hidden(B::Buf),
    /// The last stage: logits `[rows, vocab]` and the final-norm output `[rows, d_model]`
    /// (the LM head's input, the "hidden state" a drafter reads), on the host.
    Final { logits: Vec<f32>, hidden: Vec<f32> },
}

struct InferBlock<B: Backend> {
    norm1: B::Buf,
    /// `[d, d + 2·kv_dim]`: wq, wk, wv side by side, one product for all three projections.
    wqkv: B::Buf,
    /// `[bq | bk | bv]` (`qkv_bias`), added to that product's rows on the host.
    bqkv: Option<Vec<f32>>,
    wo: B::Buf,
    norm2: B::Buf,
    w1: B::Buf,
    w2: B::Buf,
    /// The up projection of the gated MLP (`activation = "swiglu"`).
    w3: Option<B::Buf>,
    /// Host copies for the host path (host backend only).
    host: Option<HostBlock>,
}

/// Blocks `range` of the model (plus the embedding on the first stage, the final norm and
/// head on the last), with their KV cache.
pub struct InferStage<B: Backend> {
    be: B,
    config: GptConfig,
    range: Range<usize>,
    /// `embed.tok` and, with learned positions, `embed.pos`.
    embed: Option<(B::Buf, Option<B::Buf>)>,
    /// The RoPE frequencies, when positions are rotary.
    rope: Option<Vec<f32>>,
    blocks: Vec<InferBlock<B>>,
    head: Option<(B::Buf, B::Buf)>,
    /// Host copies of the final norm and the head (host backend only).
    head_host: Option<HostHead>,
    cache: KvCache,
}

impl<B: Backend> InferStage<B> {
    /// The stage holding blocks `range`, with parameters read by name from `get` (host
    /// values, e.g. [`ModelChunk::param_values`] or [`Gpt::param_values`]).
    pub fn build(
        be: B,
        config: &GptConfig,
        range: Range<usize>,
        first: bool,
        last: bool,
        get: impl Fn(&str) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        config.validate()?;
        let dt = be.storage_dtype();
        let load = |name: &str| -> Result<B::Buf> { Ok(be.from_host(&get(name)?, dt)?) };
        let (d, kv, hidden) = (config.d_model, config.kv_dim(), config.mlp_hidden());
        let gated = config.activation.is_gated();
        // Few-row products stream host weights (see `rowmul`) where the backend's buffers
        // are host memory in f32 anyway; a device backend keeps its own GEMM.
        let host = streams_host_weights(&be);
        let embed = if first {
            let pos = match config.positions {
                Positions::Learned => Some(load("embed.pos")?),
                Positions::Rope => None,
            };
            Some((load("embed.tok")?, pos))
        } else {
            None
        };
        let mut blocks = Vec::with_capacity(range.len());
        for i in range.clone() {
            let p = format!("blocks.{i}");
            let (wq, wk, wv) = (
                get(&format!("{p}.attn.wq"))?,
                get(&format!("{p}.attn.wk"))?,
                get(&format!("{p}.attn.wv"))?,
            );
            let wqkv = concat_cols(&[&wq, &wk, &wv], d);
            let bqkv = if config.qkv_bias {
                let b = |w: &str| get(&format!("{p}.attn.{w}"));
                Some([b("bq")?, b("bk")?, b("bv")?].concat())
            } else {
                None
            };
            let (wo, w1, w2) = (
                get(&format!("{p}.attn.wo"))?,
                get(&format!("{p}.mlp.w1"))?,
                get(&format!("{p}.mlp.w2"))?,
            );
            let w3 = if gated {
                Some(get(&format!("{p}.mlp.w3"))?)
            } else {
                None
            };
            let (norm1, norm2) = (
                get(&format!("{p}.norm1.weight"))?,
                get(&format!("{p}.norm2.weight"))?,
            );
            blocks.push(InferBlock {
                norm1: be.from_host(&norm1, dt)?,
                wqkv: be.from_host(&wqkv, dt)?,
                bqkv,
                wo: be.from_host(&wo, dt)?,
                norm2: be.from_host(&norm2, dt)?,
                w1: be.from_host(&w1, dt)?,
                w2: be.from_host(&w2, dt)?,
                w3: w3.as_ref().map(|w| be.from_host(w, dt)).transpose()?,
                host: host.then(|| {
                    // The gated MLP's gate and up side by side: one product for both.
                    let (w13, width) = match &w3 {
                        Some(w3) => (concat_cols(&[&w1, w3], d), 2 * hidden),
                        None => (w1.clone(), hidden),
                    };
                    HostBlock {
                        norm1,
                        norm2,
                        w: [
                            Packed::new(&wqkv, d, d + 2 * kv),
                            Packed::new(&wo, d, d),
                            Packed::new(&w13, d, width),
                            Packed::new(&w2, hidden, d),
                        ],
                    }
                }),
            });
        }
        let (head, head_host) = if last {
            let (w, norm) = (get("head.w")?, get("final_norm.weight")?);
            let buf = be.from_host(&w, dt)?;
            // `head.w: [vocab, d]` is the head's `[d, vocab]` transposed.
            let packed = host
                .then(|| Packed::with_precision_transposed(&w, d, config.vocab, Precision::F32))
                .transpose()?;
            (
                Some((be.from_host(&norm, dt)?, buf)),
                packed.map(|w| HostHead { norm, w }),
            )
        } else {
            (None, None)
        };
        Ok(InferStage {
            cache: KvCache::new(range.len(), kv, config.seq_len),
            config: config.clone(),
            range,
            embed,
            rope: (config.positions == Positions::Rope).then(|| config.rope_inv_freq()),
            blocks,
            head,
            head_host,
            be,
        })
    }

    /// The inference twin of a training chunk (same blocks, same parameter values).
    pub fn from_chunk(chunk: &ModelChunk<B>) -> Result<Self> {
        InferStage::build(
            chunk.backend().clone(),
            chunk.config(),
            chunk.blocks(),
            chunk.is_first(),
            chunk.is_last(),
            |n| chunk.param_values(n),
        )
    }

    /// The stages of `gpt` cut by `cut` (any cut, independent of how `gpt` is chunked).
    pub fn stages_of(gpt: &Gpt<B>, cut: &Cut) -> Result<Vec<Self>> {
        let config = gpt.config();
        let ranges = cut.ranges(config.layers)?;
        let be = gpt.chunks()[0].backend().clone();
        let n = ranges.len();
        ranges
            .into_iter()
            .enumerate()
            .map(|(s, r)| {
                InferStage::build(be.clone(), config, r, s == 0, s + 1 == n, |name| {
                    gpt.param_values(name)
                })
            })
            .collect()
    }

    pub fn config(&self) -> &GptConfig {
        &self.config
    }
    pub fn backend(&self) -> &B {
        &self.be
    }
    /// Global indices of this stage's blocks.
    pub fn blocks(&self) -> Range<usize> {
        self.range.clone()
    }
    pub fn is_first(&self) -> bool {
        self.embed.is_some()
    }
    pub fn is_last(&self) -> bool {
        self.head.is_some()
    }
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }
    /// Forgets the cache of a finished sequence.
    pub fn release(&mut self, slot: usize) {
        self.cache.remove(slot);
    }

    fn input_err(&self, reason: String) -> ModelError {
        ModelError::Input {
            stage: self.range.start,
            mb: 0,
            reason,
        }
    }

    /// Runs the new positions of `spans` through this stage, extending their caches (after
    /// rolling each back to its `span.start`).
    pub fn forward(&mut self, spans: &[Span], input: StageInput<'_, B>) -> Result<StageOutput<B>> {
        self.forward_with(spans, None, input)
    }

    /// [`InferStage::forward`] where `tree` may shape some spans as draft trees and compact
    /// caches first (see [`super::tree`]). Nothing changes in the caches when it fails.
    pub fn forward_with(
        &mut self,
        spans: &[Span],
        tree: Option<&TreeStep>,
        input: StageInput<'_, B>,
    ) -> Result<StageOutput<B>> {
        let be = self.be.clone();
        let d = self.config.d_model;
        let rows: usize = spans.iter().map(|s| s.len).sum();
        let empty = TreeStep::default();
        let tree = tree.unwrap_or(&empty);
        let lens: Vec<usize> = spans.iter().map(|s| s.len).collect();
        if let Some(reason) = tree.check(&lens) {
            return Err(self.input_err(reason));
        }
        for c in &tree.compact {
            if let Some(reason) = self.cache.compact_error(c.slot, c.start, &c.keep) {
                return Err(self.input_err(reason));
            }
        }
        // What each sequence's cache holds once compacted.
        let held = |slot: usize| {
            tree.compact
                .iter()
                .rev()
                .find(|c| c.slot == slot)
                .map_or(self.cache.len(slot), |c| c.start + c.keep.len())
        };
        for s in spans {
            if s.len == 0 || s.start + s.len > self.config.seq_len {
                return Err(self.input_err(format!(
                    "sequence {}: positions {}..{} (at most {} positions, at least one new)",
                    s.slot,
                    s.start,
                    s.start + s.len,
                    self.config.seq_len
                )));
            }
            if held(s.slot) < s.start {
                return Err(self.input_err(format!(
                    "sequence {} resumes at {} but its cache holds {} positions",
                    s.slot,
                    s.start,
                    held(s.slot)
                )));
            }
        }
        let layouts: Vec<Option<RowLayout>> = (0..spans.len())
            .map(|i| tree.tree(i).map(|p| layout(Some(p), spans[i].len)))
            .collect();
        let mut x = match (input, &self.embed) {
            (StageInput::Tokens(ids), Some((tok, pos))) => {
                if ids.len() != rows {
                    return Err(self.input_err(format!("{} ids for {rows} rows", ids.len())));
                }
                let positions: Vec<u32> = spans
                    .iter()
                    .zip(&layouts)
                    .flat_map(|(s, l)| {
                        (0..s.len)
                            .map(move |r| (s.start + l.as_ref().map_or(r, |l| l.depth[r])) as u32)
                    })
                    .collect();
                if let Some(&t) = ids.iter().find(|&&t| t as usize >= self.config.vocab) {
                    return Err(self.input_err(format!(
                        "token {t} is outside the vocabulary of {}",
                        self.config.vocab
                    )));
                }
                let mut x = be.zeros(rows * d, be.storage_dtype())?;
                be.embedding_fwd(tok, ids, &mut x, d)?;
                if let Some(pos) = pos {
                    let mut p = be.zeros(rows * d, be.storage_dtype())?;
                    be.embedding_fwd(pos, &positions, &mut p, d)?;
                    be.axpy(1.0, &p, &mut x)?;
                }
                x
            }
            (StageInput::Hidden(h), None) if be.len(&h) == rows * d => h,
            (StageInput::Hidden(h), None) => {
                let got = be.len(&h);
                return Err(self.input_err(format!("{got} activations for {rows} rows")));
            }
            (StageInput::Tokens(_), None) => {
                return Err(self.input_err("token ids given to a stage without embedding".into()));
            }
            (StageInput::Hidden(_), Some(_)) => {
                return Err(self.input_err("activations given to the first stage".into()));
            }
        };
        // Roll back only once every span is known to be valid, so an error leaves the
        // caches as they were.
        for c in &tree.compact {
            self.cache.compact(c.slot, c.start, &c.keep)?;
        }
        for s in spans {
            self.cache.truncate(s.slot, s.start)?;
        }
        if self.host_path(rows) {
            return self.forward_host(spans, &layouts, &be.to_host(&x)?, rows);
        }
        for li in 0..self.blocks.len() {
            x = self.block_forward(li, spans, &layouts, &x, rows)?;
        }
        let Some((norm, head)) = &self.head else {
            return Ok(StageOutput::Hidden(x));
        };
        let h = self.rmsnorm(&x, norm, rows)?;
        let vocab = self.config.vocab;
        let hidden = be.to_host(&h)?;
        let mut logits = be.zeros(rows * vocab, DType::F32)?;
        be.matmul(&h, head, &mut logits, Gemm::nn(rows, d, vocab).trans_b())?;
        let logits = be.to_host(&logits)?;
        Ok(StageOutput::Final { logits, hidden })
    }

    fn rmsnorm(&self, x: &B::Buf, w: &B::Buf, rows: usize) -> Result<B::Buf> {
        let be = &self.be;
        let d = self.config.d_model;
        let mut y = be.zeros(rows * d, be.storage_dtype())?;
        let mut rstd = be.zeros(rows, DType::F32)?;
        be.rmsnorm_fwd(x, w, &mut y, &mut rstd, rows, d, self.config.norm_eps)?;
        Ok(y)
    }

    /// `x·w` on the backend's GEMM, `w` being block matrix `which` (0 wqkv, 1 wo, 2 w1, 3
    /// w2, 4 w3) of `li` (a few rows on a host backend take the host path instead).
    fn linear(
        &self,
        x: &B::Buf,
        (li, which): (usize, usize),
        rows: usize,
        din: usize,
        dout: usize,
    ) -> Result<B::Buf> {
        let blk = &self.blocks[li];
        let w = match which {
            0 => &blk.wqkv,
            1 => &blk.wo,
            2 => &blk.w1,
            3 => &blk.w2,
            _ => blk.w3.as_ref().expect("w3 only for a gated MLP"),
        };
        let mut y = self.be.zeros(rows * dout, self.be.storage_dtype())?;
        self.be.matmul(x, w, &mut y, Gemm::nn(rows, din, dout))?;
        Ok(y)
    }

    /// `x + Attn(RMSNorm(x))`, then `h + MLP(RMSNorm(h))`, with the attention of each new
    /// position over its sequence's cache.
    fn block_forward(
        &mut self,
        li: usize,
        spans: &[Span],
        layouts: &[Option<RowLayout>],
        x: &B::Buf,
        rows: usize,
    ) -> Result<B::Buf> {
        let be = self.be.clone();
        let (d, kv) = (self.config.d_model, self.config.kv_dim());
        let blk = &self.blocks[li];
        let a = self.rmsnorm(x, &blk.norm1, rows)?;
        let qkv = be.to_host(&self.linear(&a, (li, 0), rows, d, d + 2 * kv)?)?;
        let o = self.attention(li, spans, layouts, &qkv)?;
        let blk = &self.blocks[li];
        let o = be.from_host(&o, be.storage_dtype())?;
        let y = self.linear(&o, (li, 1), rows, d, d)?;
        let mut h = be.zeros(rows * d, be.storage_dtype())?;
        be.add(x, &y, &mut h)?;
        let c = self.rmsnorm(&h, &blk.norm2, rows)?;
        let hidden = self.config.mlp_hidden();
        let u = self.linear(&c, (li, 2), rows, d, hidden)?;
        let mut g = be.zeros(rows * hidden, be.storage_dtype())?;
        be.activation_fwd(self.activation(), &u, &mut g)?;
        if self.blocks[li].w3.is_some() {
            // SwiGLU: silu(x·W1) ∘ (x·W3), as the training MLP computes it.
            let up = self.linear(&c, (li, 4), rows, d, hidden)?;
            let mut gu = be.zeros(rows * hidden, be.storage_dtype())?;
            be.mul(&g, &up, &mut gu)?;
            g = gu;
        }
        let z = self.linear(&g, (li, 3), rows, hidden, d)?;
        let mut out = be.zeros(rows * d, be.storage_dtype())?;
        be.add(&h, &z, &mut out)?;
        Ok(out)
    }

    /// Appends the keys and values of `qkv` (`[rows, d + 2·kv_dim]`, the spans' rows in
    /// order: the projections before their biases and rotation) to layer `li`'s cache and
    /// returns each row's attention over its sequence, `[rows, d]`. The biases are added
    /// and, with rotary positions, queries and keys rotated at each row's absolute position
    /// (`start + depth` for a tree row) before the keys enter the cache.
    fn attention(
        &mut self,
        li: usize,
        spans: &[Span],
        layouts: &[Option<RowLayout>],
        qkv: &[f32],
    ) -> Result<Vec<f32>> {
        let (d, kvd) = (self.config.d_model, self.config.kv_dim());
        let heads = Heads {
            q: self.config.heads,
            kv: self.config.kv_heads(),
        };
        let hd = self.config.head_dim();
        let width = d + 2 * kvd;
        let rows = qkv.len() / width;
        let mut qkv = qkv.to_vec();
        if let Some(b) = &self.blocks[li].bqkv {
            for row in qkv.chunks_exact_mut(width) {
                row.iter_mut().zip(b).for_each(|(x, &b)| *x += b);
            }
        }
        if let Some(freq) = &self.rope {
            let mut r0 = 0;
            let mut rotated = vec![0.0f32; d];
            for (s, layout) in spans.iter().zip(layouts) {
                for r in 0..s.len {
                    let pos = [(s.start + layout.as_ref().map_or(r, |l| l.depth[r])) as u32];
                    let row = &mut qkv[(r0 + r) * width..][..d + kvd];
                    let (q, k) = row.split_at_mut(d);
                    kernels::rope(q, &mut rotated, &pos, hd, freq, false);
                    q.copy_from_slice(&rotated);
                    kernels::rope(k, &mut rotated[..kvd], &pos, hd, freq, false);
                    k.copy_from_slice(&rotated[..kvd]);
                }
                r0 += s.len;
            }
        }
        let mut o = vec![0.0f32; rows * d];
        let mut r0 = 0;
        let mut scores = Vec::new();
        let (mut k, mut v, mut qs) = (Vec::new(), Vec::new(), Vec::new());
        for (s, layout) in spans.iter().zip(layouts) {
            k.clear();
            v.clear();
            qs.clear();
            for r in 0..s.len {
                let row = &qkv[(r0 + r) * width..][..width];
                qs.extend_from_slice(&row[..d]);
                k.extend_from_slice(&row[d..d + kvd]);
                v.extend_from_slice(&row[d + kvd..]);
            }
            self.cache.append(s.slot, li, &k, &v)?;
            let (kc, vc) = self.cache.layer(s.slot, li);
            // A chain's row sees the cache up to itself; a tree row the prefix, its
            // ancestors and itself.
            let extras: Vec<Vec<usize>> = match layout {
                None => Vec::new(),
                Some(l) => (0..s.len)
                    .map(|r| l.sees[r].iter().map(|&a| s.start + a).collect())
                    .collect(),
            };
            let visible: Vec<Visible<'_>> = (0..s.len)
                .map(|r| match layout {
                    None => (s.start + r + 1, &[][..]),
                    Some(_) => (s.start, extras[r].as_slice()),
                })
                .collect();
            let out = &mut o[r0 * d..][..s.len * d];
            attend_span(&qs, kc, vc, &visible, heads, &mut scores, out);
            r0 += s.len;
        }
        Ok(o)
    }

    fn activation(&self) -> Activation {
        self.config.activation
    }
}

/// Runs `spans` (token ids `ids`, rows in span order) through every stage in turn, on the
/// calling thread; returns the last stage's `(logits, hidden)`.
pub fn run_stages<B: Backend>(
    stages: &mut [InferStage<B>],
    spans: &[Span],
    ids: &[u32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut input = StageInput::Tokens(ids);
    for stage in stages.iter_mut() {
        match stage.forward(spans, input)? {
            StageOutput::Hidden(h) => input = StageInput::Hidden(h),
            StageOutput::Final { logits, hidden } => return Ok((logits, hidden)),
        }
    }
    Err(ModelError::Input {
        stage: stages.len(),
        mb: 0,
        reason: "no stage holds the LM head".into(),
    })
}
