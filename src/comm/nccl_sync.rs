//! [`NcclGradSync`] (feature `cuda`): the data-parallel [`GradSync`] over NCCL, with the
//! sharded optimizer's collectives (ZeRO-1, `crate::pipeline::compute::zero`).
//!
//! Gradients live on the host; each collective copies them to the communicator's GPU, runs
//! NCCL's own collective there (a job on the communicator's thread, `NcclComm::with`) and
//! copies the result back.
//!
//! The chunks are the trait's cut ([`chunk_cut`]: sizes differ by at most one, the longer
//! first) and NCCL rank `r` (the replica, `global / pp`) owns chunk `r`, so a sharded
//! checkpoint is the same whatever the exchange. NCCL's reduce-scatter and all-gather need
//! equal counts per rank, so each chunk travels in a zero-padded slot of `ceil(len / n)`
//! values (the layouts in `padded`, tested without a GPU).
//!
//! The gathers of byte frames all-gather the frames' lengths first: every member then
//! checks every length against [`FRAME_CAP`] before allocating, so the members fail
//! together on a bad one instead of some waiting forever on the others.

use std::collections::BTreeMap;
use std::ops::Range;

use cudarc::driver::{CudaSlice, CudaViewMut, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{NcclType, ReduceOp};

use super::collective::{GradSync, replica_group};
use super::link::PeerLink;
use super::nccl::{NCCL_ID_CHANNEL, NcclComm, NcclId, call, share_id};
use super::padded::{self, PadError};
use crate::comm::CommError;

/// The largest frame [`NcclGradSync::gather_by_chunk`] and
/// [`NcclGradSync::gather_to_first`] take from a replica: the cap of a frame on the TCP
/// mesh, so a frame one exchange refuses the other refuses too.
pub const FRAME_CAP: usize = super::frame::DEFAULT_FRAME_CAP;

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
    /// This process's rank (`link.rank()`, global) joins its stage's group on GPU
    /// `ordinal`, getting the id from the group's leader on [`NCCL_ID_CHANNEL`]. Its NCCL
    /// rank is its replica, `global / pp`: the chunk it owns.
    pub fn connect(
        link: &dyn PeerLink,
        dp: usize,
        pp: usize,
        ordinal: usize,
    ) -> Result<Self, CommError> {
        let global = link.rank();
        let group = replica_group(global, dp, pp);
        let id = share_id(link, &group, NCCL_ID_CHANNEL, NcclId::create)?;
        let comm = NcclComm::new(ordinal, global / pp.max(1), dp, id)?;
        Ok(Self::from_comms([(global % pp.max(1), comm)]))
    }

    /// From communicators by pipeline rank (a whole pipeline in one process holds all);
    /// each communicator's rank is its replica.
    pub fn from_comms(comms: impl IntoIterator<Item = (usize, NcclComm)>) -> Self {
        NcclGradSync {
            comms: comms.into_iter().collect(),
        }
    }

    /// Pipeline rank `rank`'s communicator.
    fn comm(&self, rank: usize) -> Result<&NcclComm, CommError> {
        self.comms.get(&rank).ok_or_else(|| CommError::NotMember {
            rank,
            group: self.comms.keys().copied().collect(),
        })
    }
}

/// A layout that does not fit its buffer, as the error of NCCL rank `rank`'s `op`.
fn pad_err(rank: usize, op: &'static str) -> impl Fn(PadError) -> CommError {
    move |e| CommError::Call {
        rank,
        op,
        message: e.to_string(),
    }
}

/// Every rank's `mine`, rank by rank (NCCL's all-gather; every rank's `mine` must have
/// the same length).
fn all_gather_host<T>(comm: &NcclComm, mine: Vec<T>) -> Result<Vec<T>, CommError>
where
    T: NcclType + DeviceRepr + ValidAsZeroBits + Send + 'static,
{
    let (rank, world) = (comm.rank(), comm.world());
    if mine.is_empty() {
        return Ok(Vec::new());
    }
    comm.with(move |c| {
        let stream = c.stream();
        let send = call(rank, "copying to the GPU", || stream.clone_htod(&mine))?;
        let mut recv = call(rank, "allocating the all-gather's buffer", || {
            stream.alloc_zeros::<T>(mine.len() * world)
        })?;
        call(rank, "ncclAllGather", || c.all_gather(&send, &mut recv))?;
        call(rank, "copying to the host", || stream.clone_dtoh(&recv))
    })
}

