//! [`TcpTransport`]: the runtime's `Transport<T>` over a [`TcpMesh`] channel, so stage
//! actors in different processes exchange activations, gradients and gradient statistics.
//!
//! A payload for a rank of this process is moved into the local inbox exactly as the
//! in-process transport does (it reuses [`InProcess`]); one for a remote rank is encoded by
//! the transport's [`Codec`] into a [`WireEnvelope`] and sent as one frame on the
//! transport's channel. The mesh's reader thread decodes arriving frames straight into the
//! receiver's inbox (the transport is the channel's [`Sink`]), so receiving by tag works as
//! in-process: early arrivals wait in the inbox. An undecodable envelope fails the mesh
//! with an error naming the sender; a failed mesh closes the inbox and receivers get the
//! mesh's error (naming the dead rank) instead of a bare "link closed".

use std::sync::Arc;

use pipefill_actors::{Envelope, InProcess, LinkError, Tag, Transport};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::frame;
use super::link::Channel;
use super::tcp::{Inner, Sink, TcpMesh, Wire};
use crate::comm::CommError;
use crate::tensor::{Backend, DType};

/// Channels the runtime's transports use; peer-link users take small numbers.
pub const TENSOR_CHANNEL: Channel = u32::MAX - 1;
pub const STATS_CHANNEL: Channel = u32::MAX - 2;
pub const CONTROL_CHANNEL: Channel = u32::MAX - 3;

/// Turns a payload into bytes and back.
pub trait Codec<T>: Send + Sync + 'static {
    fn encode(&self, value: &T) -> Result<Vec<u8>, String>;
    fn decode(&self, bytes: &[u8]) -> Result<T, String>;
}

/// The codec of any serde type (gradient statistics, control messages): bincode 2.
pub struct SerdeCodec;

impl<T: Serialize + DeserializeOwned + Send + 'static> Codec<T> for SerdeCodec {
    fn encode(&self, value: &T) -> Result<Vec<u8>, String> {
        frame::encode(value).map_err(|e| e.to_string())
    }
    fn decode(&self, bytes: &[u8]) -> Result<T, String> {
        frame::decode(bytes).map_err(|e| e.to_string())
    }
}

/// A backend buffer on the wire: its storage type, its number of values and its storage's
/// bytes ([`Backend::to_host_bytes`]: 4 an `f32`, the 2-byte bits of a `bf16`, so a bf16
/// activation costs 2 bytes an element and is never widened on either side). Decoded, `bytes`
/// is a view of the frame: nothing is allocated before [`HostBuf::values`] has held the
/// declared type and length against it.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct HostBuf<'a> {
    pub dtype: DType,
    pub len: u64,
    #[serde(serialize_with = "frame::byte_string")]
    pub bytes: &'a [u8],
}

impl HostBuf<'_> {
    /// The number of values, when `bytes` holds exactly `len` values of `dtype`.
    pub fn values(&self) -> Result<usize, CommError> {
        let wrong = || CommError::BufPayload {
            dtype: self.dtype,
            len: self.len,
            got: self.bytes.len(),
        };
        match self.len.checked_mul(self.dtype.size() as u64) {
            Some(need) if need == self.bytes.len() as u64 => {
                usize::try_from(self.len).map_err(|_| wrong())
            }
            _ => Err(wrong()),
        }
    }
}

/// The codec of a backend's buffers (activations and gradients between stages): a
/// [`HostBuf`] of the buffer's storage bytes.
pub struct BufCodec<B: Backend>(pub B);

impl<B: Backend> Codec<B::Buf> for BufCodec<B> {
    fn encode(&self, value: &B::Buf) -> Result<Vec<u8>, String> {
        let bytes = self.0.to_host_bytes(value).map_err(|e| e.to_string())?;
        let host = HostBuf {
            dtype: self.0.dtype(value),
            len: self.0.len(value) as u64,
            bytes: &bytes,
        };
        frame::encode(&host).map_err(|e| e.to_string())
    }
    fn decode(&self, bytes: &[u8]) -> Result<B::Buf, String> {
        let host: HostBuf = frame::decode(bytes).map_err(|e| e.to_string())?;
        host.values().map_err(|e| e.to_string())?;
        self.0
            .from_host_bytes(host.bytes, host.dtype)
            .map_err(|e| e.to_string())
    }
}

/// One payload on the wire: its envelope's fields and the encoded payload (decoded, a view
/// of the frame, which the codec decodes from without a copy).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct WireEnvelope<'a> {
    pub to: u32,
    pub from: u32,
    pub tag: Tag,
    pub sent_at: f64,
    #[serde(serialize_with = "frame::byte_string")]
    pub payload: &'a [u8],
}

struct Port<T, C> {
    local: InProcess<T>,
    codec: C,
    /// This process's rank within the transport's group, whose rank 0 is mesh rank `base`.
    rank: usize,
    base: usize,
}

impl<T: Send + 'static, C: Codec<T>> Sink for Port<T, C> {
    fn deliver(&self, from: usize, bytes: Vec<u8>) -> Result<(), String> {
        let wire: WireEnvelope = frame::decode(&bytes).map_err(|e| e.to_string())?;
        if wire.to as usize != self.rank || wire.from as usize + self.base != from {
            return Err(format!(
                "envelope from rank {} to rank {} arrived at rank {} from rank {from}",
                wire.from, wire.to, self.rank
            ));
        }
        let payload = self.codec.decode(wire.payload)?;
        let envelope = Envelope {
            tag: wire.tag,
            from: wire.from as usize,
            sent_at: wire.sent_at,
            payload,
        };
        match self.local.send(self.rank, envelope) {
            // The job is stopping: late payloads are dropped.
            Ok(()) | Err(LinkError::Closed) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }

    fn close(&self) {
        Transport::close(&self.local);
    }
}

