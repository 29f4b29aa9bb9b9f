//! Drafter training in the pipeline's bubbles (`filler = "drafter"`).
//!
//! **Data.** The last stage's chunk copies the final hidden states and next-token
//! distributions its training forwards compute anyway into a bounded [`DraftBufferHandle`]
//! ([`crate::model::ModelChunk::set_draft_sink`]). The first micro-batch of every
//! [`HELD_OUT_EVERY`]-th step goes to a separate held-out buffer instead, never trained on,
//! on which the drafter's top-1 agreement with the target is measured.
//!
//! **Placement: a replica per rank, gradients exchanged.** Every rank holds a replica of the
//! drafter (same seed, same initial weights) and trains it in its own bubbles: a *slice* is
//! one forward + backward on up to `batch_rows` sampled sequences (kind `"drafter"` in the
//! [`FillerRouter`]). Slices are sized to the bubble: the router asks for a slice of at most
//! so many layout rows (`batch · seq`, from one position of one sequence up to `batch_rows`
//! windows of `max_positions`) as its cost line says fit the idle time left, so the end of
//! a bubble is filled by a shorter slice instead of left idle. A slice's gradients are of
//! its loss summed over its pairs and the update divides by the round's pairs, so every pair
//! weighs the same whatever the slices' sizes. At the end of each target step a rank posts the gradients its replica
//! accumulated as *round* `v` (its drafter version). Once every rank has posted round `v`,
//! each replica applies the same update — every round's gradients summed in replica order
//! ([`DrafterTrainer::step_with`](crate::model::drafter::DrafterTrainer::step_with)) — in its next bubble (kind `"drafter step"`), or at its
//! next target step's end if no bubble came. So after each drafter step every replica holds
//! the same weights, bit for bit. Slices run while a round is still open compute
//! gradients on weights one version old (as asynchronous data parallelism does); they go
//! into the next round.
//!
//! **Frozen tables.** The drafter's embedding and LM head are the target's, frozen
//! ([`crate::model::drafter::FrozenTables`]): `embed.tok` on the first rank, `head.w` on the
//! last. Those ranks deposit them (one host copy each) after every `refresh_every`-th target
//! step; a rank's post of a round carries its newest deposits, and every replica takes the
//! round's newest ones right after that round's update (under the planned placement, before
//! the next step's first slice), so the tables too are the same on every replica at every
//! version (whichever rank completes the round, and whenever). The replicas of a process
//! share one set: the embedding is the deposit itself, and the head is uploaded once by the
//! first replica to take it and shared by every replica whose backend reads that memory
//! ([`crate::tensor::Backend::shares_buffers_with`]: all of them on the CPU), so a process
//! holds one snapshot of each table however many replicas it runs. Ranks that hold neither
//! table (middle stages) read the holders' deposits: in one process the same `Arc`s, across
//! processes one copy that crossed once per refresh.
//!
//! **Other processes.** In a multi-process run (`pipefill launch`) each process holds the
//! replica of its own rank; [`DrafterFill::connect`] hands every local post to a
//! [`RoundPeers`], which sends it to the other processes, where it goes in through
//! [`DrafterFill::post_remote`] (or [`DrafterFill::post_remote_at`] under the planned
//! placement; src/launch/train/fill.rs). A failed exchange calls [`DrafterFill::abort`], which
//! ends any wait for a round.
//!
//! **Hand-off.** After each drafter step replica 0 publishes its weights on a
//! [`WeightBoard`] versioned by drafter step; the trainer's caller thread (and later the
//! rollout engine) loads them from there.
//!
//! **Placement.** The above is the *measured* placement (`[drafter] placement = "measured"`,
//! the default): slice sizes, and when a round is applied, follow measured times, so the
//! drafter differs from run to run. Under `placement = "planned"` (`planned`) each rank's
//! slices in each step are a pure function of the plan and the configs ([`SlicePlan`]), they
//! sample only the previous step's rows, and each step's round is applied at the end of the
//! next step: the drafter is the same bit for bit on every run and across a resume.
//!
//! Filler work never touches the target: it reads copies of what the target computed and
//! writes only drafter state, so the target's parameters are those of a run without it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use pipefill_actors::router::CostEstimate;
use pipefill_actors::{FillerRouter, FillerSource, Slice, WeightBoard};

use crate::model::ModelChunk;
use crate::model::ModelError;
use crate::model::drafter::{DraftBufferHandle, DrafterGrads, DrafterWeights};
use crate::tensor::Backend;

mod eval;
mod planned;
mod replica;
mod round;
mod slice_plan;
pub(crate) mod state;
mod tables;

