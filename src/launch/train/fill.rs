//! Bubble filling in a multi-process train job (`filler = "drafter"` under `pipefill launch`):
//! [`LaunchFill`].
//!
//! The drafter is the in-process run's ([`crate::pipeline::fill`]): one replica per pipeline
//! rank, each trained in its own rank's bubbles through a [`FillerRouter`], the replicas'
//! gradients exchanged in rounds and summed in replica order, so every replica applies the
//! same updates and stays bitwise equal. Here each replica lives in its own rank's process,
//! and what the in-process ranks share in memory travels on the mesh's [`FILL_CHANNEL`]:
//!
//! - **Seeds.** Before the run, the rank holding stage 0 sends the target's embedding and
//!   the rank holding the last stage its LM head to every other rank: each process builds
//!   its [`DrafterFill`] with those frozen copies (and stand-ins for the other ranks'
//!   replicas, which never train here).
//! - **Rows.** Only the last stage's process captures the rows the drafter trains on (and
//!   the held-out ones); at the end of each target step it sends that step's rows to every
//!   other rank, which adds them to its own copy of the buffers, in the same order.
//! - **Rounds.** Every post of the local replica (its gradients, and the frozen copies its
//!   rank deposited: [`RoundPost`]) goes to every other rank, which adds it to its exchange
//!   ([`DrafterFill::post_remote`]); a round completes in every process with the same posts,
//!   so every replica applies the same update and the same copies.
//!
//! One sender thread per process sends, so a stage thread only queues; one receiver thread
//! per peer receives. After the run every process sends `Done` and waits for every peer's,
//! so every post is in before the replicas settle ([`LaunchFill::finish`]).
//!
//! **Data parallelism.** With `dp` > 1 the drafter lives in replica 0's pipeline only: its
//! `pp` ranks hold the drafter replicas and exchange rounds among themselves, and it trains
//! on the rows of replica 0's share of each step's micro-batches; the other pipelines'
//! bubbles stay idle. (The replicas of the target are bitwise equal, so replica 0's rows are
//! those an unreplicated run's first micro-batches would give; adding the other replicas as
//! drafter replicas would only add gradient traffic across the data-parallel mesh.)
//!
//! **Checkpoints.** The drafter's state is saved with every checkpoint of the run, in the
//! in-process format ([`crate::model::checkpoint::drafter`]): rank 0's writer puts the file
//! into the step directory and names it in the manifest, with its own replica's weights and
//! optimizer, its copies of the buffers, and every rank's row sampler (sent with each
//! shard's acknowledgement). A resumed run's ranks read it back ([`drafter_of`]).
//!
//! The placement is the measured one: `drafter.placement = "planned"` is refused here.
//!
//! Filling never touches the target: the target's parameters are those of an unfilled run.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use pipefill_actors::{BubbleFiller, FillerRouter};
use serde::{Deserialize, Serialize};

use super::shards::RankResume;
use crate::comm::frame;
use crate::comm::link::{Channel, PeerLink};
use crate::comm::tcp::TcpMesh;
use crate::config::JobConfig;
use crate::data::SplitMix64;
use crate::model::checkpoint::CheckpointError;
use crate::model::checkpoint::drafter::load_drafter;
use crate::model::drafter::state::DrafterState;
use crate::model::drafter::{
    DraftBufferHandle, DraftRow, DrafterError, DrafterWeights, FROZEN, Placement,
};
use crate::model::{Cut, Gpt, ModelError};
use crate::pipeline::RankCompute;
use crate::pipeline::fill::{DrafterFill, RoundPeers, RoundPost};
use crate::profile::merge::{FILLER_LANE, MergedProfile};
use crate::profile::report::Filling;
use crate::schedules::Plan;
use crate::tensor::{Backend, CpuBackend};

/// Channel of the drafter's seeds, rows and rounds between the ranks of replica 0.
pub const FILL_CHANNEL: Channel = u32::MAX - 19;

/// Why launched filling failed.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    #[error("rank {rank}: filler = \"drafter\": {reason}")]
    Plan { rank: usize, reason: String },
    #[error("rank {rank}: the drafter's exchange with rank {peer}: {reason}")]
    Peer {
        rank: usize,
        peer: usize,
        reason: String,
    },
    #[error("rank {rank}: drafter: {source}")]
    Drafter {
        rank: usize,
        #[source]
        source: DrafterError,
    },
    #[error("rank {rank}: the resumed checkpoint's drafter: {source}")]
    Checkpoint {
        rank: usize,
        #[source]
        source: CheckpointError,
    },
}

