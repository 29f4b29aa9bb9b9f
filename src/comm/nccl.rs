//! NCCL between GPUs (feature `cuda`): the unique-id exchange, a communicator on its own
//! thread, point-to-point send/recv for stage links and the sum all-reduce behind
//! [`NcclGradSync`], the data-parallel [`GradSync`] on GPUs.
//!
//! Why an owning thread: cudarc's `nccl::Comm` is not `Send`, while the runtime hands
//! gradient syncs and transports to actors on other threads. [`NcclComm`] therefore creates
//! its context, stream and `Comm` on a thread of its own and takes commands over a channel;
//! the handle is `Send + Sync`. Buffers move to the thread and back by value, and every
//! command waits for the stream, so a returned buffer is ready to read on any stream.
//!
//! Why a probe first: cudarc loads the driver and libnccl dynamically and *panics* when one
//! is missing, so [`probe`] dlopens both before any other cudarc call and answers with the
//! same clear error as the CUDA backend ("no CUDA driver found; use --device cpu"); the
//! remaining cudarc calls run under `catch_unwind` as in `tensor::cuda`.
//!
//! The id exchange ([`share_id`]): NCCL ranks meet through a 128-byte unique id that one
//! member creates. It travels over the job's [`PeerLink`] (the TCP mesh set up by the
//! rendezvous on rank 0), on a channel of its own, from the group's first member to the
//! others. The frame carries either the id or the leader's error, so a leader that cannot
//! create one fails every member with its reason instead of leaving them waiting.
//!
//! Not wired yet: a `Transport<CudaBuf>` for the runtime's stage links. `CudaBuf` keeps its
//! `CudaSlice` private to `tensor::cuda`, so the transport needs an accessor there (take the
//! `f32` slice out of a buffer and build one from a slice); with it, a transport sends an
//! activation with [`NcclComm::send`] and receives into a buffer of the shape the schedule
//! predicts with [`NcclComm::recv`]. NCCL p2p has no tags: both ends must post in the same
//! order, which the plan's fixed per-link order gives.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp};

use super::collective::{CollectiveError, GradSync};
use super::link::{Channel, LinkError, PeerLink};
use crate::tensor::device::{Device, DeviceError};

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const NCCL_ID_BYTES: usize = 128;

/// The [`PeerLink`] channel the data-parallel groups' ids travel on (next to the
/// transports' channels in `tcp_transport`). Groups with different leaders may share it.
pub const NCCL_ID_CHANNEL: Channel = u32::MAX - 4;

/// Frame tags of the id exchange.
const ID_FRAME: u8 = 1;
const LEADER_FAILED_FRAME: u8 = 0;

/// Errors of the NCCL layer; each names the rank, peer or operation.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    /// The driver or libnccl is missing, or the GPU does not exist.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// An NCCL id frame of the wrong size or kind.
    #[error("NCCL id from rank {from}: {reason}")]
    BadId { from: usize, reason: String },
    /// The group's first member could not create the id.
    #[error("rank {leader} could not create the NCCL id: {reason}")]
    LeaderFailed { leader: usize, reason: String },
    /// This rank is not in the group it asked to join.
    #[error("rank {rank} is not a member of the NCCL group {group:?}")]
    NotMember { rank: usize, group: Vec<usize> },
    /// A peer outside the communicator, or the rank itself.
    #[error("NCCL rank {rank}: peer {peer} is not another rank of a world of {world}")]
    BadPeer {
        rank: usize,
        peer: usize,
        world: usize,
    },
    /// An NCCL or CUDA call failed (or panicked inside cudarc).
    #[error("NCCL rank {rank}: {op}: {message}")]
    Call {
        rank: usize,
        op: &'static str,
        message: String,
    },
    /// The communicator's thread is gone (it failed earlier or panicked).
    #[error("NCCL rank {rank}: the communicator thread has stopped")]
    Stopped { rank: usize },
    #[error(transparent)]
    Link(#[from] LinkError),
}

