//! [`KvCache`]: the keys and values of every past position of every live sequence, per
//! layer of one stage.
//!
//! The cache is kept on the host as `f32`: the attention of a few new positions against a
//! cache is a handful of short dot products per head, cheaper to run in place than to lay
//! out for a batched device product (DESIGN.md keeps the projections on the backend).
//! Speculative decoding appends the K+1 verified positions and then *rolls back* the
//! rejected ones with [`KvCache::truncate`]; a truncated cache is indistinguishable from
//! one that never saw those positions. A draft tree's verification appends every node and
//! [`KvCache::compact`] then keeps only the accepted path, moved to consecutive positions.

use std::collections::HashMap;

use crate::model::ModelError;
use crate::model::Result;

/// The cache of one sequence: per layer, `len` rows of keys and values, `d_model` wide.
#[derive(Clone, Debug, Default)]
struct SlotCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

/// Keys and values of `layers` layers for any number of sequences ("slots").
#[derive(Clone, Debug)]
pub struct KvCache {
    layers: usize,
    width: usize,
    capacity: usize,
    slots: HashMap<usize, SlotCache>,
}

impl KvCache {
    /// An empty cache of `layers` layers, rows of `width` values, at most `capacity`
    /// positions per sequence (the model's learned positions).
    pub fn new(layers: usize, width: usize, capacity: usize) -> Self {
        KvCache {
            layers,
            width,
            capacity,
            slots: HashMap::new(),
        }
    }

    /// Cached positions of `slot` (0 for a slot never seen).
    pub fn len(&self, slot: usize) -> usize {
        self.slots.get(&slot).map_or(0, |s| s.len)
    }

    /// Whether no sequence holds any position.
    pub fn is_empty(&self) -> bool {
        self.slots.values().all(|s| s.len == 0)
    }

