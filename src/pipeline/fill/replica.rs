//! A rank's drafter replica behind one object type ([`ReplicaTrainer`]), whatever backend it
//! computes on: the fill keeps one per rank, each on its rank's device, without every type
//! that holds the fill being generic over the backend.
//!
//! The replicas of a process share one set of frozen tables ([`TableCache`]): the first to
//! take a deposit builds them (the embedding is the deposit itself, the head one upload), and
//! every other replica whose backend reads that memory takes the same `Arc`s.

use std::any::Any;
use std::sync::{Arc, Weak};

use super::round::{Deposit, Frozen};
use crate::data::SplitMix64;
use crate::model::ModelError;
use crate::model::OptimizerState;
use crate::model::drafter::{
    DrafterGrads, DrafterTrainer, DrafterWeights, FROZEN, FrozenTables, NamedTensor, SliceStats,
};
use crate::tensor::Backend;

type Result<T> = std::result::Result<T, ModelError>;

/// What the fill asks of a replica's [`DrafterTrainer`] (each method is the trainer's own).
pub(super) trait ReplicaTrainer: Send {
    fn version(&self) -> u64;
    fn max_slice_rows(&self) -> usize;
    fn slice_size(&self, rows: usize) -> usize;
    fn slice_within(&mut self, rows: usize) -> Result<SliceStats>;
    fn slice_of_step(&mut self, rows: usize, step: u64) -> Result<SliceStats>;
    fn take_grads(&mut self) -> Result<DrafterGrads>;
    fn step_with(&mut self, grads: &[DrafterGrads]) -> Result<u64>;
    fn weights(&self) -> Result<DrafterWeights>;
    /// The frozen tables as named tensors ([`crate::model::drafter::Drafter::frozen_tensors`]).
    fn frozen_tensors(&self) -> Result<Vec<NamedTensor>>;
    /// Each frozen table the replica reads, by identity, with its bytes (one for a tied
    /// target, two otherwise).
    fn tables(&self) -> Vec<(usize, usize)>;
    /// Takes the deposited frozen tables `frozen` (those it carries), sharing the tables
    /// another replica built from the same deposits where `cache` holds them.
    fn adopt(&mut self, frozen: &Frozen, cache: &mut TableCache) -> Result<()>;
    fn sampler(&self) -> SplitMix64;
    fn export_state(&self) -> Result<(DrafterWeights, OptimizerState)>;
    fn import_state(
        &mut self,
        weights: &DrafterWeights,
        optimizer: &OptimizerState,
        sampler: SplitMix64,
    ) -> Result<()>;
}

