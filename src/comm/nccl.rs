//! NCCL between GPUs (feature `cuda`): the unique-id exchange, a communicator on its own
//! thread, point-to-point send/recv for stage links and the sum all-reduce behind
//! [`NcclGradSync`], the data-parallel [`GradSync`](super::collective::GradSync) on GPUs
//! (in `nccl_sync`, with the sharded optimizer's reduce-scatter, all-gather and gathers of
//! frames, each a job on the communicator's thread: `NcclComm::with`).
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
//! The unique ids that let ranks meet are made and shared in `nccl_id` (re-exported here).
//!
//! Besides the blocking calls ([`NcclComm::send`], [`NcclComm::recv`], the all-reduces,
//! `NcclComm::with`), a communicator takes *posted* point-to-point operations
//! ([`NcclComm::post_send`], [`NcclComm::post_recv`]) whose completion runs on its thread:
//! the stage-link transport (`nccl_transport`) posts without waiting, as the runtime's
//! `Transport::send` must not block on the receiver.

use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, ReduceOp};

use crate::comm::CommError;
use crate::tensor::TensorError;

#[path = "nccl_call.rs"]
mod nccl_call;
pub(super) use nccl_call::call;

pub use super::nccl_id::{
    NCCL_HEADER_CHANNEL, NCCL_ID_BYTES, NCCL_ID_CHANNEL, NCCL_LINK_ID_CHANNEL, NcclId,
    id_from_frame, share_id,
};
pub use super::nccl_sync::NcclGradSync;
use crate::tensor::DType;
pub use crate::tensor::cuda::CudaData;
use crate::tensor::device::Device;

/// The error for the presence of the driver and libnccl, in the order they are needed.
fn check_libraries(driver: bool, nccl: bool) -> Result<(), CommError> {
    if !driver {
        return Err(TensorError::NoCudaDriver.into());
    }
    if !nccl {
        return Err(TensorError::MissingCudaLibrary {
            library: "NCCL (libnccl)",
        }
        .into());
    }
    Ok(())
}

/// Checks that the CUDA driver and libnccl can be loaded: the only safe first step, since
/// any other cudarc call panics when its library is missing.
pub fn probe() -> Result<(), CommError> {
    // SAFETY: these only try to dlopen the library names cudarc would use and close them.
    let (driver, nccl) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nccl::sys::is_culib_present(),
        )
    };
    check_libraries(driver, nccl)
}

type Reply<T> = mpsc::Sender<Result<T, CommError>>;

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
    PostSend {
        data: CudaData,
        peer: usize,
        done: Posted,
    },
    PostRecv {
        dtype: DType,
        len: usize,
        peer: usize,
        done: Posted,
    },
    /// A job on the communicator ([`NcclComm::with`]); it answers on its own channel.
    With(Job),
}

/// A job run on the communicator's thread with its `Comm`.
type Job = Box<dyn FnOnce(&Comm) + Send>;

