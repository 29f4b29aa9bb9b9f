//! [`Shared`]: what the ranks of one pipelined run share besides payloads.
//!
//! - The **reported gradient norm** of a step. The runtime agrees on the clip/skip decision
//!   from each rank's `Σ g²` (`pipefill_actors::step`); for the metrics each rank also posts
//!   its per-parameter `Σ g²` here, and the norm is summed in model order (stage by stage,
//!   parameter by parameter), exactly as the reference trainer sums it.
//! - The **step log**: the last stage's micro-batch losses, and when every rank has stepped,
//!   one [`StepMetrics`] sent to the trainer (the progress channel).
//! - The **final state** each rank hands over after its last step (parameters and optimizer
//!   moments), from which [`super::PipelineRun`] serves parameters and checkpoints.
//! - For a **data-parallel replica** ([`Replica`]): the replica's share of each step's
//!   micro-batches ([`Shared::step_data`]) and the gradient all-reduce across replicas
//!   ([`Shared::sync_grads`], called by each rank before it computes its gradient norm).
//! - **Periodic checkpoints** ([`Checkpointing`]): after every `every`-th step each rank
//!   deposits its state; once all have, a writer thread saves the sharded checkpoint (one
//!   shard per rank, manifest last), off the stage threads; the trainer joins the writers
//!   when the run ends ([`Shared::join_checkpoints`]). One writer at a time: the next
//!   checkpoint waits for the one before, so a run holds at most two of them in memory.
//!   A write that fails stops the run at the end of the ranks' next step
//!   ([`Shared::check_stop`]), and [`Shared::join_checkpoints`] reports it, naming the file
//!   and the last complete checkpoint. When the ranks live in different
//!   processes, each process's [`RankCheckpointer`] takes its own rank's state instead.
//!   With a drafter in the bubbles ([`Shared::checkpoint_drafter`]) its state is taken when
//!   the last rank deposits, and saved with the checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::feed::{StepBatches, StepFeed};
use crate::comm::collective::{GradSync, RingGradSync, TIE_CHANNEL};
use crate::model::ModelError;
use crate::model::checkpoint::HostTensor;
use crate::model::checkpoint::sharded::Layout;
use crate::model::layers::{OffsetTokenLoss, TokenLoss};
use crate::model::{GptConfig, OptimizerState, Param};
use crate::pipeline::error::PipelineError;
use crate::schedules::Plan;
use crate::tensor::Backend;
use crate::train::StepMetrics;
use crate::train::reference::combine_losses;

mod save;
use save::save_finals;

/// One rank's state after its last step; on the wire, a launched rank's final state and a
/// `launch rl` rank's weight sync.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct RankFinal {
    /// `(stage, parameters of that stage in model order)`.
    pub stages: Vec<(u32, Vec<HostTensor>)>,
    pub optimizer: OptimizerState,
}

impl RankFinal {
    /// Every rank's final state as one model's: the parameters in model order (stages
    /// ascending, each stage's in order) and the optimizer state: what a checkpoint holds.
    pub fn merge(finals: Vec<RankFinal>) -> (Vec<HostTensor>, OptimizerState) {
        let mut by_stage: BTreeMap<u32, Vec<HostTensor>> = BTreeMap::new();
        let mut optimizer = OptimizerState::default();
        for mut fin in finals {
            by_stage.extend(fin.stages);
            optimizer.step = fin.optimizer.step;
            optimizer.slots.append(&mut fin.optimizer.slots);
        }
        (by_stage.into_values().flatten().collect(), optimizer)
    }
}

/// What is known about one step while its ranks work on it.
#[derive(Debug, Default)]
struct StepEntry {
    /// Stage → `Σ g²` of each of its parameters, in model order.
    sq_norms: BTreeMap<u32, Vec<f64>>,
    /// The last stage's mean loss of each micro-batch.
    losses: BTreeMap<u32, f32>,
    /// Ranks whose optimizer step is done.
    stepped: usize,
}

#[derive(Debug)]
struct State {
    steps: BTreeMap<u64, StepEntry>,
    finals: Vec<Option<RankFinal>>,
    last_done: Instant,
}

/// This pipeline's place among `count` data-parallel replicas of the same plan. Replica
/// `index` runs micro-batches `index × m .. (index + 1) × m` of every step (`m` = the step's
/// micro-batches / `count`) with the loss scales of the whole batch, so the sum of the
/// replicas' gradients ([`GradSync`]) is the whole batch's gradient.
#[derive(Debug, Clone)]
pub struct Replica {
    pub index: usize,
    pub count: usize,
    pub sync: Arc<dyn GradSync>,
}