/// A rank's part of the drafter in a checkpoint ([`LaunchFill::snapshot`]).
pub enum DrafterSnap {
    State(Box<DrafterState>),
    Sampler(SplitMix64),
}

/// What travels on [`FILL_CHANNEL`].
#[derive(Serialize, Deserialize)]
enum FillWire {
    /// A frozen copy's values (`embed.tok` or `head.w`) before the run.
    Seed { name: String, values: Vec<f32> },
    /// The rows the last stage captured in target step `step` (held out or for training).
    Rows {
        step: u64,
        held_out: bool,
        rows: Vec<RowWire>,
    },
    /// A post of the sender's replica.
    Post(RoundPost),
    /// The sender's run has ended: nothing follows.
    Done,
}

/// A [`DraftRow`] on the wire.
#[derive(Serialize, Deserialize)]
struct RowWire {
    hidden: Vec<f32>,
    targets: Vec<u32>,
    probs: Vec<f32>,
}

/// This process's drafter replica in a multi-process run (see the module docs).
pub struct LaunchFill {
    rank: usize,
    fill: Arc<DrafterFill>,
    router: FillerRouter,
    outbox: Mutex<Option<Sender<FillWire>>>,
    sender: Mutex<Option<JoinHandle<Result<(), FillError>>>>,
    receivers: Mutex<Vec<JoinHandle<Result<(), FillError>>>>,
}

impl std::fmt::Debug for LaunchFill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchFill")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The drafter state a resumed run continues from, if its checkpoint saved one.
pub fn drafter_of(resume: &RankResume) -> Result<Option<DrafterState>, CheckpointError> {
    match resume {
        RankResume::Whole(c) => Ok(c.drafter.clone()),
        RankResume::Shard(s) => match (&s.manifest.drafter, s.path.parent()) {
            (Some(entry), Some(dir)) => Ok(Some(load_drafter(dir, entry, &s.manifest.model)?)),
            _ => Ok(None),
        },
    }
}

impl LaunchFill {
    /// Joins the drafter of the run: pipeline rank `rank` of replica 0 (whose mesh ranks are
    /// `0..pp`), with its `compute` built (and resumed) for `plan` from target step
    /// `first_step`. Every rank of replica 0 calls it before the run.
    pub fn join<B: Backend>(
        job: &JobConfig,
        plan: &Plan,
        mesh: &Arc<TcpMesh>,
        compute: &mut RankCompute<B>,
        first_step: u64,
        resume: Option<&RankResume>,
    ) -> Result<Arc<Self>, FillError> {
        let (rank, pp) = (mesh.rank(), plan.num_ranks());
        // The planned placement needs each step's rows on every rank before its slices
        // sample them, which the exchange here does not wait for.
        if job.drafter.placement == Placement::Planned {
            return Err(FillError::Plan {
                rank,
                reason: "`drafter.placement = \"planned\"` runs in one process only for now; \
                         launched jobs use \"measured\""
                    .into(),
            });
        }
        let last_stage = (plan.stages - 1) as u32;
        let holders = [plan.stage_rank[0], plan.stage_rank[last_stage as usize]];
        if holders[0] != 0 {
            return Err(FillError::Plan {
                rank,
                reason:
                    "the plan places stage 0 off rank 0: the drafter's frozen copies need it there"
                        .into(),
            });
        }
        let drafter_err = |source| FillError::Drafter { rank, source };
        let model_err = |e: ModelError| drafter_err(DrafterError::Model(e));
        // The target as this process knows it: its own chunks' values, the others' initial
        // ones, and the frozen copies from their holders.
        let be = CpuBackend::new(1).map_err(|e| model_err(e.into()))?;
        let mut target = Gpt::new(&job.model, be, &Cut::Even(1)).map_err(model_err)?;
        for (name, stage) in FROZEN.iter().zip([0, last_stage]) {
            if let Some(chunk) = compute.chunk_ref(stage) {
                let values = chunk.param_values(name).map_err(model_err)?;
                let seed = FillWire::Seed {
                    name: name.to_string(),
                    values,
                };
                let bytes = encode(rank, &seed)?;
                for peer in (0..pp).filter(|&p| p != rank) {
                    mesh.send(peer, FILL_CHANNEL, &bytes)
                        .map_err(|e| peer_err(rank, peer, e))?;
                }
                let FillWire::Seed { values, .. } = seed else {
                    unreachable!("built above")
                };
                target.set_param(name, &values).map_err(model_err)?;
            }
        }
        for (name, holder) in FROZEN.iter().zip(holders) {
            if holder == rank {
                continue;
            }
            let bytes = mesh
                .recv(holder, FILL_CHANNEL)
                .map_err(|e| peer_err(rank, holder, e))?;
            match decode(rank, holder, &bytes)? {
                FillWire::Seed { name: got, values } if got == *name => {
                    target.set_param(name, &values).map_err(model_err)?;
                }
                _ => {
                    return Err(FillError::Peer {
                        rank,
                        peer: holder,
                        reason: format!("sent something else than the seed of {name}"),
                    });
                }
            }
        }
        let chunk = &target.chunks()[0];
        let fill = Arc::new(
            DrafterFill::new(&job.model, &job.drafter, pp, chunk, chunk, first_step)
                .map_err(drafter_err)?,
        );
        compute
            .set_drafter(Arc::clone(&fill))
            .map_err(|e| FillError::Plan {
                rank,
                reason: e.to_string(),
            })?;
        if let Some(resume) = resume
            && let Some(state) =
                drafter_of(resume).map_err(|source| FillError::Checkpoint { rank, source })?
        {
            fill.import_state(&state).map_err(drafter_err)?;
        }
        let held_taken = {
            let held = fill.held_out().lock();
            held.dropped() + held.len() as u64
        };
        let (outbox, rx) = channel();
        fill.connect(Arc::new(Peers {
            outbox: Mutex::new(outbox.clone()),
            capture: compute
                .chunk_ref(last_stage)
                .map(|_| (fill.buffer().clone(), fill.held_out().clone())),
            held_sent: Mutex::new(held_taken),
        }));
        let router = FillerRouter::default();
        fill.attach(&router);
        let peers: Vec<usize> = (0..pp).filter(|&p| p != rank).collect();
        let sender = {
            let (mesh, peers) = (Arc::clone(mesh), peers.clone());
            std::thread::spawn(move || send_all(rank, &mesh, &peers, rx))
        };
        let receivers = peers
            .iter()
            .map(|&peer| {
                let (mesh, fill) = (Arc::clone(mesh), Arc::clone(&fill));
                std::thread::spawn(move || receive(rank, peer, &mesh, &fill))
            })
            .collect();
        Ok(Arc::new(LaunchFill {
            rank,
            fill,
            router,
            outbox: Mutex::new(Some(outbox)),
            sender: Mutex::new(Some(sender)),
            receivers: Mutex::new(receivers),
        }))
    }

