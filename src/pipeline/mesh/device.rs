//! What a launched rank computes on and talks over ([`RankLinks`]): the backend of the job's
//! `device`, the transport of activations and gradients between the ranks of its pipeline,
//! and the gradient all-reduce between data-parallel replicas.
//!
//! - `device = "cpu"`: the CPU backend on one thread, TCP between the ranks and the ring
//!   all-reduce over the mesh ([`RingGradSync`]); `transport = "nccl"` is an error.
//! - `device = "cuda"` (feature `cuda`): the GPU whose ordinal is the rank's local rank,
//!   and the transport [`select`](crate::comm::select) picks. Every rank sends its own
//!   outcome (its transport, or why its GPU or NCCL cannot be used) to rank 0 before any
//!   NCCL communicator exists ([`settle`]), so a rank that cannot join never leaves the
//!   others waiting inside NCCL. With NCCL, tensors go GPU to GPU ([`NcclTransport`]) and
//!   replicas all-reduce with [`NcclGradSync`]; with TCP, as on the CPU.
//!
//! [`NcclTransport`]: crate::comm::nccl_transport::NcclTransport
//! [`NcclGradSync`]: crate::comm::nccl::NcclGradSync

use std::sync::Arc;

use pipefill_actors::Transport;

use crate::comm::CommError;
use crate::comm::collective::GradSync;
use crate::comm::select::select_transport;
use crate::comm::tcp::TcpMesh;
use crate::comm::tcp_transport::{BufCodec, TENSOR_CHANNEL, TcpTransport};
use crate::pipeline::error::PipelineError;
use crate::tensor::device::Device;
use crate::tensor::{Backend, CpuBackend, DType};

/// A rank's backend and its links to the other ranks.
pub(super) struct RankLinks<B: Backend> {
    /// Where the rank sits in the job (the links are built for it).
    pub(super) at: MeshRank,
    pub(super) backend: B,
    /// Activations and gradients among the ranks of this rank's pipeline replica.
    pub(super) tensors: Arc<dyn Transport<B::Buf>>,
    /// The all-reduce with the same rank of the other replicas (`dp` > 1).
    pub(super) sync: Option<Arc<dyn GradSync>>,
}

/// The place of a rank in the job: `dp` replicas of a `pp`-rank pipeline.
#[derive(Clone, Copy, Debug)]
pub(super) struct MeshRank {
    pub(super) rank: usize,
    pub(super) replica: usize,
    pub(super) pp: usize,
    pub(super) dp: usize,
}

impl MeshRank {
    fn transport_err(self, error: CommError) -> PipelineError {
        PipelineError::Transport {
            rank: self.rank,
            error,
        }
    }
}

/// The CPU rank's links: the CPU backend on `threads` threads storing in `precision` (the
/// job's `train.precision`), TCP, ring all-reduce (the transport the job asks for must be
/// TCP: `auto` is, `nccl` is an error naming the device).
pub(super) fn cpu_links(
    mesh: &Arc<TcpMesh>,
    requested: crate::comm::select::TransportKind,
    at: MeshRank,
    threads: usize,
    precision: DType,
) -> Result<RankLinks<CpuBackend>, PipelineError> {
    select_transport(requested, Device::Cpu { threads }).map_err(|e| at.transport_err(e))?;
    let backend = CpuBackend::new(threads).map_err(|error| PipelineError::Device {
        rank: at.rank,
        device: Device::Cpu { threads },
        error,
    })?;
    let backend = backend.with_storage(precision);
    tcp_links(mesh, backend, at)
}

/// Links over the TCP mesh for `backend`'s buffers (any device).
fn tcp_links<B: Backend>(
    mesh: &Arc<TcpMesh>,
    backend: B,
    at: MeshRank,
) -> Result<RankLinks<B>, PipelineError> {
    let tensors: Arc<dyn Transport<B::Buf>> = Arc::new(
        TcpTransport::group(
            mesh,
            TENSOR_CHANNEL,
            BufCodec(backend.clone()),
            at.replica * at.pp,
            at.pp,
        )
        .map_err(|e| at.transport_err(e))?,
    );
    let sync = crate::pipeline::executor::Links::mesh_ring(mesh, at.dp, at.pp);
    Ok(RankLinks {
        at,
        backend,
        tensors,
        sync,
    })
}