    /// Number of sequences holding a cache.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Keeps the first `len` positions of `slot` (rollback of rejected positions). Asking to
    /// keep more than is cached is an error: the positions in between were never computed.
    pub fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        let have = self.len(slot);
        if len > have {
            return Err(ModelError::Input {
                stage: 0,
                mb: slot,
                reason: format!(
                    "KV cache of sequence {slot} holds {have} positions, cannot resume at {len}"
                ),
            });
        }
        if let Some(s) = self.slots.get_mut(&slot) {
            let keep = len * self.width;
            s.keys.iter_mut().for_each(|k| k.truncate(keep));
            s.values.iter_mut().for_each(|v| v.truncate(keep));
            s.len = len;
        }
        Ok(())
    }

    /// Why [`KvCache::compact`] of `slot` would fail, or `None`.
    pub fn compact_error(&self, slot: usize, start: usize, keep: &[usize]) -> Option<String> {
        let have = self.len(slot);
        let increasing = keep.windows(2).all(|w| w[0] < w[1]);
        match keep.last() {
            _ if !increasing => Some(format!("rows {keep:?} to keep are not increasing")),
            Some(&last) if start + last >= have => Some(format!(
                "KV cache of sequence {slot} holds {have} positions, cannot keep row {last} \
                 after {start}"
            )),
            _ if start > have => Some(format!(
                "KV cache of sequence {slot} holds {have} positions, cannot compact from {start}"
            )),
            _ => None,
        }
    }

    /// Keeps positions `0..start` of `slot`, then its rows `start + keep[j]` moved to
    /// `start + j` (`keep` increasing), and drops the rest: a verified draft tree's
    /// accepted path made consecutive, as if only it had been decoded. The chain's rollback
    /// is the case `keep = 0..n`.
    pub fn compact(&mut self, slot: usize, start: usize, keep: &[usize]) -> Result<()> {
        if let Some(reason) = self.compact_error(slot, start, keep) {
            return Err(ModelError::Input {
                stage: 0,
                mb: slot,
                reason,
            });
        }
        let w = self.width;
        if let Some(s) = self.slots.get_mut(&slot) {
            for buf in s.keys.iter_mut().chain(s.values.iter_mut()) {
                for (j, &r) in keep.iter().enumerate() {
                    // `keep` increases, so a row moves down over rows already moved.
                    buf.copy_within((start + r) * w..(start + r + 1) * w, (start + j) * w);
                }
                buf.truncate((start + keep.len()) * w);
            }
            s.len = start + keep.len();
        }
        Ok(())
    }

    /// Appends `rows` new positions of `layer` to `slot`. Every layer must append the same
    /// rows; the slot's length advances when the last layer has appended.
    pub fn append(
        &mut self,
        slot: usize,
        layer: usize,
        keys: &[f32],
        values: &[f32],
    ) -> Result<()> {
        let (layers, width, capacity) = (self.layers, self.width, self.capacity);
        let bad = |reason: String| ModelError::Input {
            stage: 0,
            mb: slot,
            reason,
        };
        if layer >= layers || keys.len() != values.len() || !keys.len().is_multiple_of(width) {
            return Err(bad(format!(
                "append to layer {layer} of {layers}: {} keys and {} values for rows of {width}",
                keys.len(),
                values.len()
            )));
        }
        let s = self.slots.entry(slot).or_insert_with(|| SlotCache {
            keys: vec![Vec::new(); layers],
            values: vec![Vec::new(); layers],
            len: 0,
        });
        let rows = keys.len() / width;
        let behind = layer > 0 && s.keys[layer - 1].len() < (s.len + rows) * width;
        if s.keys[layer].len() != s.len * width || behind {
            return Err(bad(format!(
                "layer {layer} appended out of turn (cache at {} positions)",
                s.len
            )));
        }
        if s.len + rows > capacity {
            return Err(bad(format!(
                "{} positions exceed the {capacity} the model has",
                s.len + rows
            )));
        }
        s.keys[layer].extend_from_slice(keys);
        s.values[layer].extend_from_slice(values);
        if layer + 1 == layers {
            s.len += rows;
        }
        Ok(())
    }

    /// Keys and values `[len, width]` of `layer` for `slot`, including rows appended to
    /// this layer but not yet to the later ones.
    pub fn layer(&self, slot: usize, layer: usize) -> (&[f32], &[f32]) {
        match self.slots.get(&slot) {
            Some(s) => (&s.keys[layer], &s.values[layer]),
            None => (&[], &[]),
        }
    }

    /// Forgets `slot` entirely (its sequence finished).
    pub fn remove(&mut self, slot: usize) {
        self.slots.remove(&slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_then_truncate_keeps_the_prefix() {
        let mut c = KvCache::new(2, 2, 8);
        for layer in 0..2 {
            c.append(7, layer, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0])
                .unwrap();
        }
        assert_eq!(c.len(7), 2);
        c.truncate(7, 1).unwrap();
        assert_eq!(c.len(7), 1);
        assert_eq!(c.layer(7, 1), (&[1.0, 2.0][..], &[5.0, 6.0][..]));
        assert!(c.truncate(7, 2).is_err(), "cannot resume past the cache");
    }

    #[test]
    fn compact_keeps_the_chosen_rows_in_order() {
        let mut c = KvCache::new(2, 1, 8);
        for layer in 0..2 {
            let k: Vec<f32> = (0..6).map(|i| (10 * layer + i) as f32).collect();
            c.append(1, layer, &k, &k).unwrap();
        }
        c.compact(1, 2, &[0, 2, 3]).unwrap();
        assert_eq!(c.len(1), 5);
        assert_eq!(c.layer(1, 1).0, &[10.0, 11.0, 12.0, 14.0, 15.0][..]);
        assert_eq!(c.layer(1, 0).1, &[0.0, 1.0, 2.0, 4.0, 5.0][..]);
        assert!(c.compact(1, 2, &[1, 0]).is_err(), "not increasing");
        assert!(c.compact(1, 2, &[3]).is_err(), "past the cache");
        assert_eq!(c.len(1), 5, "a refused compaction changes nothing");
    }

    #[test]
    fn bad_appends_are_errors() {
        let mut c = KvCache::new(2, 2, 2);
        assert!(c.append(0, 2, &[1.0, 2.0], &[1.0, 2.0]).is_err());
        assert!(c.append(0, 0, &[1.0], &[1.0]).is_err());
        assert!(
            c.append(0, 1, &[1.0, 2.0], &[1.0, 2.0]).is_err(),
            "layer 0 first"
        );
        c.append(0, 0, &[1.0; 4], &[1.0; 4]).unwrap();
        c.append(0, 1, &[1.0; 4], &[1.0; 4]).unwrap();
        assert!(
            c.append(0, 0, &[1.0, 2.0], &[1.0, 2.0]).is_err(),
            "capacity"
        );
    }
}