/// The error for the presence of the driver and libnccl, in the order they are needed.
fn check_libraries(driver: bool, nccl: bool) -> Result<(), NcclError> {
    if !driver {
        return Err(DeviceError::NoCudaDriver.into());
    }
    if !nccl {
        return Err(DeviceError::MissingCudaLibrary {
            library: "NCCL (libnccl)",
        }
        .into());
    }
    Ok(())
}

/// Checks that the CUDA driver and libnccl can be loaded: the only safe first step, since
/// any other cudarc call panics when its library is missing.
pub fn probe() -> Result<(), NcclError> {
    // SAFETY: these only try to dlopen the library names cudarc would use and close them.
    let (driver, nccl) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nccl::sys::is_culib_present(),
        )
    };
    check_libraries(driver, nccl)
}

/// Text of a panic payload.
fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "cudarc panicked".into())
}

/// Runs a cudarc call, turning its error or panic into [`NcclError::Call`].
fn call<T, E: std::fmt::Debug>(
    rank: usize,
    op: &'static str,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, NcclError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(NcclError::Call {
            rank,
            op,
            message: format!("{e:?}"),
        }),
        Err(p) => Err(NcclError::Call {
            rank,
            op,
            message: panic_text(p),
        }),
    }
}

/// An NCCL unique id: the rendezvous token of one communicator.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; NCCL_ID_BYTES]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The first bytes identify it in logs; the rest is noise.
        write!(f, "NcclId({:02x?}…)", &self.0[..8])
    }
}

impl NcclId {
    /// A fresh id from libnccl (after the [`probe`]).
    pub fn create() -> Result<Self, NcclError> {
        probe()?;
        let id = call(0, "ncclGetUniqueId", Id::new)?;
        // `c_char` is `i8` or `u8` by platform; the bits are what travels.
        Ok(NcclId(id.internal().map(|c| c as u8)))
    }

    /// The id in `bytes`, which must be exactly [`NCCL_ID_BYTES`] long.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(NcclId)
    }

    pub fn as_bytes(&self) -> &[u8; NCCL_ID_BYTES] {
        &self.0
    }

    fn to_cudarc(self) -> Id {
        Id::uninit(self.0.map(|b| b as std::ffi::c_char))
    }
}

/// Gives every member of `group` (global ranks; the first is the leader) the same id: the
/// leader runs `create` and sends the outcome to the others on `channel` of `link`.
/// Communicators whose groups share a leader must use different channels.
pub fn share_id(
    link: &dyn PeerLink,
    group: &[usize],
    channel: Channel,
    create: impl FnOnce() -> Result<NcclId, NcclError>,
) -> Result<NcclId, NcclError> {
    let rank = link.rank();
    let not_member = || NcclError::NotMember {
        rank,
        group: group.to_vec(),
    };
    let &leader = group.first().ok_or_else(not_member)?;
    if !group.contains(&rank) {
        return Err(not_member());
    }
    if rank == leader {
        let made = create();
        let frame = match &made {
            Ok(id) => [&[ID_FRAME][..], id.as_bytes()].concat(),
            Err(e) => [&[LEADER_FAILED_FRAME][..], e.to_string().as_bytes()].concat(),
        };
        for &peer in group.iter().filter(|&&r| r != leader) {
            link.send(peer, channel, &frame)?;
        }
        return made;
    }
    let frame = link.recv(leader, channel)?;
    match frame.split_first() {
        Some((&ID_FRAME, id)) => NcclId::from_bytes(id).ok_or_else(|| NcclError::BadId {
            from: leader,
            reason: format!("{} bytes, expected {NCCL_ID_BYTES}", id.len()),
        }),
        Some((&LEADER_FAILED_FRAME, reason)) => Err(NcclError::LeaderFailed {
            leader,
            reason: String::from_utf8_lossy(reason).into_owned(),
        }),
        Some((tag, _)) => Err(NcclError::BadId {
            from: leader,
            reason: format!("unknown frame tag {tag}"),
        }),
        None => Err(NcclError::BadId {
            from: leader,
            reason: "an empty frame".into(),
        }),
    }
}

type Reply<T> = mpsc::Sender<Result<T, NcclError>>;