/// Without the `cuda` feature a CUDA rank is the clear "rebuild with --features cuda"
/// error (the CLI reports it before joining the mesh; this is the library's own check).
#[cfg(not(feature = "cuda"))]
pub(super) fn cuda_unavailable(at: MeshRank, ordinal: usize) -> PipelineError {
    PipelineError::Device {
        rank: at.rank,
        device: Device::Cuda { ordinal },
        error: crate::tensor::TensorError::CudaNotCompiled,
    }
}

#[cfg(feature = "cuda")]
pub(super) use cuda::cuda_links;

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use crate::comm::nccl::NcclGradSync;
    use crate::comm::nccl_transport::NcclTransport;
    use crate::comm::select::{Choice, settle};
    use crate::tensor::cuda::CudaBackend;

    /// The CUDA rank's links on GPU `ordinal` (its local rank) storing in `precision`, over
    /// the transport every rank agreed on (see the module docs).
    pub(in crate::pipeline::mesh) fn cuda_links(
        mesh: &Arc<TcpMesh>,
        requested: crate::comm::select::TransportKind,
        at: MeshRank,
        ordinal: usize,
        precision: DType,
    ) -> Result<RankLinks<CudaBackend>, PipelineError> {
        let device = Device::Cuda { ordinal };
        // The backend first: a GPU that cannot be used is this rank's failure to report.
        let backend = CudaBackend::new(ordinal).map(|b| b.with_storage(precision));
        let own = match &backend {
            Ok(_) => Choice::from(&select_transport(requested, device)),
            Err(e) => Choice::Failed(format!("device = \"cuda\" ({device}): {e}")),
        };
        let agreed = settle(mesh.as_ref(), own).map_err(|e| match mesh.failure() {
            Some(reason) => PipelineError::Peer {
                rank: at.rank,
                reason,
            },
            None => at.transport_err(e),
        })?;
        // Past the agreement no rank failed, this one included.
        let backend = backend.map_err(|error| PipelineError::Device {
            rank: at.rank,
            device,
            error,
        })?;
        if agreed == Choice::Tcp {
            return tcp_links(mesh, backend, at);
        }
        let tensors: Arc<dyn Transport<_>> = Arc::new(
            NcclTransport::group(mesh, ordinal, at.replica * at.pp, at.pp)
                .map_err(|e| at.transport_err(e))?,
        );
        let sync = if at.dp > 1 {
            let sync = NcclGradSync::connect(mesh.as_ref(), at.dp, at.pp, ordinal)
                .map_err(|e| at.transport_err(e))?;
            Some(Arc::new(sync) as Arc<dyn GradSync>)
        } else {
            None
        };
        Ok(RankLinks {
            at,
            backend,
            tensors,
            sync,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::comm::link::Channel;

    /// Every mesh channel a launched training rank may use, by name.
    fn channels() -> Vec<(&'static str, Channel)> {
        use crate::comm::tcp_transport as t;
        use crate::pipeline::mesh::profile as p;
        #[allow(unused_mut)]
        let mut all = vec![
            ("TENSOR", t::TENSOR_CHANNEL),
            ("STATS", t::STATS_CHANNEL),
            ("CONTROL", t::CONTROL_CHANNEL),
            ("CLOCK", p::CLOCK_CHANNEL),
            ("PROFILE", p::PROFILE_CHANNEL),
            ("METRICS", p::METRICS_CHANNEL),
            ("GRAD", crate::comm::collective::GRAD_CHANNEL),
            ("CHECKPOINT", super::super::CHECKPOINT_CHANNEL),
            ("TRANSPORT", crate::comm::select::TRANSPORT_CHANNEL),
            ("RL", crate::rl::launched::RL_CHANNEL),
        ];
        #[cfg(feature = "cuda")]
        all.extend([
            ("NCCL_ID", crate::comm::nccl_id::NCCL_ID_CHANNEL),
            ("NCCL_LINK_ID", crate::comm::nccl_id::NCCL_LINK_ID_CHANNEL),
            ("NCCL_HEADER", crate::comm::nccl_id::NCCL_HEADER_CHANNEL),
        ]);
        all
    }

    #[test]
    fn no_two_protocols_share_a_channel() {
        // Two protocols on one channel would read each other's frames (the run directory
        // taken for an NCCL id).
        let all = channels();
        for (i, (a, ca)) in all.iter().enumerate() {
            for (b, cb) in &all[i + 1..] {
                assert_ne!(ca, cb, "{a} and {b} share channel {ca}");
            }
        }
    }
}