    /// The runtime's filler for this process's rank.
    pub fn filler(&self) -> Box<dyn BubbleFiller> {
        Box::new(self.router.filler(self.rank))
    }

    /// After the run: says `Done` to every peer, waits for theirs (so every post is in),
    /// and settles the replica. Returns its weights.
    pub fn finish(&self) -> Result<DrafterWeights, FillError> {
        if let Some(outbox) = lock(&self.outbox).take() {
            // A sender that stopped has failed: its join below says why.
            let _ = outbox.send(FillWire::Done);
        }
        let sender = lock(&self.sender).take();
        if let Some(sender) = sender {
            join(sender)?;
        }
        for receiver in std::mem::take(&mut *lock(&self.receivers)) {
            join(receiver)?;
        }
        let drafter_err = |source| FillError::Drafter {
            rank: self.rank,
            source,
        };
        let mut replicas = self.fill.settle().map_err(drafter_err)?;
        Ok(replicas.swap_remove(self.rank))
    }

    /// What a checkpoint keeps of the drafter now: on rank 0 the state (its replica's
    /// weights and optimizer, its copies of the buffers; the other ranks' samplers are
    /// filled in from their acknowledgements), elsewhere this replica's row sampler.
    pub fn snapshot(&self) -> Result<DrafterSnap, DrafterError> {
        let state = self.fill.export_state()?;
        Ok(match self.rank {
            0 => DrafterSnap::State(Box::new(state)),
            r => DrafterSnap::Sampler(state.samplers[r]),
        })
    }

    /// Rank 0: the filler figures of the merged run (the filler lane's spans against the
    /// merged timeline's bubbles), for the report.
    pub fn measure(merged: &MergedProfile) -> Filling {
        let spans: Vec<(usize, f64, f64)> = merged
            .lanes
            .iter()
            .filter(|l| l.lane == FILLER_LANE)
            .map(|l| (l.rank, l.start, l.end))
            .collect();
        Filling::measure("drafter", &merged.overall, &spans)
    }
}

