//! The host copies a proposal multiplies by: the drafter's matrices packed for
//! [`rowmul`](crate::model::infer::rowmul), and a memo of the context pairs' keys and values.
//!
//! A proposal multiplies one to a few rows per sequence by every drafter matrix, once per
//! draft token. Through the backend's general GEMM each such product re-packed `W` (the
//! whole block, 15 MB at `d_model` 512, every draft step), which made drafting a chain cost
//! a large share of a target decode (docs/benchmarks.md, "Drafter proposals").
//! [`PackedDrafter`] packs the matrices once per drafter version, as
//! [`InferStage`](crate::model::infer::InferStage) does for the target, and each product
//! streams them once for all its rows.
//!
//! A proposal's context is the sequence's last `window` target pairs, and the next proposal
//! of the same sequence sees almost the same pairs again. A pair's key and value depend on
//! that pair alone (fc, norm, projection: no position, no other row), and [`rowmul`] gives
//! a row the same bits whatever else shares the call, so [`KvMemo`] keeps them by content
//! and a proposal recomputes only the pairs it has not seen: its result is bitwise the one
//! a fresh drafter gives.
//!
//! The matrices are packed in half precision by default ([`Precision::F16`], see
//! [`Drafter::set_proposal_precision`]): a proposal streams the block once per draft token
//! and is bound by those bytes, and losslessness does not depend on the drafter's numerics
//! (acceptance compares the target's `p` with the `q` actually drafted), only the
//! acceptance rate does, and f16's 11 significant bits keep a weight within 2⁻¹¹ of its
//! value. A matrix with a weight beyond f16's range stays in f32.
//!
//! Both are dropped whenever the weights change ([`PackCache::invalidate`], called by every
//! `&mut` path to the weights: [`Drafter::params_mut`](super::Drafter::params_mut),
//! [`Drafter::refresh`](super::Drafter::refresh) and so
//! [`Drafter::load_weights`](super::Drafter::load_weights)), and rebuilt by the next
//! proposal: never stale, and packed at most once per optimizer step.

use std::collections::HashMap;

use super::Drafter;
use crate::model::infer::rowmul::{Packed, Precision, side_by_side, streams_host_weights};
use crate::tensor::Backend;

/// The drafter's matrices packed for [`rowmul`](crate::model::infer::rowmul::rowmul).
pub(super) struct PackedDrafter {
    /// `[2d, d]`.
    pub fc: Packed,
    /// `[d, d]`.
    pub wq: Packed,
    /// `[d, 2·kv_dim]`: `wk` and `wv` side by side, one product for both (a context pair
    /// needs only its key and value; only each sequence's last row needs a query).
    pub wkv: Packed,
    pub wo: Packed,
    /// `[d, hidden]`.
    pub w1: Packed,
    /// `[hidden, d]`.
    pub w2: Packed,
    /// `[d, hidden]`: the gated MLP's up projection.
    pub w3: Option<Packed>,
    /// The frozen LM head as `[d, vocab]` panels, or its draft vocabulary's columns `[d, n]`.
    pub head: Packed,
}

impl PackedDrafter {
    /// Packs the drafter's current weights (read back from its backend) in `precision`.
    fn new<B: Backend>(d: &Drafter<B>, precision: Precision) -> crate::tensor::Result<Self> {
        let be = &d.be;
        let (dm, v, hidden) = (d.target.d_model, d.target.vocab, d.target.mlp_hidden());
        let host = |p: &crate::model::Param<B>| be.to_host(&p.value);
        // A matrix half precision cannot hold stays in f32 (the shapes are right by
        // construction, so that is the only refusal).
        let pack = |w: &[f32], din: usize, dout: usize| {
            Packed::with_precision(w, din, dout, precision)
                .unwrap_or_else(|_| Packed::new(w, din, dout))
        };

        let attn = &d.block.attn;
        let kvd = d.target.kv_dim();
        let wkv = side_by_side(&[&host(&attn.wk)?, &host(&attn.wv)?], dm, kvd);
        let w3 = match &d.block.mlp.w3 {
            Some(w3) => Some(pack(&host(w3)?, dm, hidden)),
            None => None,
        };
        Ok(PackedDrafter {
            fc: pack(&host(&d.fc.w)?, 2 * dm, dm),
            wq: pack(&host(&attn.wq)?, dm, dm),
            wkv: pack(&wkv, dm, 2 * kvd),
            wo: pack(&host(&attn.wo)?, dm, dm),
            w1: pack(&host(&d.block.mlp.w1)?, dm, hidden),
            w2: pack(&host(&d.block.mlp.w2)?, hidden, dm),
            w3,
            head: match &d.draft {
                Some(draft) => pack(&be.to_host(&draft.head)?, dm, draft.ids.len()),
                // The head's `[vocab, d]` table, packed as its transpose (the same panels,
                // no `[d, vocab]` copy).
                None => {
                    let table = be.to_host(&d.frozen.head)?;
                    Packed::with_precision_transposed(&table, dm, v, precision)
                        .or_else(|_| {
                            Packed::with_precision_transposed(&table, dm, v, Precision::F32)
                        })
                        .map_err(|e| crate::tensor::TensorError::Invalid {
                            op: "packing the drafter's head",
                            reason: e.to_string(),
                        })?
                }
            },
        })
    }

    /// The matrices, in the order of [`Drafter::propose`]'s products.
    #[cfg(test)]
    pub fn all(&self) -> [&Packed; 7] {
        [
            &self.fc, &self.wq, &self.wkv, &self.wo, &self.w1, &self.w2, &self.head,
        ]
    }
}