pub use eval::HeldOutEval;
use replica::{ReplicaTrainer, TableCache};
pub use round::RoundPost;
use round::{Deposit, Frozen};
pub use slice_plan::{HELD_OUT_EVERY, SliceCost, SlicePlan, modelled_costs};

/// Most recent held-out rows the agreement is measured on.
const HELD_OUT_ROWS: usize = 32;
/// Router kind of a drafter slice (forward + backward).
pub const SLICE_KIND: &str = "drafter";
/// Router kind of a drafter optimizer step (one round's update).
pub const STEP_KIND: &str = "drafter step";

/// One rank's replica and where it stands in the exchange.
struct Replica {
    /// On the rank's device (a CPU thread in tests and the multi-process fill).
    trainer: Box<dyn ReplicaTrainer>,
    /// The round this replica posted and has not applied yet.
    posted: Option<u64>,
}

/// The other processes of a multi-process run, told of what this process's replica does.
pub trait RoundPeers: Send + Sync {
    /// Local `rank` ended target step `step`, posting `post` (`None` while its round is open).
    fn step_end(&self, rank: usize, step: u64, post: Option<&RoundPost>) -> Result<(), ModelError>;
}

/// One round's gradients, and once complete what every replica applies.
#[derive(Default)]
struct Round {
    grads: Vec<DrafterGrads>,
    /// The newest copies the posters carried.
    frozen: Frozen,
    complete: Option<(Arc<Vec<DrafterGrads>>, Frozen)>,
    applied: usize,
}

#[derive(Default)]
struct Exchange {
    rounds: BTreeMap<u64, Round>,
    /// Each rank's newest deposits.
    held: BTreeMap<usize, Frozen>,
}

/// What the slices did since the caller last looked.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    slices: u64,
    loss: f64,
    failed: u64,
}