/// Every rank's `len`, rank by rank.
fn all_gather_len(comm: &NcclComm, len: usize) -> Result<Vec<u64>, CommError> {
    let lens = all_gather_host(comm, vec![len as u64])?;
    if lens.len() != comm.world() || lens.get(comm.rank()) != Some(&(len as u64)) {
        return Err(CommError::Call {
            rank: comm.rank(),
            op: "the all-gather of lengths",
            message: format!("this rank's {len} came back as {lens:?}"),
        });
    }
    Ok(lens)
}

/// Checks that every rank's buffer has this one's `len` values, before a collective whose
/// counts it sets: NCCL would read or write past a shorter one. Every rank gets the same
/// lengths, so all fail together.
fn agree(comm: &NcclComm, len: usize, op: &'static str) -> Result<(), CommError> {
    let lens = all_gather_len(comm, len)?;
    match lens.iter().position(|&l| l != len as u64) {
        None => Ok(()),
        Some(other) => Err(CommError::Call {
            rank: comm.rank(),
            op,
            message: format!(
                "the replicas disagree on the buffer's length: {lens:?} values by NCCL rank \
                 (rank {other} has {})",
                lens[other]
            ),
        }),
    }
}

/// The frames' lengths, every rank's, checked against [`FRAME_CAP`] (on every rank alike),
/// with this rank's own.
fn frame_lengths(comm: &NcclComm, len: usize, op: &'static str) -> Result<Vec<usize>, CommError> {
    let lens = all_gather_len(comm, len)?;
    padded::frame_lengths(&lens, FRAME_CAP).map_err(pad_err(comm.rank(), op))
}

/// Bytes `r` of `all` (frame ranges from the lengths that sized `all`).
fn part(
    all: &mut CudaSlice<u8>,
    r: Range<usize>,
    rank: usize,
) -> Result<CudaViewMut<'_, u8>, CommError> {
    let len = all.len();
    all.try_slice_mut(r.clone()).ok_or_else(|| CommError::Call {
        rank,
        op: "the gather of frames",
        message: format!("frame bytes {r:?} lie outside the buffer of {len}"),
    })
}

impl GradSync for NcclGradSync {
    fn all_reduce(&self, rank: usize, grads: &mut [f32]) -> Result<(), CommError> {
        self.comm(rank)?.all_reduce_sum_host(grads)
    }

    /// NCCL's reduce-scatter of the padded slots: this replica's chunk (chunk `r` of NCCL
    /// rank `r`) ends summed; the rest of `grads` keeps this replica's own values. At
    /// `dp = 2` each sum is one addition, `a + b`, so the chunk is bitwise what the
    /// all-reduce leaves there; at `dp > 2` NCCL may add in another order in its
    /// reduce-scatter than in its all-reduce (its algorithm depends on the collective and
    /// the size), so a sharded run can differ from an unsharded NCCL run in the last bits.
    /// The replicas still agree: the all-gather hands out each owner's values.
    fn reduce_scatter(&self, rank: usize, grads: &mut [f32]) -> Result<Range<usize>, CommError> {
        let comm = self.comm(rank)?;
        let (me, n) = (comm.rank(), comm.world());
        let op = "the reduce-scatter";
        let own = padded::chunk(grads.len(), n, me).map_err(pad_err(me, op))?;
        if n == 1 {
            return Ok(own);
        }
        agree(comm, grads.len(), op)?;
        let slot = padded::slot(grads.len(), n);
        if slot == 0 {
            return Ok(own);
        }
        let packed = padded::pack(grads, n);
        let summed = comm.with(move |c| {
            let stream = c.stream();
            let send = call(me, "copying to the GPU", || stream.clone_htod(&packed))?;
            let mut recv = call(me, "allocating the reduce-scatter's buffer", || {
                stream.alloc_zeros::<f32>(slot)
            })?;
            call(me, "ncclReduceScatter", || {
                c.reduce_scatter(&send, &mut recv, &ReduceOp::Sum)
            })?;
            call(me, "copying to the host", || stream.clone_dtoh(&recv))
        })?;
        padded::unpack_chunk(&summed, n, me, grads).map_err(pad_err(me, op))
    }

    /// NCCL rank `r` owns chunk `r` of the trait's cut.
    fn owned(&self, rank: usize, len: usize) -> Result<Range<usize>, CommError> {
        let comm = self.comm(rank)?;
        padded::chunk(len, comm.world(), comm.rank()).map_err(pad_err(comm.rank(), "owned"))
    }