/// Where and how often a run saves sharded checkpoints ([`crate::model::checkpoint::sharded::step_dir`] of `run_dir`).
#[derive(Debug, Clone)]
pub struct Checkpointing {
    /// Save after every step `k` with `(k + 1) % every == 0`.
    pub every: u64,
    pub run_dir: PathBuf,
    pub model: crate::model::GptConfig,
    pub data_seed: u64,
    pub layout: Layout,
    /// Parameter name → stage ([`crate::model::checkpoint::sharded::param_stages`]).
    pub stage_of: HashMap<String, usize>,
    /// [`crate::config::JobConfig::fingerprint`] of the job.
    pub config_hash: String,
    /// How many complete checkpoints the run keeps (`checkpoint_keep`), shared by its
    /// writers: each tells it when its checkpoint is complete.
    pub retention: Arc<crate::model::checkpoint::retain::Retention>,
}

/// Where a rank's periodic state goes when the run's ranks live in different processes:
/// each process writes its own rank's shard (see [`crate::pipeline::mesh`]), so nothing is
/// gathered here.
pub trait RankCheckpointer: Send + Sync + std::fmt::Debug {
    /// `rank`'s state after step `step` (a due step, see [`Shared::checkpoint_due`]).
    fn deposit(&self, step: u64, rank: usize, fin: RankFinal);
    /// Waits until every checkpoint deposited so far is written; the directories completed.
    fn join(&self) -> Result<Vec<PathBuf>, ModelError>;
    /// Whether a write has failed: the run then stops at the ranks' next step end
    /// ([`Shared::check_stop`]) and [`RankCheckpointer::join`] reports it. A writer that
    /// cannot tell says `false` (the failure is reported when the run ends).
    fn failed(&self) -> bool {
        false
    }
}

/// Checkpoints being gathered from the ranks, the writer in flight, and what the writers
/// before it did.
#[derive(Default)]
struct Saves {
    pending: BTreeMap<u64, Vec<Option<RankFinal>>>,
    /// At most one: the next checkpoint's writer starts once this one is done.
    writer: Option<std::thread::JoinHandle<Result<PathBuf, ModelError>>>,
    /// The directories the finished writers completed.
    written: Vec<PathBuf>,
    /// The first write that failed (the run stops; [`Shared::join_checkpoints`] reports it).
    failed: Option<ModelError>,
}

impl Saves {
    /// Waits for the writer in flight and records what it did.
    fn settle(&mut self) {
        let Some(writer) = self.writer.take() else {
            return;
        };
        match writer.join() {
            Ok(Ok(dir)) => self.written.push(dir),
            Ok(Err(e)) => {
                self.failed.get_or_insert(e);
            }
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

impl std::fmt::Debug for Saves {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Saves")
            .field("pending", &self.pending.keys().collect::<Vec<_>>())
            .field("writing", &self.writer.is_some())
            .field("written", &self.written.len())
            .field("failed", &self.failed.is_some())
            .finish()
    }
}

/// The pipeline ranks of `plan` holding a tied embedding's first and last stage, when
/// `model` ties them and they differ (`None`: nothing to exchange between ranks).
pub fn tie_ranks(model: &GptConfig, plan: &Plan) -> Option<[usize; 2]> {
    let last = u32::try_from(plan.stages.checked_sub(1)?).ok()?;
    let pair = [plan.rank_of(0), plan.rank_of(last)];
    (model.tie_embeddings && pair[0] != pair[1]).then_some(pair)
}

/// State shared by the ranks of one run (see the module docs).
#[derive(Debug)]
pub struct Shared {
    /// The pipeline's ranks (this process's and others').
    ranks: usize,
    /// How many of them step in this process: the last of them to step closes the step.
    local: usize,
    pub(crate) feed: Arc<StepFeed>,
    state: Mutex<State>,
    progress: Sender<StepMetrics>,
    replica: Option<Replica>,
    /// A replica's share of each step, built once per step.
    shards: Mutex<BTreeMap<u64, Arc<StepBatches>>>,
    checkpointing: Option<Checkpointing>,
    saves: Mutex<Saves>,
    /// Set when the run must stop at the ranks' next step end: a checkpoint write failed, or
    /// the caller asked ([`Shared::stop`]).
    stop: Arc<AtomicBool>,
    rank_checkpointer: Option<Arc<dyn RankCheckpointer>>,
    /// The drafter trained in the bubbles, saved with every checkpoint.
    drafter: DrafterSlot,
    /// The sum of a tied embedding's copies when the first and last stages are on
    /// different ranks ([`crate::model::tie`]).
    tie: Option<Arc<dyn GradSync>>,
}

/// The drafter whose state checkpoints save (set once, before the run).
#[derive(Default)]
struct DrafterSlot(std::sync::OnceLock<Arc<super::fill::DrafterFill>>);

impl std::fmt::Debug for DrafterSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "DrafterSlot(set)"
        } else {
            "DrafterSlot(none)"
        })
    }
}

