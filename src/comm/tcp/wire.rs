//! What crosses a mesh connection ([`Wire`]) and where a channel's data frames go as they
//! arrive ([`Sink`]).

use serde::{Deserialize, Serialize};

use crate::comm::link::Channel;

/// A frame on an established connection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Wire {
    Data {
        channel: Channel,
        /// Written and read as one byte string (the same bytes as a `u8` sequence).
        #[serde(
            serialize_with = "crate::comm::frame::byte_string",
            deserialize_with = "crate::comm::frame::byte_vec"
        )]
        bytes: Vec<u8>,
    },
    /// Nothing to say; proves the peer is alive.
    Beat,
    /// The peer has sent everything and is leaving: its connection ending is not a failure.
    Bye,
    /// The peer's mesh failed for `reason` (which names the rank at fault) and it is about
    /// to exit: its connection ending next is a consequence, not the cause.
    Failed { reason: String },
}

/// Receives data frames of one channel as they arrive (on the peer's reader thread), and
/// is closed when the mesh fails.
pub trait Sink: Send + Sync {
    /// A frame from rank `from`. An error is a protocol violation by `from`: it fails the mesh.
    fn deliver(&self, from: usize, bytes: Vec<u8>) -> Result<(), String>;
    /// Nothing more will arrive; wake whoever waits.
    fn close(&self);
}