    /// NCCL's all-gather of each replica's chunk in its padded slot.
    fn all_gather(&self, rank: usize, buf: &mut [f32]) -> Result<(), CommError> {
        let comm = self.comm(rank)?;
        let (me, n) = (comm.rank(), comm.world());
        let op = "the all-gather";
        if n == 1 {
            return Ok(());
        }
        agree(comm, buf.len(), op)?;
        if buf.is_empty() {
            return Ok(());
        }
        let mine = padded::pack_chunk(buf, n, me).map_err(pad_err(me, op))?;
        let gathered = all_gather_host(comm, mine)?;
        padded::unpack(&gathered, n, buf).map_err(pad_err(me, op))
    }

    /// The lengths' all-gather, then one NCCL broadcast per non-empty frame, from its
    /// owner, of exactly its bytes into one buffer of them all. Not one all-gather of frames
    /// padded to the longest: a parameter within one chunk gives one frame of its whole
    /// piece and empty others, and padding would make every replica hold `dp` times it.
    fn gather_by_chunk(&self, rank: usize, frame: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let comm = self.comm(rank)?;
        let (me, n) = (comm.rank(), comm.world());
        let op = "the gather of frames";
        if n == 1 {
            return Ok(vec![frame.to_vec()]);
        }
        let lens = frame_lengths(comm, frame.len(), op)?;
        let ranges = padded::frame_ranges(&lens).map_err(pad_err(me, op))?;
        let total = ranges.last().map_or(0, |r| r.end);
        if total == 0 {
            return Ok(vec![Vec::new(); n]);
        }
        let (frame, at) = (frame.to_vec(), ranges[me].clone());
        let bytes = comm.with(move |c| {
            let stream = c.stream();
            let mut all = call(me, "allocating the frames' buffer", || {
                stream.alloc_zeros::<u8>(total)
            })?;
            if !frame.is_empty() {
                let mut own = part(&mut all, at, me)?;
                call(me, "copying to the GPU", || {
                    stream.memcpy_htod(&frame, &mut own)
                })?;
            }
            for (root, r) in ranges.into_iter().enumerate() {
                if !r.is_empty() {
                    let mut bytes = part(&mut all, r, me)?;
                    call(me, "ncclBroadcast", || {
                        c.broadcast_in_place(&mut bytes, root as i32)
                    })?;
                }
            }
            call(me, "copying to the host", || stream.clone_dtoh(&all))
        })?;
        padded::split_frames(&bytes, &lens).map_err(pad_err(me, op))
    }

    /// The lengths' all-gather (so that every replica checks every length and they fail
    /// together), then each other replica's frame by NCCL send/recv to the first, one at a
    /// time: the first holds every frame, the others only their own.
    fn gather_to_first(
        &self,
        rank: usize,
        frame: &[u8],
    ) -> Result<Option<Vec<Vec<u8>>>, CommError> {
        let comm = self.comm(rank)?;
        let (me, n) = (comm.rank(), comm.world());
        if n == 1 {
            return Ok(Some(vec![Vec::new()]));
        }
        let lens = frame_lengths(comm, frame.len(), "the gather to the first replica")?;
        if me != 0 {
            if !frame.is_empty() {
                let frame = frame.to_vec();
                comm.with(move |c| {
                    let stream = c.stream();
                    let buf = call(me, "copying to the GPU", || stream.clone_htod(&frame))?;
                    call(me, "ncclSend", || c.send(&buf, 0))?;
                    call(me, "ncclSend", || stream.synchronize())
                })?;
            }
            return Ok(None);
        }
        let frames = comm.with(move |c| {
            let stream = c.stream();
            // Its own is left empty: it has it.
            let mut frames = vec![Vec::new()];
            for (peer, &len) in lens.iter().enumerate().skip(1) {
                if len == 0 {
                    frames.push(Vec::new());
                    continue;
                }
                let mut buf = call(me, "allocating a receive buffer", || {
                    stream.alloc_zeros::<u8>(len)
                })?;
                call(me, "ncclRecv", || c.recv(&mut buf, peer as i32))?;
                frames.push(call(me, "copying to the host", || stream.clone_dtoh(&buf))?);
            }
            Ok(frames)
        })?;
        Ok(Some(frames))
    }
}
