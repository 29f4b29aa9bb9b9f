//! Sharded checkpoints of a multi-process run: every rank writes its own shard, and rank 0
//! writes the manifest once every shard is durably on disk.
//!
//! - **Where** ([`agree_run_dir`]): the run directory is rank 0's choice (the job's
//!   `out_dir`, or `runs/distributed-<start time>`), sent to every rank before the first step,
//!   so that all shards of a checkpoint land in one `checkpoints/step-N/`.
//! - **When**: after every `checkpoint_every`-th step (the runtime's [`Shared::checkpoint_due`])
//!   and after the last step. Only replica 0's ranks write: with `dp` > 1 the replicas hold
//!   bitwise the same state, and the manifest says so (`replicas_saved = 1`).
//! - **How** ([`MeshCheckpointer`]): a rank's state is handed to one writer thread per process,
//!   off the stage thread, which handles checkpoints in step order. Each writer removes the
//!   step's old manifest (a run resumed into its own directory saves over its old steps),
//!   writes its shard through a synced temporary file and a rename, syncs the directory, and
//!   then acknowledges: rank 0's writer collects its pipeline's acknowledgements on
//!   [`CHECKPOINT_CHANNEL`] — each carries the shard's size and hash, or the writer's error —
//!   and only then writes the manifest. A checkpoint without its manifest is never resumed
//!   from ([`crate::model::checkpoint::resume::ResumePoint::find`]).
//! - **How many** (`checkpoint_keep`): once a manifest is written, rank 0's writer hands the
//!   checkpoint to the run's [`Retention`](crate::model::checkpoint::retain::Retention),
//!   which deletes this run's complete checkpoints older than the newest `keep` — the same
//!   one the in-process pipeline uses. [`MeshCheckpointer`]'s `join` then lists the ones kept.
//! - **Resume** ([`RankResume`]): each rank reads only its own shard (see
//!   [`RankShard::load`]), or the whole-model checkpoint when the run resumes from one.
//! - **Drafter** ([`MeshCheckpointer::save_drafter`], when the run fills its bubbles): each
//!   rank snapshots its drafter replica when it deposits its state (at the step's end),
//!   every other rank's acknowledgement carries its part ([`PeerSnap`]: its row sampler,
//!   and under the planned placement its posts of the kept round and the last stage's rows),
//!   and rank 0 assembles and writes the drafter's file ([`super::fill`]) before the
//!   manifest, which names it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::comm::CommError;
use crate::comm::frame;
use crate::comm::link::{Channel, PeerLink};
use crate::comm::tcp::TcpMesh;
use crate::config::JobConfig;
use crate::model::ModelError;
use crate::model::checkpoint::drafter::save_drafter;
use crate::model::checkpoint::resume::{RankShard, ResumePoint};
use crate::model::checkpoint::sharded::{
    self, Layout, Manifest, SHARDED_FORMAT, ShardEntry, remove_manifest, step_dir,
};
use crate::model::checkpoint::sweep;
use crate::model::checkpoint::{Checkpoint, HostTensor, VERSION};
use crate::pipeline::error::PipelineError;
use crate::pipeline::shared::{Checkpointing, RankCheckpointer, RankFinal};
use crate::schedules::Plan;

use super::fill::LaunchFill;
use super::fill::snap::{DrafterSnap, PeerSnap, assemble};

/// Channel of the run directory (rank 0 to every rank) and of the shard acknowledgements
/// (replica 0's ranks to rank 0).
/// (Not `u32::MAX - 16`: that is NCCL's id exchange, `comm::nccl_id::NCCL_ID_CHANNEL`.)
pub const CHECKPOINT_CHANNEL: Channel = u32::MAX - 10;

/// What `--resume` gives one rank of a multi-process run.
#[derive(Debug, Clone)]
pub enum RankResume {
    /// The whole model (a whole-model checkpoint, read by every rank).
    Whole(Box<Checkpoint>),
    /// This rank's own shard of a sharded checkpoint.
    Shard(Box<RankShard>),
}

impl RankResume {
    /// Global rank `rank`'s share of `point` for `job` run as `plan` with `job.dp` replicas:
    /// a sharded checkpoint must have been written by the same layout and job settings.
    pub fn load(
        point: &ResumePoint,
        job: &JobConfig,
        plan: &Plan,
        rank: usize,
    ) -> Result<Self, ModelError> {
        match point {
            ResumePoint::Whole(dir) => Ok(RankResume::Whole(Box::new(Checkpoint::load(dir)?))),
            ResumePoint::Sharded(dir) => Ok(RankResume::Shard(Box::new(RankShard::load(
                dir,
                &layout(job, plan),
                &job.fingerprint(),
                rank,
            )?))),
        }
    }

    /// The step the run resumes at.
    pub fn step(&self) -> u64 {
        match self {
            RankResume::Whole(c) => c.meta.step,
            RankResume::Shard(s) => s.manifest.step,
        }
    }

