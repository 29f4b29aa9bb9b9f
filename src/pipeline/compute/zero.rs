//! ZeRO-1, the sharded optimizer (`optimizer.shard = true`): each data-parallel replica of
//! a rank keeps the AdamW state of only its chunk of the rank's parameters.
//!
//! A rank's parameters, concatenated in model order (stages ascending, each stage's in
//! order), form one flat buffer of `len` values; the ring cuts it into `dp` chunks
//! ([`chunk_cut`]), the same cut on every replica, and each replica owns one. A step:
//!
//! 1. the replicas reduce-scatter their gradients: each ends with its chunk summed, bitwise
//!    what the unsharded all-reduce leaves there (the ring's is the all-reduce's first half;
//!    NCCL's is bitwise so at `dp = 2`, a sum of two, and may differ in the last bits
//!    beyond: `comm::nccl_sync`);
//! 2. the gradient norm is summed from **segments**, each parameter's part of one chunk
//!    (tied copies left out): each replica computes its chunk's segments and the replicas
//!    exchange them, so every replica has every segment and sums them in model order. The
//!    unsharded data-parallel path sums the same segments of its all-reduced gradient
//!    ([`replica_sq_norms`]), which is why the two clip by bitwise the same norm;
//! 3. each replica runs AdamW on its chunk only (one piece per parameter it cuts; AdamW is
//!    element-wise, so a piece's update is bitwise the whole parameter's there) and the
//!    replicas all-gather the updated values.
//!
//! Checkpoints keep the unsharded format: when a state is exported the replicas gather
//! their moments on the first replica, the one whose state is saved and handed over
//! ([`Zero::gather_state`]), so a sharded run resumes an unsharded one's checkpoint and the
//! reverse; a resumed replica takes its chunk of the moments ([`Zero::own_state`]).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use super::super::shared::Shared;
use crate::comm::CommError;
use crate::comm::collective::{GradSync, chunk_cut};
use crate::model::ModelError;
use crate::model::{AdamW, ModelChunk, Param};
use crate::pipeline::error::PipelineError;
use crate::tensor::Backend;
use crate::tensor::cpu::kernels;

/// One parameter's place in a rank's flat buffer.
#[derive(Debug, Clone)]
struct Span {
    stage: u32,
    name: String,
    range: Range<usize>,
    /// A tied copy: its gradient is its original's, so the norm leaves it out.
    tied: bool,
    /// One of a tied pair's copies (the embedding or the head's copy of it), whose
    /// gradients are summed after the replicas' ([`Zero::gather_pair`]).
    pair: bool,
}

impl Span {
    /// `r` (a part of this span's range in the flat buffer) within the parameter.
    fn local(&self, r: &Range<usize>) -> Range<usize> {
        r.start - self.range.start..r.end - self.range.start
    }
}

/// A rank's parameters in flat order.
#[derive(Debug, Clone)]
struct Layout {
    spans: Vec<Span>,
    len: usize,
}

impl Layout {
    fn of<B: Backend>(chunks: &BTreeMap<u32, ModelChunk<B>>) -> Self {
        let mut spans = Vec::new();
        let mut start = 0;
        for (&stage, chunk) in chunks {
            let tied_model = chunk.config().tie_embeddings;
            for p in chunk.params() {
                let n = p.numel();
                spans.push(Span {
                    stage,
                    name: p.name.clone(),
                    range: start..start + n,
                    tied: p.tied,
                    pair: p.tied || (tied_model && p.name == crate::model::tie::EMBED),
                });
                start += n;
            }
        }
        Layout { spans, len: start }
    }

    /// Each parameter's part of `chunk` (non-empty only), with its range there.
    fn pieces(&self, chunk: &Range<usize>) -> impl Iterator<Item = (&Span, Range<usize>)> {
        let chunk = chunk.clone();
        (self.spans.iter()).filter_map(move |s| overlap(&s.range, &chunk).map(|r| (s, r)))
    }

