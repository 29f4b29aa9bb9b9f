//! `CommError`: everything that can go wrong between the processes of a job, in one enum.
//!
//! Framing, peer links, collectives, the rendezvous, the TCP mesh and its transport groups,
//! NCCL, and the choice of a transport all fail into it, so the layers above (the pipeline's
//! mesh, the launcher, the RL ranks) wrap one `comm` error. Each variant carries the rank,
//! peer, channel or address it happened at.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use crate::comm::link::Channel;
use crate::comm::rendezvous::missing_text;
use crate::tensor::DType;
use crate::tensor::TensorError;
use crate::tensor::device::Device;

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    // ---- collectives over a group of ranks (`collective`)
    #[error("rank {rank} is not a member of the group {group:?}")]
    NotMember { rank: usize, group: Vec<usize> },
    #[error("rank {rank} appears twice in the group {group:?}")]
    Duplicate { rank: usize, group: Vec<usize> },
    #[error(
        "rank {peer} sent {got} bytes on channel {channel}, expected {expected} (a chunk of {values} f32 values): the members disagree on the buffer's length"
    )]
    Length {
        peer: usize,
        channel: Channel,
        expected: usize,
        got: usize,
        values: usize,
    },
    #[error(
        "{what} is not implemented by this gradient exchange ({sync}), which the sharded optimizer (optimizer.shard) needs"
    )]
    Unsupported { what: &'static str, sync: String },

    // ---- frames on the wire (`frame`)
    #[error("frame of {len} bytes is over the cap of {cap} bytes")]
    TooLarge { len: usize, cap: usize },
    #[error("undecodable frame: {0}")]
    Decode(String),
    #[error("cannot encode frame: {0}")]
    Encode(String),
    /// A tensor frame's bytes are not the buffer its header declares (`tcp_transport`).
    #[error(
        "the frame declares a {} buffer of {len} values ({} bytes each) but carries {got} bytes",
        .dtype.name(),
        .dtype.size()
    )]
    BufPayload { dtype: DType, len: u64, got: usize },
    #[error("the peer closed the connection")]
    Eof,
    #[error("i/o: {0}")]
    Io(#[from] io::Error),

    // ---- peer links (`link`)
    #[error("rank {rank} is not in this link's world of {world} ranks")]
    NoSuchRank { rank: usize, world: usize },
    #[error("rank {rank} tried to send a frame to itself on channel {channel}")]
    ToSelf { rank: usize, channel: Channel },
    #[error("the link to rank {peer} is closed (channel {channel})")]
    Closed { peer: usize, channel: Channel },
    #[error("the link to rank {peer} failed: {source}")]
    LinkIo {
        peer: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("rank {peer} broke the link protocol: {reason}")]
    Protocol { peer: usize, reason: String },

    // ---- NCCL (`nccl`, feature `cuda`)
    /// The driver or libnccl is missing, or the GPU does not exist.
    #[error(transparent)]
    Device(#[from] TensorError),
    /// An NCCL id frame of the wrong size or kind.
    #[error("NCCL id from rank {from}: {reason}")]
    BadId { from: usize, reason: String },
    /// The group's first member could not create the id.
    #[error("rank {leader} could not create the NCCL id: {reason}")]
    LeaderFailed { leader: usize, reason: String },
    /// This rank is not in the group it asked to join.
    #[error("rank {rank} is not a member of the NCCL group {group:?}")]
    NotNcclMember { rank: usize, group: Vec<usize> },
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

    // ---- the rendezvous (`rendezvous`)
    #[error("rendezvous: {what}")]
    RendezvousIo {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rendezvous: {}", missing_text(.missing, .timeout))]
    RendezvousTimeout {
        missing: Vec<usize>,
        timeout: Duration,
    },
    #[error("rendezvous: rank 0 at {master} did not answer within {timeout:?}")]
    NoMaster {
        master: SocketAddr,
        timeout: Duration,
    },
    #[error("rendezvous: rank 0 refused rank {rank}: {reason}")]
    Refused { rank: usize, reason: String },
    /// Rank 0 gave up after this rank had joined, and said why.
    #[error("rendezvous: rank 0 gave up the rendezvous: {reason}")]
    Abandoned { reason: String },
    /// Rank 0 closed this rank's connection unanswered, every time, while it went on
    /// serving: it does that only to a connection that did not show its job token.
    #[error(
        "rendezvous: rank 0 closed the connection without an answer {attempts} times while still serving the rendezvous at {master}: it does that to a registration whose job token is not its own (PIPEFILL_TOKEN must be the same on every rank)"
    )]
    WrongToken { master: SocketAddr, attempts: usize },
    /// Rank 0 closed the connection and nothing serves the rendezvous any more (`after`
    /// names the address; it is no field of its own, so that the error stays small).
    #[error("rendezvous: rank 0 closed the connection before answering, and {after}")]
    MasterGone { after: String },
    #[error("rendezvous: {0}")]
    RendezvousProtocol(String),

    // ---- choosing the transport (`select`)
    /// NCCL asked for, but the ranks do not compute on a GPU.
    #[error(
        "transport = \"nccl\" needs the ranks to compute on a CUDA GPU, but this run computes on {device}; use transport = \"tcp\" or \"auto\""
    )]
    NcclNeedsCudaDevice { device: Device },
    /// NCCL asked for on a GPU, but CUDA or NCCL cannot be used here.
    #[error("transport = \"nccl\" cannot be used on {device}: {reason}")]
    NcclUnavailable { device: Device, reason: TensorError },
    /// Another rank cannot set up its device or transport (rank `rank`'s own reason).
    #[error("rank {rank} cannot set up its device or transport: {reason}")]
    OtherRank { rank: usize, reason: String },
    /// The ranks could not settle the transport (the mesh failed or a message was bad).
    #[error("agreeing on the transport: {reason}")]
    Agreement { reason: String },

    // ---- the TCP mesh (`tcp`)
    #[error("rank {rank}: {what}")]
    MeshIo {
        rank: usize,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rank {rank}: ranks {missing:?} did not connect within {timeout:?}")]
    MeshTimeout {
        rank: usize,
        missing: Vec<usize>,
        timeout: Duration,
    },
    #[error("rank {rank}: rank {peer} refused the connection or broke the handshake: {reason}")]
    Handshake {
        rank: usize,
        peer: usize,
        reason: String,
    },
    #[error("rank {rank}: {peers} peer addresses for a world of {world}")]
    Table {
        rank: usize,
        peers: usize,
        world: usize,
    },

    // ---- transport groups on the mesh (`tcp_transport`)
    #[error("transport group at mesh rank {base}: the group is empty")]
    EmptyGroup { base: usize },
    #[error(
        "transport group of mesh ranks {base}..{end}: it runs past the mesh's {world} ranks",
        end = .base.saturating_add(*.size)
    )]
    PastMesh {
        base: usize,
        size: usize,
        world: usize,
    },
    #[error(
        "transport group of mesh ranks {base}..{end}: this process is mesh rank {rank}, not one of them",
        end = .base + .size
    )]
    NotInGroup {
        rank: usize,
        base: usize,
        size: usize,
    },
}