/// The drafter trained in one pipelined run's bubbles (see the module docs).
pub struct DrafterFill {
    ranks: usize,
    refresh_every: u64,
    buffer: DraftBufferHandle,
    held_out: DraftBufferHandle,
    replicas: Vec<Mutex<Replica>>,
    exchange: Mutex<Exchange>,
    board: WeightBoard<DrafterWeights>,
    tally: Mutex<Tally>,
    /// Measured slice cost line and step cost before the run, in thread CPU seconds.
    priors: (CostEstimate, f64),
    /// The other processes, in a multi-process run (this one then applies one replica).
    peers: OnceLock<Arc<dyn RoundPeers>>,
    /// This process's replica, in a multi-process run (the only one that trains here).
    local: OnceLock<usize>,
    /// The planned placement's state (`None`: slices placed by measured times).
    planned: Option<planned::Planned>,
    /// The frozen tables the replicas last built, shared by the others.
    tables: Mutex<TableCache>,
    /// The newest deposits a replica took (what the held-out evaluation reads).
    taken: Mutex<Frozen>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl DrafterFill {
    /// The buffer the last stage captures training rows into.
    pub fn buffer(&self) -> &DraftBufferHandle {
        &self.buffer
    }

    /// The buffer of held-out rows (never trained on).
    pub fn held_out(&self) -> &DraftBufferHandle {
        &self.held_out
    }

    /// The newest drafter weights, versioned by drafter step.
    pub fn board(&self) -> &WeightBoard<DrafterWeights> {
        &self.board
    }

    /// Whether the last stage's forward of `(step, microbatch)` feeds the held-out rows.
    pub fn holds_out(step: u64, microbatch: u32) -> bool {
        microbatch == 0 && step.is_multiple_of(HELD_OUT_EVERY)
    }

    /// Registers the two kinds of drafter work with `router`, with the costs measured
    /// before the run as priors; under the planned placement only the planned slices (its
    /// rounds are applied at step ends).
    pub fn attach(self: &Arc<Self>, router: &FillerRouter) {
        if self.planned.is_some() {
            let slices = planned::PlannedSlices(Arc::clone(self));
            router.add_sized_source(slices, Some(self.priors.0));
            return;
        }
        router.add_source(Steps(Arc::clone(self)), Some(self.priors.1));
        router.add_sized_source(Slices(Arc::clone(self)), Some(self.priors.0));
    }

    /// Rank `rank` finished target step `step`: deposits the frozen copies it holds, applies
    /// a completed round its bubbles did not, and posts its gradients as the next round.
    pub fn step_end<C: Backend>(
        &self,
        rank: usize,
        step: u64,
        chunks: &[&ModelChunk<C>],
    ) -> Result<(), ModelError> {
        if let Some(planned) = &self.planned {
            return self.planned_step_end(planned, rank, step, chunks);
        }
        if (step + 1).is_multiple_of(self.refresh_every) {
            for chunk in chunks {
                self.deposit(rank, chunk, step)?;
            }
        }
        if self.pending(rank).is_some() {
            self.apply(rank)?;
        }
        let mut replica = lock(&self.replicas[rank]);
        // While its round is open the replica keeps accumulating.
        let post = match replica.posted {
            Some(_) => None,
            None => {
                let grads = replica.trainer.take_grads()?;
                replica.posted = Some(grads.version);
                drop(replica);
                let held = lock(&self.exchange).held.get(&rank).cloned();
                Some((grads, held.unwrap_or_default()))
            }
        };
        let peers = self.peers.get();
        let wire = match (&post, peers) {
            (Some((grads, frozen)), Some(_)) => {
                let copy = |d: &Deposit| d.as_ref().map(|(s, v)| (*s, v.to_vec()));
                Some(RoundPost {
                    grads: grads.clone(),
                    embed: copy(&frozen.embed),
                    head: copy(&frozen.head),
                })
            }
            _ => None,
        };
        if let Some((grads, frozen)) = post {
            self.post(grads, frozen)?;
        }
        match peers {
            Some(peers) => peers.step_end(rank, step, wire.as_ref()),
            None => Ok(()),
        }
    }

    /// Adds one replica's post to its round, completing the round with the last one.
    fn post(&self, grads: DrafterGrads, frozen: Frozen) -> Result<(), ModelError> {
        let mut ex = lock(&self.exchange);
        let round = ex.rounds.entry(grads.version).or_default();
        if grads.replica >= self.ranks || round.grads.iter().any(|g| g.replica == grads.replica) {
            return Err(ModelError::Replicas {
                version: grads.version,
                reason: format!(
                    "replica {} posted again, or is not one of {}",
                    grads.replica, self.ranks
                ),
            });
        }
        round.frozen.merge(frozen);
        round.grads.push(grads);
        if round.grads.len() == self.ranks {
            let grads = Arc::new(std::mem::take(&mut round.grads));
            round.complete = Some((grads, std::mem::take(&mut round.frozen)));
        }
        Ok(())
    }

    /// Hands every post of this process's replicas to `peers` (a multi-process run, where this
    /// process trains and applies the replica of `rank` alone; set once, before the run).
    pub fn connect(&self, rank: usize, peers: Arc<dyn RoundPeers>) {
        let _ = self.local.set(rank);
        let _ = self.peers.set(peers);
    }

    /// The exchange with the other processes failed for `reason` (a peer is gone, or sent
    /// something undecodable): a rank waiting for a round of the planned placement stops
    /// waiting with this error instead of until its timeout.
    pub fn abort(&self, reason: String) {
        if let Some(planned) = &self.planned {
            planned.abort(reason);
        }
    }

    /// `rank`'s row sampler as a checkpoint keeps it (see [`DrafterFill::export_state`]):
    /// under the planned placement as the replica ended its last step.
    pub fn checkpoint_sampler(&self, rank: usize) -> Result<crate::data::SplitMix64, ModelError> {
        if let Some(sampler) = self.planned.as_ref().and_then(|p| p.sampler(rank)) {
            return Ok(sampler);
        }
        let replica = self
            .replicas
            .get(rank)
            .ok_or_else(|| ModelError::DrafterInput {
                what: "replica",
                reason: format!("{rank} is not one of {}", self.ranks),
            })?;
        Ok(lock(replica).trainer.sampler())
    }

    /// Another process's replica posted `post`.
    pub fn post_remote(&self, post: RoundPost) -> Result<(), ModelError> {
        let arc = |d: Option<(u64, Vec<f32>)>| d.map(|(s, v)| (s, Arc::new(v)));
        let frozen = Frozen {
            embed: arc(post.embed),
            head: arc(post.head),
        };
        self.post(post.grads, frozen)
    }

    fn deposit<C: Backend>(
        &self,
        rank: usize,
        chunk: &ModelChunk<C>,
        step: u64,
    ) -> Result<(), ModelError> {
        let mut ex = lock(&self.exchange);
        ex.held.entry(rank).or_default().take_from(chunk, step);
        Ok(())
    }

    /// The completed round `rank`'s replica has still to apply.
    fn pending(&self, rank: usize) -> Option<u64> {
        let v = lock(&self.replicas[rank]).posted?;
        let ex = lock(&self.exchange);
        ex.rounds.get(&v)?.complete.as_ref().map(|_| v)
    }

    /// Applies the completed round `rank`'s replica posted: the summed update, then the
    /// round's frozen copies; replica 0 publishes the new weights.
    fn apply(&self, rank: usize) -> Result<(), ModelError> {
        let mut replica = lock(&self.replicas[rank]);
        let Some(v) = replica.posted else {
            return Ok(());
        };
        let Some((grads, frozen)) = lock(&self.exchange)
            .rounds
            .get(&v)
            .and_then(|r| r.complete.clone())
        else {
            return Ok(());
        };
        let version = replica.trainer.step_with(&grads)?;
        self.adopt(&mut replica, &frozen)?;
        replica.posted = None;
        if rank == 0 {
            self.board.publish(version, replica.trainer.weights()?);
        }
        drop(replica);
        let mut ex = lock(&self.exchange);
        if let Some(round) = ex.rounds.get_mut(&v) {
            round.applied += 1;
            let appliers = if self.peers.get().is_some() {
                1
            } else {
                self.ranks
            };
            if round.applied == appliers {
                ex.rounds.remove(&v);
            }
        }
        Ok(())
    }

    /// One slice of at most `rows` layout rows on `rank`'s replica, sampling the whole
    /// buffer or the rows of target step `from` only.
    fn slice(&self, rank: usize, rows: usize, from: Option<u64>) -> Result<(), ModelError> {
        let outcome = {
            let trainer = &mut lock(&self.replicas[rank]).trainer;
            match from {
                Some(step) => trainer.slice_of_step(rows, step),
                None => trainer.slice_within(rows),
            }
        };
        let mut tally = lock(&self.tally);
        match outcome {
            Ok(stats) => {
                tally.slices += 1;
                tally.loss += f64::from(stats.loss);
                Ok(())
            }
            Err(e) => {
                tally.failed += 1;
                Err(e)
            }
        }
    }

    /// After the run: every replica applies the rounds completed but not yet applied, so
    /// all stand at the same version. Returns each replica's weights, by rank. Under the
    /// planned placement every replica stands at the same version already, and the last
    /// step's round stays posted (a continuation applies it at its first step's end).
    pub fn settle(&self) -> Result<Vec<DrafterWeights>, ModelError> {
        for rank in (0..self.ranks).filter(|_| self.planned.is_none()) {
            self.apply(rank)?;
        }
        self.replicas
            .iter()
            .map(|r| lock(r).trainer.weights())
            .collect()
    }

    /// Slices run and their mean loss since the last call.
    pub fn take_tally(&self) -> (u64, Option<f64>, u64) {
        let t = std::mem::take(&mut *lock(&self.tally));
        let loss = (t.slices > 0).then(|| t.loss / t.slices as f64);
        (t.slices, loss, t.failed)
    }
}

/// Slices of the drafter: there while the buffer has rows and the rank's replica has no
/// completed round to apply first.
struct Slices(Arc<DrafterFill>);

impl FillerSource for Slices {
    fn kind(&self) -> &str {
        SLICE_KIND
    }