impl Shared {
    pub fn new(ranks: usize, feed: Arc<StepFeed>, progress: Sender<StepMetrics>) -> Self {
        Shared {
            ranks,
            local: ranks,
            feed,
            state: Mutex::new(State {
                steps: BTreeMap::new(),
                finals: vec![None; ranks],
                last_done: Instant::now(),
            }),
            progress,
            replica: None,
            shards: Mutex::new(BTreeMap::new()),
            checkpointing: None,
            saves: Mutex::new(Saves::default()),
            stop: Arc::new(AtomicBool::new(false)),
            rank_checkpointer: None,
            drafter: DrafterSlot::default(),
            tie: None,
        }
    }

    /// Only `local` of the pipeline's ranks live in this process (a launched rank: 1):
    /// a step closes when they have stepped, and its log holds what they saw (the losses
    /// where the last stage is here; the norm of their own gradients).
    pub fn local_ranks(mut self, local: usize) -> Self {
        self.local = local.clamp(1, self.ranks);
        self
    }

    /// Sums a tied embedding's copies over `tie` (see [`Shared::tie_in_process`]).
    pub fn with_tie(mut self, tie: Option<Arc<dyn GradSync>>) -> Self {
        self.tie = tie;
        self
    }

    /// The exchange of a tied embedding's gradient between the ranks of `plan` that hold
    /// its first and its last stage, when they are different ranks of this process; `None`
    /// when the model is not tied or one rank holds both.
    pub fn tie_in_process(model: &GptConfig, plan: &Plan) -> Option<Arc<dyn GradSync>> {
        let pair = tie_ranks(model, plan)?;
        let ends = crate::comm::link::InProcessLink::group(plan.num_ranks())
            .into_iter()
            .map(|l| Arc::new(l) as Arc<dyn crate::comm::link::PeerLink>)
            .collect();
        Some(Arc::new(RingGradSync::tied(
            ends,
            plan.num_ranks(),
            pair,
            TIE_CHANNEL,
        )))
    }

    /// Sums this rank's copy of the tied embedding's gradient (`grad`, in the embedding's
    /// layout) with the other stage's, in place.
    pub fn sum_tied(&self, rank: usize, grad: &mut [f32]) -> Result<(), PipelineError> {
        let reason = |reason: String| PipelineError::Stage { stage: 0, reason };
        let Some(tie) = &self.tie else {
            return Err(reason(format!(
                "rank {rank} holds one copy of the tied embedding (tie_embeddings) and this \
                 run has no exchange with the rank holding the other"
            )));
        };
        tie.all_reduce(rank, grad)
            .map_err(|e| reason(format!("tied embedding gradient sum of rank {rank}: {e}")))
    }

    /// Saves sharded checkpoints as `checkpointing` says (`None`: never during the run).
    pub fn with_checkpoints(mut self, checkpointing: Option<Checkpointing>) -> Self {
        self.checkpointing = checkpointing;
        self
    }

    /// Hands every due rank state to `saver` (a multi-process rank's own writer) instead of
    /// gathering the ranks' states here.
    pub fn with_rank_checkpointer(mut self, saver: Arc<dyn RankCheckpointer>) -> Self {
        self.rank_checkpointer = Some(saver);
        self
    }

    /// Saves `fill`'s state with every periodic checkpoint (set once, before the run).
    pub fn checkpoint_drafter(&self, fill: Arc<super::fill::DrafterFill>) {
        let _ = self.drafter.0.set(fill);
    }

    /// Whether the ranks save their state after step `step`. Only the first data-parallel
    /// replica saves: the others hold the same state.
    pub fn checkpoint_due(&self, step: u64) -> bool {
        let first_replica = self.replica.as_ref().is_none_or(|r| r.index == 0);
        first_replica && self.checkpoint_step(step)
    }

    /// Stops the run at the ranks' next step end (each fails that step with a "stopped"
    /// error; the caller reports why it asked).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// Fails `rank`'s step once the run must stop ([`Shared::stop`], or a checkpoint
    /// write failed).
    pub fn check_stop(&self, rank: usize) -> Result<(), PipelineError> {
        let failed = self.rank_checkpointer.as_ref().is_some_and(|c| c.failed());
        match failed || self.stop.load(Ordering::Acquire) {
            true => Err(PipelineError::Stopped { rank }),
            false => Ok(()),
        }
    }

