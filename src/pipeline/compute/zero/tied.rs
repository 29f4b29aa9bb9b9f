//! A tied embedding under the sharded optimizer.
//!
//! The tied pair's copies take the sum of their gradients after the replicas' sum
//! ([`crate::model::tie`]), and that sum needs each copy's whole table, while a replica's
//! reduce-scatter leaves it only its chunk. So the replicas first all-gather the pair's
//! pieces of their chunks, which puts on each replica bitwise the table the unsharded
//! all-reduce does (the reduce-scatter is its first half, this its second, for these
//! parameters only); the rank then sums the pair as an unsharded one does, and keeps its
//! chunk's piece of the sum. Everything else stays sharded.

use std::collections::BTreeMap;

use super::{Zero, f32s, no_param, shard_err};
use crate::comm::collective::chunk_cut;
use crate::model::{ModelChunk, ModelError};
use crate::pipeline::error::PipelineError;
use crate::tensor::Backend;

impl Zero {
    /// Whether this rank holds a copy of a tied pair.
    pub(in crate::pipeline::compute) fn holds_pair(&self) -> bool {
        self.layout.spans.iter().any(|s| s.pair)
    }

    /// Sets the gradient of each tied copy this rank holds to its replicas' sum, whole,
    /// from every replica's piece of it (after [`Zero::reduce`]). Every replica of the rank
    /// calls it at the same step.
    pub(in crate::pipeline::compute) fn gather_pair<B: Backend>(
        &self,
        rank: usize,
        be: &B,
        chunks: &mut BTreeMap<u32, ModelChunk<B>>,
    ) -> Result<(), PipelineError> {
        let grads = self.chunk_grads(rank)?;
        let own = &self.own;
        let frame: Vec<u8> = (self.layout.pieces(own))
            .filter(|(s, _)| s.pair)
            .flat_map(|(_, r)| &grads[r.start - own.start..r.end - own.start])
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let frames = self
            .sync
            .gather_by_chunk(rank, &frame)
            .map_err(|e| shard_err(rank, "the tied embedding's gather", e))?;
        // Each copy's whole table, filled piece by piece in flat order into its gradient's
        // own buffer (moved out where the backend's buffers are host memory): beside the
        // tables, only the frames are held.
        let mut tables: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        for p in chunks.values_mut().flat_map(|c| c.params_mut()) {
            if self.layout.spans.iter().any(|s| s.pair && s.name == p.name) {
                let empty = be
                    .from_host(&[], be.dtype(&p.grad))
                    .map_err(ModelError::from)?;
                let grad = std::mem::replace(&mut p.grad, empty);
                let table = be.take_host(grad).map_err(ModelError::from)?;
                tables.insert(p.name.clone(), table);
            }
        }
        for (chunk, frame) in chunk_cut(self.layout.len, self.count).iter().zip(frames) {
            let mut values = f32s(&frame);
            let mut expected = 0;
            for (span, r) in self.layout.pieces(chunk).filter(|(s, _)| s.pair) {
                expected += r.len();
                let table = tables.get_mut(&span.name).expect("a pair's table");
                for slot in &mut table[span.local(&r)] {
                    *slot = values.next().unwrap_or(f32::NAN);
                }
            }
            if frame.len() != expected * 4 {
                return Err(PipelineError::Shard {
                    rank,
                    reason: format!(
                        "a replica sent {} bytes of the tied embedding's gradient for values \
                         {chunk:?}, expected {}: the replicas' models differ",
                        frame.len(),
                        expected * 4
                    ),
                });
            }
        }
        for p in chunks.values_mut().flat_map(|c| c.params_mut()) {
            if let Some(table) = tables.remove(&p.name) {
                let dtype = be.dtype(&p.grad);
                p.grad = be.from_host_vec(table, dtype).map_err(ModelError::from)?;
            }
        }
        Ok(())
    }

    /// Takes this replica's pieces of the tied copies' summed gradients (after the pair's
    /// sum) into the chunk the optimizer steps and the norm sums.
    pub(in crate::pipeline::compute) fn keep_pair<B: Backend>(
        &mut self,
        rank: usize,
        be: &B,
        chunks: &BTreeMap<u32, ModelChunk<B>>,
    ) -> Result<(), PipelineError> {
        let own = self.own.clone();
        let grads = self.grads.as_mut().ok_or_else(|| PipelineError::Shard {
            rank,
            reason: "the tied embedding's sum came before the gradients' reduce-scatter".into(),
        })?;
        for (span, r) in self.layout.pieces(&own).filter(|(s, _)| s.pair) {
            let p = (chunks.values().flat_map(|c| c.params()))
                .find(|p| p.name == span.name)
                .ok_or_else(|| no_param(rank, span))?;
            let sum = be.to_host(&p.grad).map_err(ModelError::from)?;
            grads[r.start - own.start..r.end - own.start].copy_from_slice(&sum[span.local(&r)]);
        }
        Ok(())
    }
}