    /// `Σ g²` of each segment of `chunk` (tied copies left out), in flat order;
    /// `values` are the chunk's gradient values.
    fn chunk_sq_norms(&self, chunk: &Range<usize>, values: &[f32]) -> Vec<(u32, f64)> {
        self.pieces(chunk)
            .filter(|(s, _)| !s.tied)
            .map(|(s, r)| {
                let part = &values[r.start - chunk.start..r.end - chunk.start];
                (s.stage, kernels::sum_squares(false, part))
            })
            .collect()
    }
}

/// Segments `(stage, Σ g²)` in flat order, as the per-stage lists the step log sums.
fn by_stage(segments: impl IntoIterator<Item = (u32, f64)>) -> Vec<(u32, Vec<f64>)> {
    let mut stages: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    for (stage, q) in segments {
        stages.entry(stage).or_default().push(q);
    }
    stages.into_iter().collect()
}

/// The rank's parameters' values or gradients on the host, in flat order.
pub(super) fn flat<B: Backend>(
    be: &B,
    chunks: &BTreeMap<u32, ModelChunk<B>>,
    grads: bool,
) -> Result<Vec<f32>, PipelineError> {
    // Sized once: grown by doubling it would hold up to twice the values for a moment.
    let len = chunks
        .values()
        .flat_map(|c| c.params())
        .map(|p| p.numel())
        .sum();
    let mut out = Vec::with_capacity(len);
    for p in chunks.values().flat_map(|c| c.params()) {
        let buf = if grads { &p.grad } else { &p.value };
        out.extend(be.to_host(buf).map_err(ModelError::from)?);
    }
    Ok(out)
}

/// The gradient norm's segments of a pipeline without replicas: each parameter's `Σ g²`
/// (tied copies left out), by stage, in model order.
pub(super) fn param_sq_norms<B: Backend>(
    be: &B,
    chunks: &BTreeMap<u32, ModelChunk<B>>,
) -> Result<Vec<(u32, Vec<f64>)>, PipelineError> {
    let mut own = Vec::with_capacity(chunks.len());
    for (&stage, chunk) in chunks {
        let sq = chunk
            .params()
            .into_iter()
            .filter(|p| !p.tied)
            .map(|p| be.sum_squares(&p.grad))
            .collect::<Result<Vec<f64>, _>>()
            .map_err(ModelError::from)?;
        own.push((stage, sq));
    }
    Ok(own)
}

/// The gradient norm's segments of an unsharded replica ([`Shared::sync_grads`]'s summed
/// `grads`, after the tied sum), cut as `count` sharded replicas cut them: the same norm,
/// bitwise, as a sharded run's.
pub(super) fn replica_sq_norms<B: Backend>(
    chunks: &BTreeMap<u32, ModelChunk<B>>,
    grads: &[f32],
    count: usize,
) -> Vec<(u32, Vec<f64>)> {
    let layout = Layout::of(chunks);
    let segments = chunk_cut(layout.len, count)
        .into_iter()
        .flat_map(|c| layout.chunk_sq_norms(&c, &grads[c.clone()]));
    by_stage(segments)
}

/// One rank's share of the sharded optimizer (see the module docs).
pub(super) struct Zero {
    layout: Layout,
    sync: Arc<dyn GradSync>,
    /// The replicas: the flat buffer's cut.
    count: usize,
    /// This replica's chunk of the flat buffer.
    own: Range<usize>,
    /// The first replica: the one whose state is saved and handed over.
    first: bool,
    /// This replica's chunk of the step's summed gradient, from the reduce-scatter to the
    /// step's end (a rolled-back step is redone from it).
    grads: Option<Vec<f32>>,
}

impl Zero {
    /// The sharded optimizer of `rank` over `chunks` when the job shards it among more than
    /// one replica (`None`: every replica keeps the whole state).
    pub(super) fn for_rank<B: Backend>(
        job: &crate::config::JobConfig,
        shared: &Shared,
        rank: usize,
        chunks: &BTreeMap<u32, ModelChunk<B>>,
    ) -> Result<Option<Self>, PipelineError> {
        let Some(replica) = shared.replica().filter(|r| r.count > 1) else {
            return Ok(None);
        };
        if !job.optimizer.shard {
            return Ok(None);
        }
        let layout = Layout::of(chunks);
        let sync = Arc::clone(&replica.sync);
        let own = sync
            .owned(rank, layout.len)
            .map_err(|e| shard_err(rank, "its chunk", e))?;
        Ok(Some(Zero {
            layout,
            sync,
            count: replica.count,
            own,
            first: replica.index == 0,
            grads: None,
        }))
    }