    /// The checkpoint the rank loads: the whole one, or its shard's tensors alone.
    /// The model and moments this rank starts from ([`crate::pipeline::executor::rebuild`]).
    pub(crate) fn rebuilt(
        &self,
        job: &JobConfig,
    ) -> Result<
        (
            crate::model::Gpt<crate::tensor::CpuBackend>,
            crate::model::OptimizerState,
        ),
        PipelineError,
    > {
        match self {
            RankResume::Whole(c) => crate::pipeline::executor::rebuild(job, c, true),
            RankResume::Shard(s) => crate::pipeline::executor::rebuild(job, &s.checkpoint(), false),
        }
    }

    pub fn checkpoint(&self) -> Checkpoint {
        match self {
            RankResume::Whole(c) => (**c).clone(),
            RankResume::Shard(s) => s.checkpoint(),
        }
    }
}

/// The layout of `job` run as `plan` (`job.dp` replicas of its ranks).
pub fn layout(job: &JobConfig, plan: &Plan) -> Layout {
    Layout {
        dp: job.dp,
        stage_rank: plan.stage_rank.clone(),
    }
}

/// The run directory of the job: rank 0's `proposed` (or `runs/distributed-<seconds>`), sent
/// to every other rank, which returns it.
pub fn agree_run_dir(mesh: &TcpMesh, proposed: Option<&Path>) -> Result<PathBuf, CommError> {
    let protocol = |peer, reason: String| CommError::Protocol { peer, reason };
    if mesh.rank() != 0 {
        let bytes = mesh.recv(0, CHECKPOINT_CHANNEL)?;
        return frame::decode(&bytes).map_err(|e| protocol(0, format!("run directory: {e}")));
    }
    let dir = proposed.map(Path::to_path_buf).unwrap_or_else(|| {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        PathBuf::from("runs").join(format!("distributed-{secs}"))
    });
    let bytes = frame::encode(&dir).map_err(|e| protocol(0, format!("run directory: {e}")))?;
    for peer in 1..mesh.world() {
        mesh.send(peer, CHECKPOINT_CHANNEL, &bytes)?;
    }
    Ok(dir)
}

/// A writer's acknowledgement of its shard of checkpoint `step`.
#[derive(Serialize, Deserialize)]
struct Ack {
    step: u64,
    entry: Result<ShardEntry, String>,
    /// The rank's part of the drafter at the step's end (runs that fill their bubbles).
    sampler: Option<Result<PeerSnap, String>>,
}

type Worker = JoinHandle<Result<Vec<PathBuf>, ModelError>>;

/// A rank's state at a step's end, and its drafter's when the run trains one.
type Job = (u64, RankFinal, Option<Result<DrafterSnap, String>>);

/// This process's shard writer (see the module docs).
pub struct MeshCheckpointer {
    jobs: Mutex<Option<SyncSender<Job>>>,
    worker: Mutex<Option<Worker>>,
    /// Set by the writer when a save fails: the run stops at its ranks' next step end.
    failed: Arc<AtomicBool>,
    drafter: OnceLock<Arc<LaunchFill>>,
}

impl std::fmt::Debug for MeshCheckpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshCheckpointer").finish_non_exhaustive()
    }
}

/// What the writer thread needs.
struct Writer {
    mesh: Arc<TcpMesh>,
    plan: Checkpointing,
}

impl MeshCheckpointer {
    /// The writer of this process's rank (its mesh rank, in replica 0 when it writes at all),
    /// saving under `plan.run_dir`.
    pub fn start(mesh: Arc<TcpMesh>, plan: Checkpointing) -> Self {
        // One checkpoint queued behind the one being written, as in one process: a rank
        // that checkpoints faster than the disk takes waits instead of holding every
        // step's state in memory.
        let (jobs, rx) = sync_channel::<Job>(1);
        let writer = Writer { mesh, plan };
        let failed = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&failed);
        let worker = std::thread::spawn(move || {
            let mut dirs = Vec::new();
            for (step, fin, drafter) in rx {
                let (dir, removed) = writer.save(step + 1, fin, drafter).map_err(|e| {
                    flag.store(true, Ordering::SeqCst);
                    // What the write left goes; the error names the last complete one.
                    let run_dir = &writer.plan.run_dir;
                    let dir = step_dir(run_dir, step + 1);
                    sweep::failed_periodic(run_dir, &dir, step + 1, e)
                })?;
                dirs.push(dir);
                dirs.retain(|d| !removed.contains(d));
            }
            Ok(dirs)
        });
        MeshCheckpointer {
            jobs: Mutex::new(Some(jobs)),
            worker: Mutex::new(Some(worker)),
            failed,
            drafter: OnceLock::new(),
        }
    }

    /// Saves `fill`'s drafter with every checkpoint (set once, before the run).
    pub fn save_drafter(&self, fill: Arc<LaunchFill>) {
        let _ = self.drafter.set(fill);
    }
}