/// Context pairs kept by [`KvMemo`], over its two generations: a long-tail batch of 128
/// live sequences with the default window of 32 pairs.
const MEMO_PAIRS: usize = 4096;

/// One remembered pair: its content (checked on every hit, so a hash collision cannot
/// hand back another pair's key) and its `[key | value]` row.
struct Remembered {
    token: u32,
    hidden: Vec<f32>,
    kv: Vec<f32>,
}

/// The `[key | value]` rows of context pairs, by content. Bounded by two generations: when
/// the newer holds half of [`MEMO_PAIRS`] it becomes the older and the old one is dropped;
/// a hit in the older moves to the newer, so the pairs of live sequences stay.
#[derive(Default)]
pub(super) struct KvMemo {
    new: HashMap<u64, Remembered>,
    old: HashMap<u64, Remembered>,
}

/// FxHash-style mix of the pair's bits (the key is checked in full on a hit).
fn pair_hash(token: u32, hidden: &[f32]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mix = |h: u64, x: u64| (h.rotate_left(5) ^ x).wrapping_mul(K);
    hidden.iter().fold(mix(0, u64::from(token)), |h, x| {
        mix(h, u64::from(x.to_bits()))
    })
}

impl KvMemo {
    /// The `[key | value]` row of pair `(token, hidden)`, if remembered.
    pub fn get(&mut self, token: u32, hidden: &[f32]) -> Option<&[f32]> {
        let h = pair_hash(token, hidden);
        let same = |r: &Remembered| {
            r.token == token
                && r.hidden.len() == hidden.len()
                && r.hidden
                    .iter()
                    .zip(hidden)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
        };
        if !self.new.get(&h).is_some_and(same) {
            let r = self.old.remove(&h).filter(same)?;
            self.insert_at(h, r);
        }
        self.new.get(&h).map(|r| r.kv.as_slice())
    }

    /// Remembers the `[key | value]` row of pair `(token, hidden)`.
    pub fn insert(&mut self, token: u32, hidden: &[f32], kv: &[f32]) {
        let r = Remembered {
            token,
            hidden: hidden.to_vec(),
            kv: kv.to_vec(),
        };
        self.insert_at(pair_hash(token, hidden), r);
    }

    fn insert_at(&mut self, h: u64, r: Remembered) {
        if self.new.len() >= MEMO_PAIRS / 2 {
            self.old = std::mem::take(&mut self.new);
        }
        self.new.insert(h, r);
    }

    /// Pairs remembered.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.new.len() + self.old.len()
    }
}

/// What a drafter keeps for its proposals between calls; empty until the first proposal
/// and after every weight change.
pub(crate) struct PackCache {
    packed: Option<PackedDrafter>,
    /// What the matrices are packed in.
    precision: Precision,
    memo: KvMemo,
    /// Times the weights were packed (what a test checks a weight update against).
    packs: u64,
    /// Tests only: multiply through the backend's GEMM even on the host backend.
    #[cfg(test)]
    pub(super) gemm_only: bool,
}

impl Default for PackCache {
    fn default() -> Self {
        PackCache {
            packed: None,
            precision: Precision::F16,
            memo: KvMemo::default(),
            packs: 0,
            #[cfg(test)]
            gemm_only: false,
        }
    }
}

impl PackCache {
    /// Forgets the packed weights and the memo: the weights changed.
    pub fn invalidate(&mut self) {
        self.packed = None;
        self.memo = KvMemo::default();
    }

    /// Times the weights were packed.
    #[cfg(test)]
    pub fn packs(&self) -> u64 {
        self.packs
    }

    /// Pairs in the memo.
    #[cfg(test)]
    pub fn remembered(&self) -> usize {
        self.memo.len()
    }
}

impl PackCache {
    /// The packed weights and the memo of `d`'s current weights, packing them first if
    /// they changed since the last proposal.
    pub(super) fn ensure<B: Backend>(
        &mut self,
        d: &Drafter<B>,
    ) -> crate::tensor::Result<(&PackedDrafter, &mut KvMemo)> {
        if self.packed.is_none() {
            self.packed = Some(PackedDrafter::new(d, self.precision)?);
            self.memo = KvMemo::default();
            self.packs += 1;
        }
        let PackCache { packed, memo, .. } = self;
        Ok((packed.as_ref().expect("packed above"), memo))
    }
}

impl<B: Backend> Drafter<B> {
    /// The precision proposals pack the drafter's matrices in on the host backend
    /// ([`Precision::F16`] unless set; see the module docs). A change repacks them at the
    /// next proposal.
    pub fn set_proposal_precision(&mut self, precision: Precision) {
        if self.packs.precision != precision {
            self.packs.precision = precision;
            self.packs.invalidate();
        }
    }

    pub fn proposal_precision(&self) -> Precision {
        self.packs.precision
    }

    /// The packed matrices (packing them if they are not): what a test inspects.
    #[cfg(test)]
    pub(super) fn packed_matrices(&mut self) -> crate::tensor::Result<Vec<Packed>> {
        let mut cache = std::mem::take(&mut self.packs);
        let result = cache
            .ensure(self)
            .map(|(p, _)| p.all().map(Packed::clone).to_vec());
        self.packs = cache;
        result
    }

    /// Whether products use [`PackedDrafter`]: where the backend's buffers are host memory
    /// in f32 anyway (a device backend keeps its own GEMM).
    pub(super) fn host_products(&self) -> bool {
        #[cfg(test)]
        if self.packs.gemm_only {
            return false;
        }
        streams_host_weights(&self.be)
    }
}