fn join(handle: JoinHandle<Result<(), FillError>>) -> Result<(), FillError> {
    match handle.join() {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn peer_err(rank: usize, peer: usize, e: impl std::fmt::Display) -> FillError {
    FillError::Peer {
        rank,
        peer,
        reason: e.to_string(),
    }
}

fn encode(rank: usize, wire: &FillWire) -> Result<Vec<u8>, FillError> {
    frame::encode(wire).map_err(|e| FillError::Plan {
        rank,
        reason: format!("encoding a drafter message: {e}"),
    })
}

fn decode(rank: usize, peer: usize, bytes: &[u8]) -> Result<FillWire, FillError> {
    frame::decode(bytes).map_err(|e| peer_err(rank, peer, format!("undecodable message: {e}")))
}

/// What the stage thread tells the other processes at the end of each of its target steps.
struct Peers {
    outbox: Mutex<Sender<FillWire>>,
    /// The training and held-out buffers, on the process of the last stage (whose rows go
    /// to every other process).
    capture: Option<(DraftBufferHandle, DraftBufferHandle)>,
    /// Held-out rows taken so far (sent or dropped before the step end).
    held_sent: Mutex<u64>,
}

impl RoundPeers for Peers {
    fn step_end(
        &self,
        _rank: usize,
        step: u64,
        post: Option<&RoundPost>,
    ) -> Result<(), DrafterError> {
        let mut messages = Vec::new();
        if let Some((buffer, held_out)) = &self.capture {
            let wire = |r: &DraftRow| RowWire {
                hidden: r.hidden.clone(),
                targets: r.targets.clone(),
                probs: r.probs.clone(),
            };
            let rows: Vec<RowWire> = buffer
                .lock()
                .rows()
                .filter(|r| r.step == step)
                .map(wire)
                .collect();
            // The held-out buffer is one generation that never turns over (its rows all
            // say step 0): what it took since the last step end is its newest rows.
            let held: Vec<RowWire> = {
                let held_out = held_out.lock();
                let taken = held_out.dropped() + held_out.len() as u64;
                let mut sent = lock(&self.held_sent);
                let new = (taken - *sent).min(held_out.len() as u64) as usize;
                *sent = taken;
                let skip = held_out.len() - new;
                held_out.rows().skip(skip).map(wire).collect()
            };
            for (held_out, rows) in [(false, rows), (true, held)] {
                if !rows.is_empty() {
                    messages.push(FillWire::Rows {
                        step,
                        held_out,
                        rows,
                    });
                }
            }
        }
        messages.extend(post.cloned().map(FillWire::Post));
        let outbox = lock(&self.outbox);
        for m in messages {
            outbox.send(m).map_err(|_| DrafterError::Input {
                what: "exchange",
                reason: "the sender to the other processes has stopped".into(),
            })?;
        }
        Ok(())
    }
}

/// The sender thread: every queued message to every peer, in order, until `Done`.
fn send_all(
    rank: usize,
    mesh: &TcpMesh,
    peers: &[usize],
    rx: Receiver<FillWire>,
) -> Result<(), FillError> {
    for wire in rx {
        let done = matches!(wire, FillWire::Done);
        let bytes = encode(rank, &wire)?;
        for &peer in peers {
            mesh.send(peer, FILL_CHANNEL, &bytes)
                .map_err(|e| peer_err(rank, peer, mesh.failure().unwrap_or(e.to_string())))?;
        }
        if done {
            break;
        }
    }
    Ok(())
}

/// A receiver thread: `peer`'s rows into this process's buffers, its posts into the
/// exchange, until its `Done`.
fn receive(rank: usize, peer: usize, mesh: &TcpMesh, fill: &DrafterFill) -> Result<(), FillError> {
    let drafter_err = |e: DrafterError| peer_err(rank, peer, e);
    loop {
        let bytes = mesh
            .recv(peer, FILL_CHANNEL)
            .map_err(|e| peer_err(rank, peer, mesh.failure().unwrap_or(e.to_string())))?;
        match decode(rank, peer, &bytes)? {
            FillWire::Rows {
                step,
                held_out,
                rows,
            } => {
                // As on the last stage: the training buffer turns over by step, the
                // held-out one never does.
                let handle = if held_out {
                    fill.held_out()
                } else {
                    fill.buffer()
                };
                let mut buffer = handle.lock();
                if !held_out {
                    buffer.begin_step(step);
                }
                for r in rows {
                    buffer
                        .push(DraftRow {
                            hidden: r.hidden,
                            targets: r.targets,
                            probs: r.probs,
                            step,
                        })
                        .map_err(drafter_err)?;
                }
            }
            FillWire::Post(post) => fill.post_remote(post).map_err(drafter_err)?,
            FillWire::Done => return Ok(()),
            FillWire::Seed { name, .. } => {
                return Err(peer_err(
                    rank,
                    peer,
                    format!("sent seed {name} during the run"),
                ));
            }
        }
    }
}