/// This process's rank within the group of mesh ranks `base..base + size`, or why the
/// group is wrong (shared by every transport that numbers a range of the mesh).
pub fn group_rank(
    mesh_rank: usize,
    world: usize,
    base: usize,
    size: usize,
) -> Result<usize, CommError> {
    if size == 0 {
        return Err(CommError::EmptyGroup { base });
    }
    if base.checked_add(size).is_none_or(|end| end > world) {
        return Err(CommError::PastMesh { base, size, world });
    }
    if mesh_rank < base || mesh_rank >= base + size {
        return Err(CommError::NotInGroup {
            rank: mesh_rank,
            base,
            size,
        });
    }
    Ok(mesh_rank - base)
}

/// Where a transport over the mesh sends a payload.
#[derive(Debug, PartialEq)]
pub(crate) enum Route {
    /// To a rank of this process: into its inbox, as in-process.
    Local,
    /// Over the mesh.
    Remote,
}

/// The send guards every transport over the mesh shares: a payload for `rank` itself stays
/// in this process, one for a rank past `world` is refused, and nothing leaves once the
/// mesh failed (`failure`'s reason names the rank at fault).
pub(crate) fn route(
    rank: usize,
    world: usize,
    to: usize,
    failure: impl FnOnce() -> Option<String>,
) -> Result<Route, LinkError> {
    if to == rank {
        return Ok(Route::Local);
    }
    if to >= world {
        return Err(LinkError::NoSuchRank { to, ranks: world });
    }
    match failure() {
        Some(reason) => Err(LinkError::Other(reason)),
        None => Ok(Route::Remote),
    }
}

/// `Closed` after a failure becomes the failure (it names the rank that died).
pub(crate) fn explain_closed(e: LinkError, failure: Option<String>) -> LinkError {
    match (e, failure) {
        (LinkError::Closed, Some(reason)) => LinkError::Other(reason),
        (e, _) => e,
    }
}

/// The runtime's transport between the ranks of a multi-process job (one rank per process).
pub struct TcpTransport<T, C> {
    port: Arc<Port<T, C>>,
    mesh: Arc<Inner>,
    channel: Channel,
    world: usize,
}

impl<T: Send + 'static, C: Codec<T>> TcpTransport<T, C> {
    /// The transport on `channel` of `mesh`, for this process's rank.
    pub fn new(mesh: &TcpMesh, channel: Channel, codec: C) -> Self {
        use super::link::PeerLink;
        let world = mesh.world();
        let port = Arc::new(Port {
            local: InProcess::new(world),
            codec,
            rank: mesh.rank(),
            base: 0,
        });
        Self::on_mesh(mesh, channel, port)
    }

    /// The transport among mesh ranks `base..base + size` (one data-parallel replica's
    /// pipeline), which it numbers `0..size`; an error names the range when it is empty,
    /// runs past the mesh or does not hold this process's mesh rank.
    pub fn group(
        mesh: &TcpMesh,
        channel: Channel,
        codec: C,
        base: usize,
        size: usize,
    ) -> Result<Self, CommError> {
        use super::link::PeerLink;
        let rank = group_rank(mesh.rank(), mesh.world(), base, size)?;
        let port = Arc::new(Port {
            local: InProcess::new(size),
            codec,
            rank,
            base,
        });
        Ok(Self::on_mesh(mesh, channel, port))
    }

    fn on_mesh(mesh: &TcpMesh, channel: Channel, port: Arc<Port<T, C>>) -> Self {
        mesh.register(channel, Arc::clone(&port) as Arc<dyn Sink>);
        TcpTransport {
            world: port.local.ranks(),
            port,
            mesh: Arc::clone(mesh.inner()),
            channel,
        }
    }

    /// [`explain_closed`] by the mesh's failure.
    fn explain(&self, e: LinkError) -> LinkError {
        explain_closed(e, self.mesh.failure())
    }
}

impl<T: Send + 'static, C: Codec<T>> Transport<T> for TcpTransport<T, C> {
    fn ranks(&self) -> usize {
        self.world
    }

    fn send(&self, to: usize, envelope: Envelope<T>) -> Result<(), LinkError> {
        if route(self.port.rank, self.world, to, || self.mesh.failure())? == Route::Local {
            return self
                .port
                .local
                .send(to, envelope)
                .map_err(|e| self.explain(e));
        }
        let payload = self
            .port
            .codec
            .encode(&envelope.payload)
            .map_err(LinkError::Other)?;
        let wire = WireEnvelope {
            to: to as u32,
            from: envelope.from as u32,
            tag: envelope.tag,
            sent_at: envelope.sent_at,
            payload: &payload,
        };
        let bytes = frame::encode(&wire).map_err(|e| LinkError::Other(e.to_string()))?;
        self.mesh
            .send_wire(
                self.port.base + to,
                &Wire::Data {
                    channel: self.channel,
                    bytes,
                },
            )
            .map_err(|e| match self.mesh.failure() {
                Some(reason) => LinkError::Other(reason),
                None => LinkError::Other(e.to_string()),
            })
    }

    fn try_recv(&self, rank: usize, tag: &Tag) -> Result<Option<Envelope<T>>, LinkError> {
        self.port
            .local
            .try_recv(rank, tag)
            .map_err(|e| self.explain(e))
    }

    fn recv(&self, rank: usize, tag: &Tag) -> Result<Envelope<T>, LinkError> {
        self.port.local.recv(rank, tag).map_err(|e| self.explain(e))
    }

    fn close(&self) {
        Transport::close(&self.port.local);
    }
}

#[cfg(test)]
#[path = "tcp_transport_tests.rs"]
mod tests;
