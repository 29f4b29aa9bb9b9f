//! The sharded optimizer's whole state: gathered onto the first replica for a checkpoint
//! or a hand-over, and cut back into a replica's chunk on resume.

use std::collections::BTreeMap;
use std::ops::Range;

use super::{Span, Zero, f32s, missing, shard_err};
use crate::comm::collective::chunk_cut;
use crate::model::{AdamW, ModelChunk, OptimizerState, SlotPart, SlotState};
use crate::pipeline::error::PipelineError;
use crate::tensor::{Backend, DType};

impl Zero {
    /// The whole optimizer state on the first replica, gathered from every replica's chunk
    /// (the unsharded run's state, bitwise); the other replicas send their chunk and get the
    /// state without moments (only the first replica's state is saved or handed over).
    /// Every replica must call it at the same step. One part (m, v, master) of one chunk
    /// crosses at a time, and each is read off the device as it is sent, so the first
    /// replica holds the whole state and one chunk of one part besides, the others one chunk
    /// of one part.
    pub(in crate::pipeline::compute) fn gather_state<B: Backend>(
        &self,
        rank: usize,
        be: &B,
        optimizer: &AdamW<B>,
        chunks: &BTreeMap<u32, ModelChunk<B>>,
    ) -> Result<OptimizerState, PipelineError> {
        let step = optimizer.steps();
        let mut state = OptimizerState {
            step,
            slots: BTreeMap::new(),
        };
        // No step taken (on every replica alike): no moments yet.
        if step == 0 {
            return Ok(state);
        }
        let master: Vec<bool> = chunks
            .values()
            .flat_map(|c| c.params())
            .map(|p| be.dtype(&p.value) != DType::F32)
            .collect();
        let index: std::collections::HashMap<&str, usize> = (self.layout.spans.iter())
            .enumerate()
            .map(|(i, s)| (s.name.as_str(), i))
            .collect();
        let parts: &[SlotPart] = match master.iter().any(|&m| m) {
            true => &[SlotPart::M, SlotPart::V, SlotPart::Master],
            false => &[SlotPart::M, SlotPart::V],
        };
        // This replica's piece of `span`'s `part`.
        let piece = |span: &Span, r: &Range<usize>, part| -> Result<Vec<f32>, PipelineError> {
            let values = optimizer
                .slot_part(be, &span.name, part)?
                .ok_or_else(|| missing(rank, span))?;
            if values.len() != r.len() {
                return Err(PipelineError::Shard {
                    rank,
                    reason: format!(
                        "`{}` has {} optimizer values, its piece of this replica's chunk {}",
                        span.name,
                        values.len(),
                        r.len()
                    ),
                });
            }
            Ok(values)
        };
        let wanted =
            |span: &Span, part| part != SlotPart::Master || master[index[span.name.as_str()]];
        // (m, v, master) of every parameter, filled on the first replica.
        let mut whole: Vec<[Vec<f32>; 3]> = Vec::new();
        for (k, &part) in parts.iter().enumerate() {
            if !self.first {
                let mut frame = Vec::new();
                for (span, r) in self.layout.pieces(&self.own) {
                    if wanted(span, part) {
                        let values = piece(span, &r, part)?;
                        frame.extend(values.iter().flat_map(|v| v.to_le_bytes()));
                    }
                }
                self.sync
                    .gather_to_first(rank, &frame)
                    .map_err(|e| shard_err(rank, "the optimizer state's gather", e))?;
                continue;
            }
            let frames = self
                .sync
                .gather_to_first(rank, &[])
                .map_err(|e| shard_err(rank, "the optimizer state's gather", e))?
                .ok_or_else(|| PipelineError::Shard {
                    rank,
                    reason: "the first replica was not handed the others' optimizer state".into(),
                })?;
            whole.resize_with(self.layout.spans.len(), Default::default);
            for (i, span) in self.layout.spans.iter().enumerate() {
                if wanted(span, part) {
                    whole[i][k] = vec![0.0; span.range.len()];
                }
            }
            for (chunk, frame) in chunk_cut(self.layout.len, self.count).iter().zip(&frames) {
                let own = *chunk == self.own;
                let mut values = f32s(frame);
                let mut expected = 0;
                for (span, r) in self.layout.pieces(chunk) {
                    if !wanted(span, part) {
                        continue;
                    }
                    let i = index[span.name.as_str()];
                    let local = span.local(&r);
                    if own {
                        whole[i][k][local].copy_from_slice(&piece(span, &r, part)?);
                        continue;
                    }
                    expected += r.len();
                    for slot in &mut whole[i][k][local] {
                        *slot = values.next().unwrap_or(f32::NAN);
                    }
                }
                if !own && frame.len() != expected * 4 {
                    return Err(PipelineError::Shard {
                        rank,
                        reason: format!(
                            "a replica sent {} bytes of optimizer state for values {chunk:?}, \
                             expected {}: the replicas' models differ",
                            frame.len(),
                            expected * 4
                        ),
                    });
                }
            }
        }
        for ((span, [m, v, w]), master) in self.layout.spans.iter().zip(whole).zip(&master) {
            let master = master.then_some(w);
            state
                .slots
                .insert(span.name.clone(), SlotState { m, v, master });
        }
        Ok(state)
    }

    /// This replica's chunk of a whole optimizer `state` (a checkpoint's): each parameter's
    /// moments cut to its piece of the chunk; parameters without state stay without. A
    /// parameter whose moments are not its size is an error naming it.
    pub(in crate::pipeline::compute) fn own_state(
        &self,
        rank: usize,
        state: &OptimizerState,
    ) -> Result<OptimizerState, PipelineError> {
        let mut slots = BTreeMap::new();
        for (span, r) in self.layout.pieces(&self.own) {
            let Some(slot) = state.slots.get(&span.name) else {
                continue;
            };
            let size = span.range.len();
            let sizes = [Some(slot.m.len()), Some(slot.v.len())];
            let master = slot.master.as_ref().map(Vec::len);
            if sizes
                .into_iter()
                .chain([master])
                .flatten()
                .any(|n| n != size)
            {
                return Err(PipelineError::Shard {
                    rank,
                    reason: format!(
                        "the optimizer state of `{}` holds {} moments, the parameter {size} \
                         values",
                        span.name,
                        slot.m.len()
                    ),
                });
            }
            let local = span.local(&r);
            let cut = |v: &Vec<f32>| v[local.clone()].to_vec();
            let piece = SlotState {
                m: cut(&slot.m),
                v: cut(&slot.v),
                master: slot.master.as_ref().map(cut),
            };
            slots.insert(span.name.clone(), piece);
        }
        Ok(OptimizerState {
            step: state.step,
            slots,
        })
    }
}