impl RankCheckpointer for MeshCheckpointer {
    fn deposit(&self, step: u64, _rank: usize, fin: RankFinal) {
        // The drafter as it stands at this step's end, on the depositing stage thread.
        let drafter = self
            .drafter
            .get()
            .map(|d| d.snapshot().map_err(|e| e.to_string()));
        let jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        // A writer that stopped has failed: `join` reports its error.
        if let Some(tx) = jobs.as_ref() {
            let _ = tx.send((step, fin, drafter));
        }
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    fn join(&self) -> Result<Vec<PathBuf>, ModelError> {
        drop(
            self.jobs
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        let worker = self
            .worker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match worker.map(JoinHandle::join) {
            None => Ok(Vec::new()),
            Some(Ok(dirs)) => dirs,
            Some(Err(panic)) => std::panic::resume_unwind(panic),
        }
    }
}

impl Writer {
    /// Writes this rank's shard of the checkpoint of `next_step` (steps done); on rank 0
    /// also waits for the others', writes the manifest and applies `checkpoint_keep`.
    /// Returns the directory, and the older ones that deleted.
    fn save(
        &self,
        next_step: u64,
        fin: RankFinal,
        drafter: Option<Result<DrafterSnap, String>>,
    ) -> Result<(PathBuf, Vec<PathBuf>), ModelError> {
        let (rank, plan) = (self.mesh.rank(), &self.plan);
        let started = Instant::now();
        let dir = step_dir(&plan.run_dir, next_step);
        let optimizer_step = fin.optimizer.step;
        let written = remove_manifest(&dir).and_then(|()| {
            let tensors = shard_tensors(plan, next_step, fin);
            sharded::write_shard(&dir, rank, &tensors)
        });
        let peer_err = |rank, reason: String| ModelError::ShardPeer {
            path: dir.clone(),
            rank,
            reason,
        };
        if rank != 0 {
            let sampler = drafter.map(|d| match d? {
                DrafterSnap::Peer(s) => Ok(*s),
                DrafterSnap::State(_) => Err("only rank 0 snapshots the whole drafter".into()),
            });
            let ack = Ack {
                step: next_step,
                entry: written.as_ref().map_err(ToString::to_string).cloned(),
                sampler,
            };
            let bytes = frame::encode(&ack).map_err(|e| peer_err(rank, e.to_string()))?;
            self.mesh
                .send(0, CHECKPOINT_CHANNEL, &bytes)
                .map_err(|e| peer_err(0, e.to_string()))?;
            written?;
            return Ok((dir, Vec::new()));
        }
        let mut shards = vec![written?];
        let mut samplers = Vec::new();
        for from in 1..plan.layout.pp() {
            let bytes = self
                .mesh
                .recv(from, CHECKPOINT_CHANNEL)
                .map_err(|e| peer_err(from, e.to_string()))?;
            let ack: Ack = frame::decode(&bytes).map_err(|e| peer_err(from, e.to_string()))?;
            if ack.step != next_step {
                return Err(peer_err(
                    from,
                    format!("acknowledged step {}, expected {next_step}", ack.step),
                ));
            }
            shards.push(ack.entry.map_err(|reason| peer_err(from, reason))?);
            if let Some(sampler) = ack.sampler {
                samplers.push((from, sampler.map_err(|reason| peer_err(from, reason))?));
            }
        }
        // The drafter's file goes in before the manifest that names it.
        let drafter = match drafter.transpose().map_err(|reason| peer_err(0, reason))? {
            Some(DrafterSnap::State(state)) => {
                let state = assemble(*state, samplers).map_err(|(from, e)| peer_err(from, e))?;
                Some(save_drafter(&dir, &state, &plan.model)?)
            }
            Some(DrafterSnap::Peer(_)) => {
                return Err(peer_err(0, "rank 0 snapshotted only its sampler".into()));
            }
            None => None,
        };
        let manifest = Manifest {
            format: SHARDED_FORMAT.into(),
            version: VERSION,
            step: next_step,
            world: plan.layout.world(),
            layout: plan.layout.clone(),
            config_hash: plan.config_hash.clone(),
            model: plan.model.clone(),
            optimizer_step,
            data_seed: plan.data_seed,
            notes: Default::default(),
            replicas_saved: Some(1),
            shards,
            drafter,
        };
        manifest.write(&dir)?;
        tracing::info!(
            "checkpoint {}: {} shards, {} bytes, complete {:.1} ms after rank 0 began its shard",
            dir.display(),
            manifest.shards.len(),
            manifest.shards.iter().map(|s| s.bytes).sum::<u64>(),
            1e3 * started.elapsed().as_secs_f64()
        );
        let removed = plan.retention.completed(&dir, &manifest)?;
        Ok((dir, removed))
    }
}

/// A rank's state as shard tensors: its stages' parameters in model order, then their
/// optimizer moments (as the whole-model checkpoint names them).
fn shard_tensors(plan: &Checkpointing, next_step: u64, mut fin: RankFinal) -> Vec<HostTensor> {
    fin.stages.sort_by_key(|(s, _)| *s);
    let params = fin.stages.into_iter().flat_map(|(_, ts)| ts).collect();
    sharded::from_state(
        plan.model.clone(),
        plan.data_seed,
        next_step,
        params,
        &fin.optimizer,
    )
    .tensors
}