impl<B: Backend> ReplicaTrainer for DrafterTrainer<B> {
    fn version(&self) -> u64 {
        DrafterTrainer::version(self)
    }
    fn max_slice_rows(&self) -> usize {
        DrafterTrainer::max_slice_rows(self)
    }
    fn slice_size(&self, rows: usize) -> usize {
        DrafterTrainer::slice_size(self, rows)
    }
    fn slice_within(&mut self, rows: usize) -> Result<SliceStats> {
        DrafterTrainer::slice_within(self, rows)
    }
    fn slice_of_step(&mut self, rows: usize, step: u64) -> Result<SliceStats> {
        DrafterTrainer::slice_of_step(self, rows, step)
    }
    fn take_grads(&mut self) -> Result<DrafterGrads> {
        DrafterTrainer::take_grads(self)
    }
    fn step_with(&mut self, grads: &[DrafterGrads]) -> Result<u64> {
        DrafterTrainer::step_with(self, grads)
    }
    fn weights(&self) -> Result<DrafterWeights> {
        DrafterTrainer::weights(self)
    }
    fn frozen_tensors(&self) -> Result<Vec<NamedTensor>> {
        self.drafter().frozen_tensors()
    }
    fn tables(&self) -> Vec<(usize, usize)> {
        let (t, be) = (self.drafter().frozen(), self.drafter().backend());
        let tok = t
            .tok
            .as_ref()
            .map(|tok| (Arc::as_ptr(tok) as usize, t.tok_bytes()));
        let head = (Arc::as_ptr(&t.head) as *const u8 as usize, t.head_bytes(be));
        tok.into_iter().chain([head]).collect()
    }
    fn adopt(&mut self, frozen: &Frozen, cache: &mut TableCache) -> Result<()> {
        if frozen.embed.is_none() && frozen.head.is_none() {
            return Ok(());
        }
        let drafter = self.drafter_mut();
        let before = drafter.frozen();
        let built = (cache.0.as_ref()).and_then(|b| b.downcast_ref::<Built<B>>());
        if let Some(built) = built
            && built.be.shares_buffers_with(drafter.backend())
            && built.from(&before, frozen)
        {
            return drafter.share_frozen(&built.after);
        }
        let with_embed = frozen.embed.is_some();
        for (name, deposit) in FROZEN.iter().zip([&frozen.embed, &frozen.head]) {
            if let Some((step, values)) = deposit {
                match drafter.takes(name, with_embed) {
                    true => drafter.refresh_shared(name, values, *step)?,
                    // A tied target's head deposit: its embedding's, which came too; the
                    // newer step of the two is the tables'.
                    false => drafter.refresh_step(*step),
                }
            }
        }
        cache.0 = Some(Box::new(Built {
            be: drafter.backend().clone(),
            embed: weak(&frozen.embed),
            head: weak(&frozen.head),
            tok_before: before.tok.as_ref().map(Arc::downgrade),
            head_before: Arc::downgrade(&before.head),
            after: drafter.frozen(),
        }));
        Ok(())
    }
    fn sampler(&self) -> SplitMix64 {
        DrafterTrainer::sampler(self)
    }
    fn export_state(&self) -> Result<(DrafterWeights, OptimizerState)> {
        DrafterTrainer::export_state(self)
    }
    fn import_state(
        &mut self,
        weights: &DrafterWeights,
        optimizer: &OptimizerState,
        sampler: SplitMix64,
    ) -> Result<()> {
        DrafterTrainer::import_state(self, weights, optimizer, sampler)
    }
}

/// The frozen tables a replica of this process last built from deposits, for the others.
#[derive(Default)]
pub(crate) struct TableCache(Option<Box<dyn Any + Send>>);

impl TableCache {
    /// The tables last built, if a backend of type `B` built them on memory `be` reads.
    pub(crate) fn tables_for<B: Backend>(&self, be: &B) -> Option<FrozenTables<B>> {
        let built = self.0.as_ref()?.downcast_ref::<Built<B>>()?;
        built
            .be
            .shares_buffers_with(be)
            .then(|| built.after.clone())
    }
}

/// Tables built on `be` from deposits (by identity: the `Weak`s keep their allocations from
/// being reused by another deposit) over the tables a deposit did not replace.
struct Built<B: Backend> {
    be: B,
    embed: Option<Weak<Vec<f32>>>,
    head: Option<Weak<Vec<f32>>>,
    tok_before: Option<Weak<Vec<f32>>>,
    head_before: Weak<B::Buf>,
    after: FrozenTables<B>,
}

impl<B: Backend> Built<B> {
    /// Whether taking `frozen` over `before` gives these tables: the same deposits, and where
    /// a table was not deposited, the same table before.
    fn from(&self, before: &FrozenTables<B>, frozen: &Frozen) -> bool {
        let same = |mine: &Option<Weak<Vec<f32>>>, theirs: &Deposit| match (mine, theirs) {
            (Some(w), Some((_, v))) => std::ptr::eq(w.as_ptr(), Arc::as_ptr(v)),
            (None, None) => true,
            _ => false,
        };
        same(&self.embed, &frozen.embed)
            && same(&self.head, &frozen.head)
            && (frozen.embed.is_some()
                || self.tok_before.as_ref().map(Weak::as_ptr)
                    == before.tok.as_ref().map(Arc::as_ptr))
            && (frozen.head.is_some()
                || std::ptr::eq(self.head_before.as_ptr(), Arc::as_ptr(&before.head)))
    }
}

fn weak(deposit: &Deposit) -> Option<Weak<Vec<f32>>> {
    deposit.as_ref().map(|(_, v)| Arc::downgrade(v))
}