    /// From one layout row up to a full slice (the same on every replica).
    fn sizes(&self) -> (u64, u64) {
        let full = lock(&self.0.replicas[0]).trainer.max_slice_rows();
        (1, full as u64)
    }

    fn next(&mut self, rank: usize, units: u64) -> Option<Slice> {
        let fill = &self.0;
        if fill.pending(rank).is_some() || fill.buffer.is_empty() {
            return None;
        }
        let (version, rows) = {
            let replica = lock(&fill.replicas[rank]);
            let rows = usize::try_from(units).unwrap_or(usize::MAX);
            (replica.trainer.version(), replica.trainer.slice_size(rows))
        };
        let fill = Arc::clone(fill);
        Some(Slice {
            label: format!("drafter slice (v{version}, {rows} rows)"),
            units: rows as u64,
            run: Box::new(move || fill.slice(rank, rows, None).map_err(|e| e.to_string())),
        })
    }
}

/// The drafter's optimizer steps: one per completed round, on every replica.
struct Steps(Arc<DrafterFill>);

impl FillerSource for Steps {
    fn kind(&self) -> &str {
        STEP_KIND
    }

    fn next(&mut self, rank: usize, _units: u64) -> Option<Slice> {
        let v = self.0.pending(rank)?;
        let fill = Arc::clone(&self.0);
        Some(Slice {
            label: format!("drafter step {}", v + 1),
            units: 1,
            run: Box::new(move || fill.apply(rank).map_err(|e| e.to_string())),
        })
    }
}
