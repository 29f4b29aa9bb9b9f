//! Communication between the processes of one job (DESIGN.md, "multi-process").
//!
//! Everything that crosses a process boundary lives here, so the training code above sees only
//! the runtime's `Transport` trait and the peer-link seam:
//! - `frame`: length-prefixed bincode-2 frames with a size cap (the only wire format).
//! - `rendezvous`: rank 0 gathers every rank's listen address and hands out the table.
//! - `handshake`: the job-token exchange that opens every mesh connection.
//! - `tcp`: the authenticated TCP mesh between ranks, with per-channel inboxes; it
//!   implements the `link::PeerLink` seam.
//! - `tcp_transport`: the runtime's `Transport<T>` over the mesh, with the codecs of
//!   backend buffers and serde types.
//! - `heartbeat`: dead-peer detection that closes the mesh naming the rank.
//! - `link`: the `PeerLink` seam (byte frames to a rank on a numbered channel) and its
//!   in-process implementation for tests.
//! - `collective`: the ring all-reduce over a `PeerLink` group and `GradSync`, which sums a
//!   pipeline rank's gradients across data-parallel replicas.
//! - `nccl` (feature `cuda`): NCCL between GPUs: the unique-id exchange, p2p send/recv and
//!   the all-reduce, on a communicator's own thread.
//! - `nccl_sync` (feature `cuda`): `NcclGradSync`, the replicas' `GradSync` over NCCL, with
//!   the sharded optimizer's reduce-scatter, all-gather and gathers of frames.
//! - `padded`: the host-side layouts of those NCCL collectives (chunks in equal padded
//!   slots, frames back to back), compiled and tested without the `cuda` feature.
//! - `nccl_id` (feature `cuda`): NCCL unique ids, shared as rendezvous messages on the mesh.
//! - `nccl_transport` (feature `cuda`): the runtime's `Transport<CudaBuf>` over NCCL p2p,
//!   with headers on the mesh.
//! - `error`: `CommError`, the one error of this layer.
//! - `select`: which transport a run uses (`transport = "auto" | "tcp" | "nccl"`).

pub mod collective;
pub mod error;
pub mod link;

pub mod frame;
pub mod handshake;
pub mod heartbeat;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod nccl_id;
#[cfg(feature = "cuda")]
mod nccl_sync;
#[cfg(feature = "cuda")]
pub mod nccl_transport;
pub mod padded;
pub mod rendezvous;
pub mod select;
pub mod tcp;
pub mod tcp_transport;

#[cfg(test)]
mod test_log;

pub use error::CommError;