    /// `rank`'s state after step `step`; the last rank to deposit starts the writer, once
    /// the one before has finished (a write that failed fails this step: the run stops).
    pub fn deposit_checkpoint(
        &self,
        step: u64,
        rank: usize,
        fin: RankFinal,
    ) -> Result<(), PipelineError> {
        let Some(plan) = &self.checkpointing else {
            return Ok(());
        };
        if let Some(saver) = &self.rank_checkpointer {
            saver.deposit(step, rank, fin);
            return Ok(());
        }
        let mut saves = self.saves.lock().unwrap_or_else(PoisonError::into_inner);
        let slots = saves
            .pending
            .entry(step)
            .or_insert_with(|| vec![None; self.ranks]);
        slots[rank] = Some(fin);
        if slots.iter().any(Option::is_none) {
            return Ok(());
        }
        let finals: Vec<RankFinal> = saves
            .pending
            .remove(&step)
            .expect("just filled")
            .into_iter()
            .flatten()
            .collect();
        let plan = plan.clone();
        // Taken now, at the end of the step's last rank (the writer runs while the next
        // step's bubbles go on training the drafter).
        let drafter = self.drafter.0.get().map(|fill| fill.export_state());
        saves.settle();
        if saves.failed.is_some() {
            self.stop();
            return self.check_stop(rank);
        }
        let stop = Arc::clone(&self.stop);
        saves.writer = Some(std::thread::spawn(move || {
            let saved = save_finals(&plan, step + 1, finals, drafter);
            if saved.is_err() {
                stop.store(true, Ordering::Release);
            }
            saved
        }));
        Ok(())
    }

    /// Waits for every checkpoint writer; the directories written, in step order.
    /// The first write that failed is the error.
    pub fn join_checkpoints(&self) -> Result<Vec<PathBuf>, PipelineError> {
        let mut saves = self.saves.lock().unwrap_or_else(PoisonError::into_inner);
        saves.settle();
        if let Some(e) = saves.failed.take() {
            return Err(e.into());
        }
        let mut dirs = std::mem::take(&mut saves.written);
        drop(saves);
        if let Some(saver) = &self.rank_checkpointer {
            dirs.extend(saver.join()?);
        }
        dirs.sort();
        Ok(dirs)
    }

    /// Makes the ranks of this run one data-parallel replica (`None`: the whole batch).
    pub fn with_replica(mut self, replica: Option<Replica>) -> Self {
        self.replica = replica;
        self
    }

    /// This pipeline's place among the data-parallel replicas (`None`: the whole batch).
    pub fn replica(&self) -> Option<&Replica> {
        self.replica.as_ref()
    }

    /// Whether any replica saves its state after step `step` (the sharded optimizer's
    /// replicas gather their moments together then, see [`Shared::checkpoint_due`]).
    pub fn checkpoint_step(&self, step: u64) -> bool {
        self.checkpointing
            .as_ref()
            .is_some_and(|c| c.every > 0 && (step + 1).is_multiple_of(c.every))
    }

    /// Step `step`'s micro-batches as this pipeline runs them: the whole step, or a
    /// replica's share of it (with the whole batch's loss scales, see [`Replica`]).
    pub fn step_data(&self, step: u64) -> Arc<StepBatches> {
        let full = self.feed.get(step);
        let Some(r) = &self.replica else {
            return full;
        };
        let mut shards = self.shards.lock().unwrap_or_else(PoisonError::into_inner);
        let shard = shards.entry(step).or_insert_with(|| {
            let m = full.batches.len() / r.count;
            let own = r.index * m..(r.index + 1) * m;
            // A token loss sees the replica's micro-batches at their index in the step.
            let token_loss = full.token_loss.as_ref().map(|inner| {
                Arc::new(OffsetTokenLoss {
                    inner: Arc::clone(inner),
                    offset: own.start,
                }) as Arc<dyn TokenLoss>
            });
            Arc::new(StepBatches {
                batches: full.batches[own.clone()].to_vec(),
                scales: full.scales[own].to_vec(),
                token_loss,
            })
        });
        Arc::clone(shard)
    }

