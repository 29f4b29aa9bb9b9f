//! [`NcclTransport`] (feature `cuda`): the runtime's `Transport<CudaBuf>` between the GPU
//! ranks of a multi-process job, so stage actors pass activations and gradients from GPU
//! to GPU without a copy through the host.
//!
//! NCCL point-to-point calls carry bytes, not tags, and each needs a matching call of the
//! same length on the other side, posted in the same order. The runtime, though, receives
//! by tag, in whatever order its schedule asks, and learns a buffer's length only when it
//! arrives. So every payload travels in two parts:
//! - a small [`NcclHeader`] (tag, sender, clock, storage type, length) on the TCP mesh, on
//!   [`NCCL_HEADER_CHANNEL`];
//! - the buffer itself by NCCL, posted by the sender right after its header.
//!
//! The receiver's mesh reader hands each header to this transport, which posts the
//! matching receive at once; the communicator thread completes it and drops the buffer,
//! tagged, into an in-process inbox ([`InProcess`]), where the runtime's `recv` finds it by
//! tag. Headers from one peer arrive in the order they were sent (one TCP stream), so the
//! receives are posted in the order of the sends: NCCL's pairing rule holds without the
//! schedule's help.
//!
//! Why two communicators: a communicator's operations run one after the other on its
//! stream, and a send waits for the peer's matching receive. With one communicator, two
//! neighbours sending to each other at once (an activation one way, a gradient the other)
//! would each wait behind their own send. Sends to higher ranks (activations) therefore
//! use the `up` communicator and sends to lower ranks (gradients) the `down` one: on `up`
//! every send goes upwards, so the chain of waits ends at the last rank, which only
//! receives there (and symmetrically for `down`); no cycle can form.
//!
//! `send` never blocks on the receiver: it writes the header and posts the send. A failed
//! NCCL operation (or a mesh failure) closes the inbox; receivers then get the reason.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use pipefill_actors::{Envelope, InProcess, LinkError, Tag, Transport};
use serde::{Deserialize, Serialize};

use super::frame;
use super::link::PeerLink;
use super::nccl::{
    CudaData, NCCL_HEADER_CHANNEL, NCCL_LINK_ID_CHANNEL, NcclComm, NcclId, share_id,
};
use super::tcp::{Inner, Sink, TcpMesh, Wire};
use super::tcp_transport::{Route, explain_closed, group_rank, route};
use crate::comm::CommError;
use crate::tensor::DType;
use crate::tensor::cuda::CudaBuf;

/// The largest buffer a header may announce (elements): a bound on what a bad header can
/// make this rank allocate.
pub const MAX_ELEMENTS: u64 = 1 << 32;

/// What precedes a buffer on NCCL: everything the receiver needs to post the receive and
/// file the buffer under its tag.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NcclHeader {
    pub to: u32,
    pub from: u32,
    pub tag: Tag,
    pub sent_at: f64,
    pub dtype: DType,
    pub len: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each update under these locks is one assignment: still consistent after a panic.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The inbox and the first failure, shared with the communicator threads' completions.
struct Inbox {
    local: InProcess<CudaBuf>,
    failure: Mutex<Option<String>>,
}

impl Inbox {
    /// Records the first failure, logs it and wakes every receiver.
    fn fail(&self, reason: String) {
        let mut failure = lock(&self.failure);
        if failure.is_none() {
            tracing::error!("{reason}");
            *failure = Some(reason);
        }
        drop(failure);
        Transport::close(&self.local);
    }

    fn failure(&self) -> Option<String> {
        lock(&self.failure).clone()
    }
}

/// The two communicators of the group (see the module docs), ranks numbered as the group.
struct Comms {
    up: NcclComm,
    down: NcclComm,
}

impl Comms {
    /// The communicator a payload between `from` and `to` travels on.
    fn between(&self, from: usize, to: usize) -> &NcclComm {
        if to > from { &self.up } else { &self.down }
    }
}

/// The mesh channel's sink: posts the receive each header announces.
struct Headers {
    rank: usize,
    base: usize,
    world: usize,
    comms: Arc<Comms>,
    inbox: Arc<Inbox>,
}

/// Checks a header that mesh rank `mesh_from` sent to `rank` of the group at `base` of
/// `world` ranks: addressed here, from the rank it says, within the element cap.
fn check_header(
    rank: usize,
    base: usize,
    world: usize,
    mesh_from: usize,
    h: &NcclHeader,
) -> Result<(), String> {
    let from = h.from as usize;
    if h.to as usize != rank || from + base != mesh_from || from >= world {
        return Err(format!(
            "header from rank {from} to rank {} arrived at rank {rank} from mesh rank {mesh_from}",
            h.to
        ));
    }
    if from == rank {
        return Err(format!("rank {from} sent itself a header"));
    }
    if h.len > MAX_ELEMENTS {
        return Err(format!(
            "{} announces {} elements, over the cap of {MAX_ELEMENTS}",
            h.tag, h.len
        ));
    }
    Ok(())
}

impl Sink for Headers {
    fn deliver(&self, mesh_from: usize, bytes: Vec<u8>) -> Result<(), String> {
        let h: NcclHeader = frame::decode(&bytes).map_err(|e| e.to_string())?;
        check_header(self.rank, self.base, self.world, mesh_from, &h)?;
        let (rank, from, tag, sent_at) = (self.rank, h.from as usize, h.tag, h.sent_at);
        let inbox = Arc::clone(&self.inbox);
        let done = Box::new(move |r: Result<CudaData, CommError>| match r {
            Ok(data) => {
                let envelope = Envelope {
                    tag,
                    from,
                    sent_at,
                    payload: CudaBuf::from(data),
                };
                match inbox.local.send(rank, envelope) {
                    // The job is stopping: late payloads are dropped.
                    Ok(()) | Err(LinkError::Closed) => {}
                    Err(e) => inbox.fail(format!("rank {rank}: {e}")),
                }
            }
            Err(e) => inbox.fail(format!(
                "rank {rank}: receiving {tag} from rank {from}: {e}"
            )),
        });
        self.comms
            .between(from, rank)
            .post_recv(h.dtype, h.len as usize, from, done)
            .map_err(|e| e.to_string())
    }