/// The completion of a posted operation, run on the communicator's thread: the buffer
/// that left (a send) or arrived (a receive), or the failure.
pub type Posted = Box<dyn FnOnce(Result<CudaData, CommError>) + Send>;

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
    pub fn new(ordinal: usize, rank: usize, world: usize, id: NcclId) -> Result<Self, CommError> {
        probe()?;
        Device::Cuda { ordinal }.check_available()?;
        let (commands, inbox) = mpsc::channel();
        let (ready, started) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name(format!("nccl-rank-{rank}"))
            .spawn(move || {
                let init = || -> Result<(Comm, Arc<CudaStream>), CommError> {
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
            .map_err(|e| CommError::Call {
                rank,
                op: "spawning the communicator thread",
                message: e.to_string(),
            })?;
        let stream = started.recv().map_err(|_| CommError::Stopped { rank })??;
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

    fn check_peer(&self, peer: usize) -> Result<(), CommError> {
        if peer >= self.world || peer == self.rank {
            return Err(CommError::BadPeer {
                rank: self.rank,
                peer,
                world: self.world,
            });
        }
        Ok(())
    }

    /// Sends `command` (built around its reply channel) and waits for the answer.
    fn run<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T, CommError> {
        let stopped = || CommError::Stopped { rank: self.rank };
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
    pub fn send(&self, buf: CudaSlice<f32>, peer: usize) -> Result<CudaSlice<f32>, CommError> {
        self.check_peer(peer)?;
        self.run(|done| Command::Send { buf, peer, done })
    }

    /// Receives from rank `peer` into `buf`, whose length must match the send.
    pub fn recv(&self, buf: CudaSlice<f32>, peer: usize) -> Result<CudaSlice<f32>, CommError> {
        self.check_peer(peer)?;
        self.run(|done| Command::Recv { buf, peer, done })
    }

    /// Queues sending `data` to rank `peer` (which must post a receive of the same type
    /// and length) and returns at once; `done` gets the buffer back once it has left.
    /// Operations run in the order they are posted.
    pub fn post_send(&self, data: CudaData, peer: usize, done: Posted) -> Result<(), CommError> {
        self.check_peer(peer)?;
        self.post(Command::PostSend { data, peer, done })
    }

    /// Queues receiving `len` elements of `dtype` from rank `peer` into a new buffer and
    /// returns at once; `done` gets the buffer once it has arrived.
    pub fn post_recv(
        &self,
        dtype: DType,
        len: usize,
        peer: usize,
        done: Posted,
    ) -> Result<(), CommError> {
        self.check_peer(peer)?;
        self.post(Command::PostRecv {
            dtype,
            len,
            peer,
            done,
        })
    }

    fn post(&self, command: Command) -> Result<(), CommError> {
        let stopped = || CommError::Stopped { rank: self.rank };
        self.commands
            .as_ref()
            .ok_or_else(stopped)?
            .send(command)
            .map_err(|_| stopped())
    }

    /// Sums `buf` over every rank, in place.
    pub fn all_reduce_sum(&self, buf: CudaSlice<f32>) -> Result<CudaSlice<f32>, CommError> {
        self.run(|done| Command::AllReduce { buf, done })
    }

    /// Sums host values over every rank, through the GPU (for gradients kept on the host).
    pub fn all_reduce_sum_host(&self, values: &mut [f32]) -> Result<(), CommError> {
        let (rank, host) = (self.rank, values.to_vec());
        let summed = self.with(move |comm| {
            let stream = comm.stream();
            let mut buf = call(rank, "copying to the GPU", || stream.clone_htod(&host))?;
            call(rank, "ncclAllReduce", || {
                comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum)
            })?;
            call(rank, "copying to the host", || stream.clone_dtoh(&buf))
        })?;
        values.copy_from_slice(&summed);
        Ok(())
    }

    /// Runs `job` on the communicator's thread with its `Comm` and waits for its answer:
    /// the host collectives (the all-reduce above, those of [`NcclGradSync`]) are jobs, so
    /// this thread's command set stays small. The job must leave the stream synchronized
    /// (a host copy back does) and run its cudarc calls under [`call`].
    pub(super) fn with<T: Send + 'static>(
        &self,
        job: impl FnOnce(&Comm) -> Result<T, CommError> + Send + 'static,
    ) -> Result<T, CommError> {
        self.run(|done| {
            Command::With(Box::new(move |comm| {
                let _ = done.send(job(comm));
            }))
        })
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
            Command::PostSend { data, peer, done } => {
                let r = send_data(comm, rank, &data, peer)
                    .and_then(|()| sync("ncclSend"))
                    .map(|()| data);
                done(r);
            }
            Command::PostRecv {
                dtype,
                len,
                peer,
                done,
            } => {
                let r = recv_data(comm, rank, dtype, len, peer)
                    .and_then(|data| sync("ncclRecv").map(|()| data));
                done(r);
            }
            Command::With(job) => job(comm),
        }
    }
}

/// Queues sending `data` as bytes (NCCL p2p moves bytes; a bf16 buffer has no NCCL type
/// here). Nothing is sent for an empty buffer: the receiver skips it too.
fn send_data(comm: &Comm, rank: usize, data: &CudaData, peer: usize) -> Result<(), CommError> {
    fn bytes<T>(comm: &Comm, rank: usize, s: &CudaSlice<T>, peer: usize) -> Result<(), CommError> {
        if s.is_empty() {
            return Ok(());
        }
        // SAFETY: the view covers exactly the slice's bytes, and any bits are valid `u8`s.
        let view = unsafe { s.transmute::<u8>(s.len() * std::mem::size_of::<T>()) };
        let view = view.ok_or_else(|| CommError::Call {
            rank,
            op: "ncclSend",
            message: "the byte view does not fit the buffer".into(),
        })?;
        call(rank, "ncclSend", || comm.send(&view, peer as i32))
    }
    match data {
        CudaData::F32(s) => bytes(comm, rank, s, peer),
        CudaData::Bf16(s) => bytes(comm, rank, s, peer),
    }
}

/// Queues receiving `len` elements of `dtype` as bytes into a new buffer on the
/// communicator's stream.
fn recv_data(
    comm: &Comm,
    rank: usize,
    dtype: DType,
    len: usize,
    peer: usize,
) -> Result<CudaData, CommError> {
    fn bytes<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        comm: &Comm,
        rank: usize,
        len: usize,
        peer: usize,
    ) -> Result<CudaSlice<T>, CommError> {
        let stream = comm.stream();
        if len == 0 {
            return call(rank, "allocating a receive buffer", || stream.null::<T>());
        }
        let mut buf = call(rank, "allocating a receive buffer", || {
            stream.alloc_zeros::<T>(len)
        })?;
        // SAFETY: the view covers exactly the buffer's bytes; any bytes are valid `T`s
        // here (`f32` and `u16` have no invalid bit patterns).
        let view = unsafe { buf.transmute_mut::<u8>(len * std::mem::size_of::<T>()) };
        let mut view = view.ok_or_else(|| CommError::Call {
            rank,
            op: "ncclRecv",
            message: "the byte view does not fit the buffer".into(),
        })?;
        call(rank, "ncclRecv", || comm.recv(&mut view, peer as i32))?;
        Ok(buf)
    }
    Ok(match dtype {
        DType::F32 => CudaData::F32(bytes(comm, rank, len, peer)?),
        DType::Bf16 => CudaData::Bf16(bytes(comm, rank, len, peer)?),
    })
}