    /// Sums the gradients of pipeline rank `rank`'s `params` with the other replicas' (a
    /// no-op without replicas): all of them, concatenated in model order, in one all-reduce.
    /// The sum, as it was concatenated (`None`: no replicas).
    pub fn sync_grads<'a, B: Backend + 'a>(
        &self,
        rank: usize,
        backend: &B,
        params: impl IntoIterator<Item = &'a mut Param<B>>,
    ) -> Result<Option<Vec<f32>>, PipelineError> {
        let Some(r) = &self.replica else {
            return Ok(None);
        };
        let mut params: Vec<&mut Param<B>> = params.into_iter().collect();
        // Sized once: grown by doubling it would hold up to twice the gradients for a moment.
        let len = params.iter().map(|p| backend.len(&p.grad)).sum();
        let mut flat = Vec::with_capacity(len);
        for p in &params {
            flat.extend(backend.to_host(&p.grad).map_err(ModelError::from)?);
        }
        r.sync
            .all_reduce(rank, &mut flat)
            .map_err(|e| PipelineError::Stage {
                stage: 0,
                reason: format!(
                    "gradient all-reduce of rank {rank}, replica {}: {e}",
                    r.index
                ),
            })?;
        let mut rest = flat.as_slice();
        for p in &mut params {
            let n = backend.len(&p.grad);
            let dtype = backend.dtype(&p.grad);
            p.grad = backend
                .from_host(&rest[..n], dtype)
                .map_err(ModelError::from)?;
            rest = &rest[n..];
        }
        Ok(Some(flat))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the last stage's mean loss of `microbatch` in `step`.
    pub fn record_loss(&self, step: u64, microbatch: u32, loss: f32) {
        let mut state = self.lock();
        let entry = state.steps.entry(step).or_default();
        entry.losses.insert(microbatch, loss);
    }

    /// Posts this rank's per-stage, per-parameter `Σ g²` of `step` (for the step's
    /// reported norm, summed in model order once every rank has posted).
    pub fn post_sq_norms(&self, step: u64, own: Vec<(u32, Vec<f64>)>) {
        let mut state = self.lock();
        state.steps.entry(step).or_default().sq_norms.extend(own);
    }

    /// This rank's optimizer step of `step` is done. The last rank to finish it reports
    /// the step's metrics on the progress channel.
    pub fn stepped(&self, step: u64, lr: f32) {
        let mut state = self.lock();
        let entry = state.steps.entry(step).or_default();
        entry.stepped += 1;
        if entry.stepped < self.local {
            return;
        }
        let entry = state.steps.remove(&step).expect("just updated");
        // Model order: stages ascending, each stage's parameters in order, as the
        // reference trainer sums them.
        let grad_norm = entry
            .sq_norms
            .values()
            .flatten()
            .fold(0.0, |s, q| s + q)
            .sqrt();
        let now = Instant::now();
        let seconds = now.duration_since(state.last_done).as_secs_f64();
        state.last_done = now;
        drop(state);
        let batches = self.step_data(step);
        let losses: Vec<f32> = (0..batches.batches.len() as u32)
            .map(|mb| entry.losses.get(&mb).copied().unwrap_or(f32::NAN))
            .collect();
        let mut loss = combine_losses(&losses, &batches.scales);
        if self.replica.is_some() {
            // A replica's scales are its share of the whole batch's: its loss is the mean
            // over its own micro-batches.
            loss /= batches.scales.iter().sum::<f32>();
        }
        let metrics = StepMetrics {
            step,
            loss,
            lr,
            grad_norm: grad_norm as f32,
            tokens: batches.tokens(),
            seconds,
        };
        self.feed.evict_before(step + 1);
        let mut shards = self.shards.lock().unwrap_or_else(PoisonError::into_inner);
        *shards = shards.split_off(&(step + 1));
        drop(shards);
        // The trainer may have stopped listening (it failed); the step still happened.
        let _ = self.progress.send(metrics);
    }

    /// Hands over `rank`'s final parameters and optimizer state.
    pub fn deposit_final(&self, rank: usize, fin: RankFinal) {
        self.lock().finals[rank] = Some(fin);
    }

    /// `rank`'s own final state, in a process that runs only that rank (the others'
    /// finals live in their processes); `None` until it has deposited it.
    pub fn take_own_final(&self, rank: usize) -> Option<RankFinal> {
        self.lock().finals.get_mut(rank)?.take()
    }

    /// Every rank's final state, once all have deposited it.
    pub fn take_finals(&self) -> Option<Vec<RankFinal>> {
        let mut state = self.lock();
        if state.finals.iter().any(Option::is_none) {
            return None;
        }
        Some(
            state
                .finals
                .iter_mut()
                .map(|f| f.take().expect("checked"))
                .collect(),
        )
    }
}

#[cfg(test)]
#[path = "shared_tests.rs"]
mod tests;