/// What the communicator thread does; each command answers on its reply channel.
enum Command {
    Send {
        buf: CudaSlice<f32>,
        peer: usize,
        done: Reply<CudaSlice<f32>>,
    },
    Recv {
        buf: CudaSlice<f32>,
        peer: usize,
        done: Reply<CudaSlice<f32>>,
    },
    AllReduce {
        buf: CudaSlice<f32>,
        done: Reply<CudaSlice<f32>>,
    },
    AllReduceHost {
        values: Vec<f32>,
        done: Reply<Vec<f32>>,
    },
}

/// One rank's NCCL communicator, owned by a thread of its own (see the module docs).
pub struct NcclComm {
    rank: usize,
    world: usize,
    stream: Arc<CudaStream>,
    commands: Option<mpsc::Sender<Command>>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `world` on GPU `ordinal`. Blocks until every
    /// rank has joined (NCCL's `ncclCommInitRank`).
    pub fn new(ordinal: usize, rank: usize, world: usize, id: NcclId) -> Result<Self, NcclError> {
        probe()?;
        Device::Cuda { ordinal }.check_available()?;
        let (commands, inbox) = mpsc::channel();
        let (ready, started) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name(format!("nccl-rank-{rank}"))
            .spawn(move || {
                let init = || -> Result<(Comm, Arc<CudaStream>), NcclError> {
                    let ctx = call(rank, "creating a context", || CudaContext::new(ordinal))?;
                    let stream = call(rank, "creating a stream", || ctx.new_stream())?;
                    let comm = call(rank, "ncclCommInitRank", || {
                        Comm::from_rank(stream.clone(), rank, world, id.to_cudarc())
                    })?;
                    Ok((comm, stream))
                };
                match init() {
                    Ok((comm, stream)) => {
                        if ready.send(Ok(stream)).is_ok() {
                            serve(&comm, rank, &inbox);
                        }
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e));
                    }
                }
            })
            .map_err(|e| NcclError::Call {
                rank,
                op: "spawning the communicator thread",
                message: e.to_string(),
            })?;
        let stream = started.recv().map_err(|_| NcclError::Stopped { rank })??;
        Ok(NcclComm {
            rank,
            world,
            stream,
            commands: Some(commands),
            worker: Some(worker),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// The communicator's stream, to allocate and copy the buffers it moves.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn check_peer(&self, peer: usize) -> Result<(), NcclError> {
        if peer >= self.world || peer == self.rank {
            return Err(NcclError::BadPeer {
                rank: self.rank,
                peer,
                world: self.world,
            });
        }
        Ok(())
    }

    /// Sends `command` (built around its reply channel) and waits for the answer.
    fn run<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T, NcclError> {
        let stopped = || NcclError::Stopped { rank: self.rank };
        let (done, answer) = mpsc::channel();
        self.commands
            .as_ref()
            .ok_or_else(stopped)?
            .send(command(done))
            .map_err(|_| stopped())?;
        answer.recv().map_err(|_| stopped())?
    }

    /// Sends `buf` to rank `peer` (which must post a [`recv`](Self::recv) of the same
    /// length) and gives the buffer back once it has left.
    pub fn send(&self, buf: CudaSlice<f32>, peer: usize) -> Result<CudaSlice<f32>, NcclError> {
        self.check_peer(peer)?;
        self.run(|done| Command::Send { buf, peer, done })
    }

    /// Receives from rank `peer` into `buf`, whose length must match the send.
    pub fn recv(&self, buf: CudaSlice<f32>, peer: usize) -> Result<CudaSlice<f32>, NcclError> {
        self.check_peer(peer)?;
        self.run(|done| Command::Recv { buf, peer, done })
    }

    /// Sums `buf` over every rank, in place.
    pub fn all_reduce_sum(&self, buf: CudaSlice<f32>) -> Result<CudaSlice<f32>, NcclError> {
        self.run(|done| Command::AllReduce { buf, done })
    }

    /// Sums host values over every rank, through the GPU (for gradients kept on the host).
    pub fn all_reduce_sum_host(&self, values: &mut [f32]) -> Result<(), NcclError> {
        let summed = self.run(|done| Command::AllReduceHost {
            values: values.to_vec(),
            done,
        })?;
        values.copy_from_slice(&summed);
        Ok(())
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Closing the command channel ends the thread's loop; it drops the `Comm` there.
        self.commands = None;
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// The communicator thread's loop: one command at a time until the handle is dropped.
fn serve(comm: &Comm, rank: usize, inbox: &mpsc::Receiver<Command>) {
    let stream = comm.stream();
    let sync = |op| call(rank, op, || stream.synchronize());
    let peer_i32 = |peer: usize| peer as i32;
    for command in inbox.iter() {
        match command {
            Command::Send { buf, peer, done } => {
                let r = call(rank, "ncclSend", || comm.send(&buf, peer_i32(peer)))
                    .and_then(|()| sync("ncclSend"))
                    .map(|()| buf);
                let _ = done.send(r);
            }
            Command::Recv {
                mut buf,
                peer,
                done,
            } => {
                let r = call(rank, "ncclRecv", || comm.recv(&mut buf, peer_i32(peer)))
                    .and_then(|_| sync("ncclRecv"))
                    .map(|()| buf);
                let _ = done.send(r);
            }
            Command::AllReduce { mut buf, done } => {
                let r = call(rank, "ncclAllReduce", || {
                    comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum)
                })
                .and_then(|_| sync("ncclAllReduce"))
                .map(|()| buf);
                let _ = done.send(r);
            }
            Command::AllReduceHost { values, done } => {
                let r = (|| {
                    let mut buf = call(rank, "copying to the GPU", || stream.clone_htod(&values))?;
                    call(rank, "ncclAllReduce", || {
                        comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum)
                    })?;
                    call(rank, "copying to the host", || stream.clone_dtoh(&buf))
                })();
                let _ = done.send(r);
            }
        }
    }
}

