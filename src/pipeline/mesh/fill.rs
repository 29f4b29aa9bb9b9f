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
//!   other rank (the training rows even when there are none, so every copy of the buffer
//!   turns over with the last stage's), which adds them to its own copy of the buffers, in
//!   the same order.
//! - **Rounds.** Every post of the local replica (its gradients, and the frozen copies its
//!   rank deposited: [`RoundPost`]) goes to every other rank, after that step's rows, which
//!   adds it to its exchange ([`DrafterFill::post_remote`], or under the planned placement
//!   [`DrafterFill::post_remote_at`], keyed by the step); a round completes in every process
//!   with the same posts, so every replica applies the same update and the same copies.
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
//! shard's acknowledgement); under the planned placement also the kept round, made whole
//! from every rank's posts, and the last stage's own rows, both sent the same way ([`snap`]).
//! A resumed run's ranks read it back ([`drafter_of`]).
//!
//! **Placement.** Both placements run here. Under `drafter.placement = "planned"` every
//! process computes the same [`SlicePlan`] and its rank runs its planned slices
//! ([`crate::pipeline::fill`]'s `planned` module): what a slice computes is fixed by the
//! plan, only when it runs follows the rank's bubbles. A rank whose step ends before the
//! other processes' posts of the previous step's round (and, before them, that step's rows)
//! have arrived waits for them there, then runs its leftover slices and applies the round;
//! so the drafter is the in-process planned run's, bit for bit, and a resumed run continues
//! it exactly. A failed exchange thread ([`DrafterFill::abort`]) ends that wait with its
//! error (the mesh's heartbeat names a dead peer within seconds); otherwise it is bounded.
//! Checkpoints gather the round and the rows instead of waiting for them ([`snap`]).
//!
//! Filling never touches the target: the target's parameters are those of an unfilled run.

mod channel;
mod exchange;
pub(super) mod snap;

use crate::pipeline::error::PipelineError;
pub use channel::FILL_CHANNEL;
use channel::lock;
pub use snap::{DrafterSnap, PeerSnap};

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use pipefill_actors::{BubbleFiller, FillerRouter};

use super::shards::RankResume;
use crate::comm::link::PeerLink;
use crate::comm::tcp::TcpMesh;
use crate::config::JobConfig;
use crate::model::ModelError;
use crate::model::drafter::state::DrafterState;
use crate::model::drafter::{DrafterWeights, FROZEN};
use crate::pipeline::RankCompute;
use crate::pipeline::fill::{DrafterFill, SlicePlan};
use crate::profile::merge::{FILLER_LANE, MergedProfile};
use crate::profile::report::Filling;
use crate::schedules::Plan;
use crate::tensor::Backend;
use exchange::{FillWire, Peers, aborting, decode, encode, peer_err, receive, send_all};

/// This process's drafter replica in a multi-process run (see the module docs).
pub struct LaunchFill {
    rank: usize,
    /// Whether this process holds the last stage (which captures the rows).
    captures: bool,
    fill: Arc<DrafterFill>,
    router: FillerRouter,
    outbox: Mutex<Option<Sender<FillWire>>>,
    sender: Mutex<Option<JoinHandle<Result<(), PipelineError>>>>,
    receivers: Mutex<Vec<JoinHandle<Result<(), PipelineError>>>>,
}

impl std::fmt::Debug for LaunchFill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchFill")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