    fn close(&self) {
        Transport::close(&self.inbox.local);
    }
}

/// The runtime's transport over NCCL among the mesh ranks of one pipeline replica (see
/// the module docs).
pub struct NcclTransport {
    rank: usize,
    base: usize,
    world: usize,
    comms: Arc<Comms>,
    inbox: Arc<Inbox>,
    mesh: Arc<Inner>,
    /// Held from a header's write to its send's posting, so headers and sends to a peer
    /// leave in the same order even when several threads send.
    order: Mutex<()>,
}

impl std::fmt::Debug for NcclTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclTransport")
            .field("rank", &self.rank)
            .field("base", &self.base)
            .field("world", &self.world)
            .finish()
    }
}

impl NcclTransport {
    /// The transport among mesh ranks `base..base + size` (numbered `0..size`) on GPU
    /// `ordinal`. Every member calls it at the same point: the group's first rank creates
    /// the communicators' ids and sends them over the mesh, and joining a communicator
    /// waits for every member. Without a GPU or libnccl this is the clear device error.
    pub fn group(
        mesh: &TcpMesh,
        ordinal: usize,
        base: usize,
        size: usize,
    ) -> Result<Self, CommError> {
        let rank = group_rank(mesh.rank(), mesh.world(), base, size)?;
        super::nccl::probe()?;
        let members: Vec<usize> = (base..base + size).collect();
        // Both ids come from the same leader on one channel: they arrive in this order.
        let up = share_id(mesh, &members, NCCL_LINK_ID_CHANNEL, NcclId::create)?;
        let down = share_id(mesh, &members, NCCL_LINK_ID_CHANNEL, NcclId::create)?;
        let comms = Arc::new(Comms {
            up: NcclComm::new(ordinal, rank, size, up)?,
            down: NcclComm::new(ordinal, rank, size, down)?,
        });
        let inbox = Arc::new(Inbox {
            local: InProcess::new(size),
            failure: Mutex::new(None),
        });
        let headers = Headers {
            rank,
            base,
            world: size,
            comms: Arc::clone(&comms),
            inbox: Arc::clone(&inbox),
        };
        mesh.register(NCCL_HEADER_CHANNEL, Arc::new(headers));
        Ok(NcclTransport {
            rank,
            base,
            world: size,
            comms,
            inbox,
            mesh: Arc::clone(mesh.inner()),
            order: Mutex::new(()),
        })
    }

    /// The failure that stopped the transport (an NCCL error or the mesh's, naming the
    /// rank), if any.
    fn failure(&self) -> Option<String> {
        self.inbox.failure().or_else(|| self.mesh.failure())
    }

    /// [`explain_closed`] by the inbox or the mesh's failure.
    fn explain(&self, e: LinkError) -> LinkError {
        explain_closed(e, self.failure())
    }
}

impl Transport<CudaBuf> for NcclTransport {
    fn ranks(&self) -> usize {
        self.world
    }

    fn send(&self, to: usize, envelope: Envelope<CudaBuf>) -> Result<(), LinkError> {
        if route(self.rank, self.world, to, || self.failure())? == Route::Local {
            return self
                .inbox
                .local
                .send(to, envelope)
                .map_err(|e| self.explain(e));
        }
        let header = NcclHeader {
            to: to as u32,
            from: self.rank as u32,
            tag: envelope.tag,
            sent_at: envelope.sent_at,
            dtype: envelope.payload.storage_dtype(),
            len: envelope.payload.element_count() as u64,
        };
        let bytes = frame::encode(&header).map_err(|e| LinkError::Other(e.to_string()))?;
        let inbox = Arc::clone(&self.inbox);
        let (rank, tag) = (self.rank, envelope.tag);
        let done = Box::new(move |r: Result<CudaData, CommError>| {
            if let Err(e) = r {
                inbox.fail(format!("rank {rank}: sending {tag} to rank {to}: {e}"));
            }
        });
        let _order = lock(&self.order);
        self.mesh
            .send_wire(
                self.base + to,
                &Wire::Data {
                    channel: NCCL_HEADER_CHANNEL,
                    bytes,
                },
            )
            .map_err(|e| LinkError::Other(self.failure().unwrap_or_else(|| e.to_string())))?;
        self.comms
            .between(self.rank, to)
            .post_send(envelope.payload.into_data(), to, done)
            .map_err(|e| LinkError::Other(e.to_string()))
    }

    fn try_recv(&self, rank: usize, tag: &Tag) -> Result<Option<Envelope<CudaBuf>>, LinkError> {
        self.inbox
            .local
            .try_recv(rank, tag)
            .map_err(|e| self.explain(e))
    }

    fn recv(&self, rank: usize, tag: &Tag) -> Result<Envelope<CudaBuf>, LinkError> {
        self.inbox
            .local
            .recv(rank, tag)
            .map_err(|e| self.explain(e))
    }

    fn close(&self) {
        Transport::close(&self.inbox.local);
    }
}

#[cfg(test)]
#[path = "nccl_transport_tests.rs"]
mod tests;