/// [`GradSync`] over NCCL: each pipeline rank run here holds the communicator of its
/// data-parallel group (the `dp` replicas of that stage, global rank `replica × pp + rank`).
pub struct NcclGradSync {
    comms: BTreeMap<usize, NcclComm>,
}

impl std::fmt::Debug for NcclGradSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGradSync")
            .field("pipeline_ranks", &self.comms.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl NcclGradSync {
    /// The data-parallel group of the stage of global rank `global` (its first member leads).
    pub fn replica_group(global: usize, dp: usize, pp: usize) -> Vec<usize> {
        let stage = global % pp.max(1);
        (0..dp).map(|replica| replica * pp + stage).collect()
    }

    /// This process's rank (`link.rank()`, global) joins its stage's group on GPU
    /// `ordinal`, getting the id from the group's leader on [`NCCL_ID_CHANNEL`].
    pub fn connect(
        link: &dyn PeerLink,
        dp: usize,
        pp: usize,
        ordinal: usize,
    ) -> Result<Self, NcclError> {
        let global = link.rank();
        let group = Self::replica_group(global, dp, pp);
        let id = share_id(link, &group, NCCL_ID_CHANNEL, NcclId::create)?;
        let comm = NcclComm::new(ordinal, global / pp.max(1), dp, id)?;
        Ok(Self::from_comms([(global % pp.max(1), comm)]))
    }

    /// From communicators by pipeline rank (a whole pipeline in one process holds all).
    pub fn from_comms(comms: impl IntoIterator<Item = (usize, NcclComm)>) -> Self {
        NcclGradSync {
            comms: comms.into_iter().collect(),
        }
    }
}

impl GradSync for NcclGradSync {
    fn all_reduce(&self, rank: usize, grads: &mut [f32]) -> Result<(), CollectiveError> {
        let comm = self
            .comms
            .get(&rank)
            .ok_or_else(|| CollectiveError::NotMember {
                rank,
                group: self.comms.keys().copied().collect(),
            })?;
        // `CollectiveError` has no device variant: an NCCL failure is reported as the
        // failure of this rank's link, keeping the NCCL error as the source.
        comm.all_reduce_sum_host(grads).map_err(|e| {
            CollectiveError::Link(LinkError::Io {
                peer: rank,
                source: std::io::Error::other(e),
            })
        })
    }
}

#[cfg(test)]
#[path = "nccl_tests.rs"]
mod tests;
