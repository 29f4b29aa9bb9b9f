//! How the fill's replicas come to read one set of frozen tables (see the parent module's
//! "Frozen tables"): built over the seeds (the first replica takes them, the others are
//! built sharing its tables), each later deposit taken once and shared ([`TableCache`]),
//! and the held-out evaluation reading the same.

use std::sync::{Arc, Mutex, OnceLock};

use pipefill_actors::WeightBoard;

use super::replica::{ReplicaTrainer, TableCache};
use super::{DrafterFill, Exchange, Frozen, Replica, Tally, eval, lock};
use crate::model::ModelError;
use crate::model::drafter::{
    DraftBufferHandle, Drafter, DrafterConfig, DrafterTrainer, FrozenTables,
};
use crate::model::{GptConfig, ModelChunk};
use crate::tensor::{Backend, CpuBackend};

impl DrafterFill {
    /// One replica per rank, each on a CPU thread; `first` and `last` are the chunks
    /// holding the target's embedding and LM head, whose values seed the frozen tables
    /// (target step `step`).
    pub fn new<C: Backend>(
        target: &GptConfig,
        config: &DrafterConfig,
        ranks: usize,
        first: &ModelChunk<C>,
        last: &ModelChunk<C>,
        step: u64,
    ) -> Result<Self, ModelError> {
        DrafterFill::on_backends(target, config, cpu_backends(ranks)?, first, last, step)
    }

    /// [`DrafterFill::new`] from the tables' values themselves (`embed.tok` and `head.w` as
    /// of target step `step`): a process that holds neither chunk, given them by the ranks
    /// that do.
    pub fn with_tables(
        target: &GptConfig,
        config: &DrafterConfig,
        ranks: usize,
        embed: Vec<f32>,
        head: Vec<f32>,
        step: u64,
    ) -> Result<Self, ModelError> {
        let seeds = Frozen {
            embed: Some((step, Arc::new(embed))),
            head: Some((step, Arc::new(head))),
        };
        DrafterFill::seeded(target, config, cpu_backends(ranks)?, seeds)
    }

    /// [`DrafterFill::new`] with rank `r`'s replica on `backends[r]` (a rank's own device:
    /// its slices run in that rank's bubbles). The router's priors are measured on the first.
    pub fn on_backends<C: Backend, R: Backend>(
        target: &GptConfig,
        config: &DrafterConfig,
        backends: Vec<R>,
        first: &ModelChunk<C>,
        last: &ModelChunk<C>,
        step: u64,
    ) -> Result<Self, ModelError> {
        let mut seeds = Frozen::default();
        seeds.take_from(first, step);
        seeds.take_from(last, step);
        DrafterFill::seeded(target, config, backends, seeds)
    }

    /// Replicas on `backends`, their frozen tables taken from `seeds` (shared among them).
    fn seeded<R: Backend>(
        target: &GptConfig,
        config: &DrafterConfig,
        backends: Vec<R>,
        seeds: Frozen,
    ) -> Result<Self, ModelError> {
        let ranks = backends.len();
        let buffer = DraftBufferHandle::new(target, config);
        let Some(first_rank) = backends.first() else {
            return Err(ModelError::DrafterConfig {
                field: "stages",
                reason: "a drafter in the bubbles needs at least one rank".into(),
            });
        };
        let priors = eval::calibrate(target, config, first_rank.clone())?;
        let mut replicas = Vec::with_capacity(ranks);
        let mut tables = TableCache::default();
        for (r, be) in backends.into_iter().enumerate() {
            // Built over the tables another replica took from the seeds where it can read
            // them: no tables of its own are drawn.
            let drafter = match tables.tables_for(&be) {
                Some(shared) => Drafter::sharing(target, config, be, &shared)?,
                None => Drafter::new(target, config, be)?,
            };
            let mut trainer = DrafterTrainer::new(drafter, buffer.clone(), r, ranks)?;
            trainer.adopt(&seeds, &mut tables)?;
            replicas.push(Mutex::new(Replica {
                trainer: Box::new(trainer),
                posted: None,
            }));
        }
        Ok(DrafterFill {
            ranks,
            refresh_every: config.refresh_every,
            held_out: DraftBufferHandle::new(target, config),
            buffer,
            replicas,
            exchange: Mutex::new(Exchange::default()),
            board: WeightBoard::default(),
            tally: Mutex::new(Tally::default()),
            priors,
            peers: OnceLock::new(),
            local: OnceLock::new(),
            planned: None,
            tables: Mutex::new(tables),
            taken: Mutex::new(seeds),
        })
    }

    /// `replica` takes the deposited tables `frozen`, sharing what another replica of this
    /// process built from them.
    pub(super) fn adopt(&self, replica: &mut Replica, frozen: &Frozen) -> Result<(), ModelError> {
        replica.trainer.adopt(frozen, &mut lock(&self.tables))?;
        lock(&self.taken).merge(frozen.clone());
        Ok(())
    }

    /// Bytes of the frozen tables the replicas read, each table counted once however many
    /// replicas share it (one embedding and one head when they all share).
    pub fn frozen_table_bytes(&self) -> usize {
        let mut seen = std::collections::BTreeMap::new();
        for r in &self.replicas {
            seen.extend(lock(r).trainer.tables());
        }
        seen.values().sum()
    }

    /// The tables the replicas last built, where `be` reads their memory (the replicas on
    /// the CPU and `be` a CPU backend).
    pub(crate) fn cpu_tables(&self, be: &CpuBackend) -> Option<FrozenTables<CpuBackend>> {
        lock(&self.tables).tables_for(be)
    }

    /// `rank`'s replica takes the deposited tables `frozen`.
    pub(super) fn take_tables(&self, rank: usize, frozen: &Frozen) -> Result<(), ModelError> {
        self.adopt(&mut lock(&self.replicas[rank]), frozen)
    }

    /// The newest frozen tables the replicas took, into `trainer` (shared where its
    /// backend reads the replicas' memory): the held-out evaluation's drafter.
    pub(crate) fn share_tables<B: Backend>(
        &self,
        trainer: &mut DrafterTrainer<B>,
    ) -> Result<(), ModelError> {
        let taken = lock(&self.taken).clone();
        ReplicaTrainer::adopt(trainer, &taken, &mut lock(&self.tables))
    }
}

/// `ranks` one-thread CPU backends.
fn cpu_backends(ranks: usize) -> Result<Vec<CpuBackend>, ModelError> {
    (0..ranks)
        .map(|_| CpuBackend::new(1))
        .collect::<Result<Vec<_>, _>>()
        .map_err(ModelError::from)
}
