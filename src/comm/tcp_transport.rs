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

/// A backend buffer on the wire: its storage type and its values as host `f32`s (exact
/// for both storage types: a bf16 value widens to f32 and rounds back to itself).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct HostBuf {
    pub dtype: DType,
    pub data: Vec<f32>,
}

/// The codec of a backend's buffers (activations and gradients between stages).
pub struct BufCodec<B: Backend>(pub B);

impl<B: Backend> Codec<B::Buf> for BufCodec<B> {
    fn encode(&self, value: &B::Buf) -> Result<Vec<u8>, String> {
        let host = HostBuf {
            dtype: self.0.dtype(value),
            data: self.0.to_host(value).map_err(|e| e.to_string())?,
        };
        frame::encode(&host).map_err(|e| e.to_string())
    }
    fn decode(&self, bytes: &[u8]) -> Result<B::Buf, String> {
        let host: HostBuf = frame::decode(bytes).map_err(|e| e.to_string())?;
        self.0
            .from_host(&host.data, host.dtype)
            .map_err(|e| e.to_string())
    }
}

/// One payload on the wire: its envelope's fields and the encoded payload.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct WireEnvelope {
    pub to: u32,
    pub from: u32,
    pub tag: Tag,
    pub sent_at: f64,
    pub payload: Vec<u8>,
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
        let payload = self.codec.decode(&wire.payload)?;
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
        Self::group(mesh, channel, codec, 0, world)
    }

    /// The transport among mesh ranks `base..base + size` (one data-parallel replica's
    /// pipeline), which it numbers `0..size`.
    ///
    /// # Panics
    /// When this process's mesh rank is not one of them (a caller's numbering bug).
    pub fn group(mesh: &TcpMesh, channel: Channel, codec: C, base: usize, size: usize) -> Self {
        use super::link::PeerLink;
        let rank = mesh.rank().wrapping_sub(base);
        assert!(
            rank < size,
            "mesh rank {} is not in ranks {base}..{}",
            mesh.rank(),
            base + size
        );
        let world = size;
        let port = Arc::new(Port {
            local: InProcess::new(world),
            codec,
            rank,
            base,
        });
        mesh.register(channel, Arc::clone(&port) as Arc<dyn Sink>);
        TcpTransport {
            port,
            mesh: Arc::clone(mesh.inner()),
            channel,
            world,
        }
    }

    /// `Closed` after a mesh failure becomes the failure (it names the rank that died).
    fn explain(&self, e: LinkError) -> LinkError {
        match (e, self.mesh.failure()) {
            (LinkError::Closed, Some(reason)) => LinkError::Other(reason),
            (e, _) => e,
        }
    }
}

impl<T: Send + 'static, C: Codec<T>> Transport<T> for TcpTransport<T, C> {
    fn ranks(&self) -> usize {
        self.world
    }

    fn send(&self, to: usize, envelope: Envelope<T>) -> Result<(), LinkError> {
        if to == self.port.rank {
            return self
                .port
                .local
                .send(to, envelope)
                .map_err(|e| self.explain(e));
        }
        if to >= self.world {
            return Err(LinkError::NoSuchRank {
                to,
                ranks: self.world,
            });
        }
        if let Some(reason) = self.mesh.failure() {
            return Err(LinkError::Other(reason));
        }
        let wire = WireEnvelope {
            to: to as u32,
            from: envelope.from as u32,
            tag: envelope.tag,
            sent_at: envelope.sent_at,
            payload: self
                .port
                .codec
                .encode(&envelope.payload)
                .map_err(LinkError::Other)?,
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