    /// Reduce-scatters the rank's gradients and keeps this replica's chunk of the sum.
    pub(super) fn reduce<B: Backend>(
        &mut self,
        rank: usize,
        be: &B,
        chunks: &BTreeMap<u32, ModelChunk<B>>,
    ) -> Result<(), PipelineError> {
        let mut grads = flat(be, chunks, true)?;
        let own = self
            .sync
            .reduce_scatter(rank, &mut grads)
            .map_err(|e| shard_err(rank, "the gradients' reduce-scatter", e))?;
        if own != self.own {
            return Err(PipelineError::Shard {
                rank,
                reason: format!(
                    "the reduce-scatter summed values {own:?}, this replica owns {:?}",
                    self.own
                ),
            });
        }
        // Only this replica's chunk stays (cut in place: no second copy).
        grads.truncate(own.end);
        grads.drain(..own.start);
        grads.shrink_to_fit();
        self.grads = Some(grads);
        Ok(())
    }

    /// The gradient norm's segments of every replica (by stage, in model order), from the
    /// chunk [`Zero::reduce`] kept: each replica sums its own and the replicas exchange them.
    pub(super) fn sq_norms(&self, rank: usize) -> Result<Vec<(u32, Vec<f64>)>, PipelineError> {
        let own = &self.own;
        let grads = self.chunk_grads(rank)?;
        let mine = self.layout.chunk_sq_norms(own, grads);
        let frame: Vec<u8> = mine.iter().flat_map(|(_, q)| q.to_le_bytes()).collect();
        let frames = self
            .sync
            .gather_by_chunk(rank, &frame)
            .map_err(|e| shard_err(rank, "the gradient norm's exchange", e))?;
        let mut segments = Vec::new();
        for (chunk, frame) in chunk_cut(self.layout.len, self.count).iter().zip(&frames) {
            let stages: Vec<u32> = self
                .layout
                .pieces(chunk)
                .filter(|(s, _)| !s.tied)
                .map(|(s, _)| s.stage)
                .collect();
            if frame.len() != stages.len() * 8 {
                return Err(PipelineError::Shard {
                    rank,
                    reason: format!(
                        "a replica sent {} bytes of gradient norm segments for values \
                         {chunk:?}, expected {} ({} segments): the replicas' models differ",
                        frame.len(),
                        stages.len() * 8,
                        stages.len()
                    ),
                });
            }
            let values = frame
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("chunks of 8")));
            segments.extend(stages.into_iter().zip(values));
        }
        Ok(by_stage(segments))
    }

    /// This replica's chunk of the step's summed gradient ([`Zero::reduce`]'s).
    fn chunk_grads(&self, rank: usize) -> Result<&[f32], PipelineError> {
        self.grads.as_deref().ok_or_else(|| PipelineError::Shard {
            rank,
            reason: "the gradients were used before their reduce-scatter".into(),
        })
    }

    /// AdamW on this replica's chunk (at `lr`, gradients scaled by `clip_scale`) and the
    /// all-gather of the updated values, parameter by parameter: a parameter's values move
    /// to the host, this replica's piece of it is updated there, the other replicas'
    /// updated pieces are copied in, and the values move back. Beside the live state one
    /// parameter's frames and piece are held at a time, never a flat copy of the rank's.
    pub(super) fn step<B: Backend>(
        &self,
        rank: usize,
        (be, optimizer): (&B, &mut AdamW<B>),
        chunks: &mut BTreeMap<u32, ModelChunk<B>>,
        lr: f32,
        clip_scale: f32,
    ) -> Result<(), PipelineError> {
        let grads = self.chunk_grads(rank)?;
        let own = &self.own;
        let cut = chunk_cut(self.layout.len, self.count);
        let mut params: Vec<&mut Param<B>> =
            chunks.values_mut().flat_map(|c| c.params_mut()).collect();
        optimizer.begin_step();
        // The layout lists the rank's parameters in this same order (`Layout::of`).
        if params.len() != self.layout.spans.len() {
            return Err(PipelineError::Shard {
                rank,
                reason: format!(
                    "{} parameters on this rank, {} in its optimizer's layout",
                    params.len(),
                    self.layout.spans.len()
                ),
            });
        }
        for (span, p) in self.layout.spans.iter().zip(params.iter_mut()) {
            if p.name != span.name {
                return Err(no_param(rank, span));
            }
            let dtype = be.dtype(&p.value);
            let empty = be.from_host(&[], dtype).map_err(ModelError::from)?;
            let old = std::mem::replace(&mut p.value, empty);
            let mut value = be.take_host(old).map_err(ModelError::from)?;
            let frame = match overlap(&span.range, own) {
                None => Vec::new(),
                Some(r) => {
                    let local = span.local(&r);
                    let grad = &grads[r.start - own.start..r.end - own.start];
                    let mut piece = Param {
                        name: p.name.clone(),
                        shape: vec![r.len()],
                        value: be
                            .from_host(&value[local.clone()], dtype)
                            .map_err(ModelError::from)?,
                        grad: be
                            .from_host(grad, be.dtype(&p.grad))
                            .map_err(ModelError::from)?,
                        decay: p.decay,
                        tied: p.tied,
                    };
                    optimizer.step_param(be, &mut piece, lr, clip_scale)?;
                    let updated = be.to_host(&piece.value).map_err(ModelError::from)?;
                    value[local].copy_from_slice(&updated);
                    updated.iter().flat_map(|v| v.to_le_bytes()).collect()
                }
            };
            let frames = self
                .sync
                .gather_by_chunk(rank, &frame)
                .map_err(|e| shard_err(rank, "the parameters' all-gather", e))?;
            for (chunk, frame) in cut.iter().zip(frames) {
                let piece = overlap(&span.range, chunk);
                let expected = piece.as_ref().map_or(0, |r| r.len());
                if frame.len() != expected * 4 {
                    return Err(PipelineError::Shard {
                        rank,
                        reason: format!(
                            "a replica sent {} bytes of `{}`'s updated values for values \
                             {chunk:?}, expected {}: the replicas' models differ",
                            frame.len(),
                            span.name,
                            expected * 4
                        ),
                    });
                }
                let Some(r) = piece.filter(|_| chunk != own) else {
                    continue;
                };
                let local = span.local(&r);
                for (slot, v) in value[local].iter_mut().zip(f32s(&frame)) {
                    *slot = v;
                }
            }
            p.value = be.from_host_vec(value, dtype).map_err(ModelError::from)?;
        }
        Ok(())
    }

    /// The step is over: its gradient chunk goes.
    pub(super) fn finish(&mut self) {
        self.grads = None;
    }
}