/// Whether this machine can run a GPU test of `ranks` NCCL ranks; prints why not. Ranks
/// beyond the GPU count share GPUs (`rank % count`), which NCCL may refuse: tests then
/// skip on its "invalid usage" error ([`skip_duplicate_gpu`]).
#[cfg(test)]
pub(crate) fn gpu_test_ready(test: &str) -> Option<usize> {
    // SAFETY: only a dlopen attempt.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        eprintln!(
            "{test}: skipped: no CUDA driver (cudarc::driver::sys::is_culib_present() is false)"
        );
        return None;
    }
    if let Err(e) = probe() {
        eprintln!("{test}: skipped: {e}");
        return None;
    }
    match crate::tensor::device::cuda_device_count() {
        Ok(0) => {
            eprintln!("{test}: skipped: the CUDA driver sees no GPU");
            None
        }
        Ok(count) => Some(count),
        Err(e) => {
            eprintln!("{test}: skipped: {e}");
            None
        }
    }
}

/// True (after printing why) when `err` is NCCL refusing ranks that share one GPU.
#[cfg(test)]
pub(crate) fn skip_duplicate_gpu(test: &str, err: &dyn std::fmt::Display) -> bool {
    let text = err.to_string();
    let refused = text.contains("InvalidUsage");
    if refused {
        eprintln!("{test}: skipped: NCCL refuses two ranks on one GPU here: {text}");
    }
    refused
}

#[cfg(test)]
#[path = "nccl_tests.rs"]
mod tests;
