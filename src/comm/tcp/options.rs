//! A mesh's settings ([`MeshOptions`]): why its setup can fail is a [`CommError`](crate::comm::CommError).

use std::time::Duration;

use crate::comm::frame;

/// Settings of a mesh.
#[derive(Clone, Debug)]
pub struct MeshOptions {
    pub token: String,
    /// Cap on one frame (bytes).
    pub frame_cap: usize,
    /// How long setup may take before naming the ranks that did not connect.
    pub connect_timeout: Duration,
    /// Interval of heartbeats sent on every connection.
    pub beat: Duration,
    /// A peer silent for this long is declared dead.
    pub silence: Duration,
    /// How long an accepted connection may take to present its hello.
    pub handshake_timeout: Duration,
}

impl MeshOptions {
    pub fn new(token: impl Into<String>) -> Self {
        MeshOptions {
            token: token.into(),
            frame_cap: frame::DEFAULT_FRAME_CAP,
            connect_timeout: Duration::from_secs(60),
            beat: Duration::from_secs(1),
            silence: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(10),
        }
    }
}