/// The error of a parameter of the layout the rank does not hold.
fn no_param(rank: usize, span: &Span) -> PipelineError {
    PipelineError::Shard {
        rank,
        reason: format!("no parameter `{}` on this rank", span.name),
    }
}

/// The f32 values of a frame of little-endian bytes (a trailing partial value dropped:
/// callers check the frame's length).
fn f32s(frame: &[u8]) -> impl Iterator<Item = f32> + '_ {
    (frame.chunks_exact(4)).map(|b| f32::from_le_bytes(b.try_into().expect("chunks of 4")))
}

/// The part of `range` inside `chunk`, if any.
fn overlap(range: &Range<usize>, chunk: &Range<usize>) -> Option<Range<usize>> {
    let (lo, hi) = (range.start.max(chunk.start), range.end.min(chunk.end));
    (lo < hi).then_some(lo..hi)
}

fn missing(rank: usize, span: &Span) -> PipelineError {
    PipelineError::Shard {
        rank,
        reason: format!(
            "no optimizer state for `{}` after a step: the replica's moments are incomplete",
            span.name
        ),
    }
}

fn shard_err(rank: usize, what: &str, e: CommError) -> PipelineError {
    PipelineError::Shard {
        rank,
        reason: format!("{what}: {e}"),
    }
}

mod state;
mod tied;

#[cfg(test)]
#[path = "zero_tests.rs"]
mod tests;