/// The drafter state a resumed run continues from, if its checkpoint saved one.
pub fn drafter_of(resume: &RankResume) -> Result<Option<DrafterState>, ModelError> {
    match resume {
        RankResume::Whole(c) => Ok(c.drafter.clone()),
        RankResume::Shard(s) => s.drafter(),
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
    ) -> Result<Arc<Self>, PipelineError> {
        let (rank, pp) = (mesh.rank(), plan.num_ranks());
        let last_stage = (plan.stages - 1) as u32;
        let holders = [plan.stage_rank[0], plan.stage_rank[last_stage as usize]];
        if holders[0] != 0 {
            return Err(PipelineError::FillPlan {
                rank,
                reason:
                    "the plan places stage 0 off rank 0: the drafter's frozen copies need it there"
                        .into(),
            });
        }
        let drafter_err = |source| PipelineError::FillDrafter { rank, source };
        // The frozen tables: this rank's own, and the others' from their holders (one copy
        // each crosses; the process's replicas share it).
        let mut tables: [Option<Vec<f32>>; 2] = [None, None];
        for ((name, stage), slot) in FROZEN.iter().zip([0, last_stage]).zip(&mut tables) {
            if let Some(chunk) = compute.chunk_ref(stage) {
                let values = chunk.param_values(name).map_err(drafter_err)?;
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
                *slot = Some(values);
            }
        }
        for ((name, holder), slot) in FROZEN.iter().zip(holders).zip(&mut tables) {
            if holder == rank {
                continue;
            }
            let bytes = mesh
                .recv(holder, FILL_CHANNEL)
                .map_err(|e| peer_err(rank, holder, e))?;
            match decode(rank, holder, &bytes)? {
                FillWire::Seed { name: got, values } if got == *name => *slot = Some(values),
                _ => {
                    return Err(PipelineError::FillPeer {
                        rank,
                        peer: holder,
                        reason: format!("sent something else than the seed of {name}"),
                    });
                }
            }
        }
        let [Some(embed), Some(head)] = tables else {
            return Err(PipelineError::FillPlan {
                rank,
                reason: "no rank holds the target's embedding or LM head".into(),
            });
        };
        let mut fill =
            DrafterFill::with_tables(&job.model, &job.drafter, pp, embed, head, first_step)
                .map_err(drafter_err)?;
        // The same pure function of the plan and the job in every process.
        let slices = SlicePlan::of_job(plan, job).map_err(|e| PipelineError::FillPlan {
            rank,
            reason: format!("the planned placement: {e}"),
        })?;
        if let Some(slices) = slices {
            fill.plan_slices(slices, first_step);
        }
        let fill = Arc::new(fill);
        compute
            .set_drafter(Arc::clone(&fill))
            .map_err(|e| PipelineError::FillPlan {
                rank,
                reason: e.to_string(),
            })?;
        if let Some(resume) = resume
            && let Some(state) = drafter_of(resume)
                .map_err(|source| PipelineError::FillCheckpoint { rank, source })?
        {
            fill.import_state(&state).map_err(drafter_err)?;
        }
        let held_taken = {
            let held = fill.held_out().lock();
            held.dropped() + held.len() as u64
        };
        let (outbox, rx) = channel();
        let captures = compute.chunk_ref(last_stage).is_some();
        fill.connect(
            rank,
            Arc::new(Peers {
                outbox: Mutex::new(outbox.clone()),
                capture: captures.then(|| (fill.buffer().clone(), fill.held_out().clone())),
                held_sent: Mutex::new(held_taken),
            }),
        );
        let router = FillerRouter::default();
        fill.attach(&router);
        let peers: Vec<usize> = (0..pp).filter(|&p| p != rank).collect();
        let sender = {
            let (mesh, peers, fill) = (Arc::clone(mesh), peers.clone(), Arc::clone(&fill));
            std::thread::spawn(move || aborting(&fill, send_all(rank, &mesh, &peers, rx)))
        };
        let receivers = peers
            .iter()
            .map(|&peer| {
                let (mesh, fill) = (Arc::clone(mesh), Arc::clone(&fill));
                std::thread::spawn(move || aborting(&fill, receive(rank, peer, &mesh, &fill)))
            })
            .collect();
        Ok(Arc::new(LaunchFill {
            rank,
            captures,
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
    pub fn finish(&self) -> Result<DrafterWeights, PipelineError> {
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
        let drafter_err = |source| PipelineError::FillDrafter {
            rank: self.rank,
            source,
        };
        let mut replicas = self.fill.settle().map_err(drafter_err)?;
        Ok(replicas.swap_remove(self.rank))
    }

    /// What a checkpoint keeps of the drafter now, on the stage thread at the step's end: on
    /// rank 0 the state (its replica's weights and optimizer, its copies of the buffers, the
    /// posts of the kept round it holds), elsewhere this replica's row sampler and, under the
    /// planned placement, the posts of the kept round this process holds and, on the last
    /// stage's rank, its rows; rank 0's writer puts them together (`assemble`).
    pub fn snapshot(&self) -> Result<DrafterSnap, ModelError> {
        let fill = &self.fill;
        Ok(match self.rank {
            0 => DrafterSnap::State(Box::new(fill.export_state()?)),
            r => DrafterSnap::Peer(Box::new(PeerSnap::new(
                fill.checkpoint_sampler(r)?,
                fill.checkpoint_round(),
                // Only the last stage's process captures rows; the others hold copies.
                fill.checkpoint_rows().filter(|_| self.captures),
            ))),
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

fn join(handle: JoinHandle<Result<(), PipelineError>>) -> Result<(), PipelineError> {
    match handle.join() {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}
