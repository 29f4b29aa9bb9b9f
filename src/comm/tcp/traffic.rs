//! What a rank's mesh has written ([`Sent`]): frames and bytes per data channel, and the
//! mesh's own frames (heartbeats, goodbyes). It is how a job's traffic is measured: the
//! mesh logs it when it closes (`RUST_LOG=pipefill::comm=info`), and tests read it through
//! [`super::TcpMesh::sent`].

use std::collections::BTreeMap;
use std::fmt;

use super::wire::Wire;
use crate::comm::link::Channel;

/// Frames and bytes written (each frame's bytes with its 4-byte length prefix).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    pub frames: u64,
    pub bytes: u64,
}

impl Traffic {
    fn add(&mut self, bytes: usize) {
        self.frames += 1;
        self.bytes += bytes as u64;
    }
}

impl fmt::Display for Traffic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} bytes in {} frames", self.bytes, self.frames)
    }
}

/// Everything one rank's mesh has written to its peers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    /// Data frames, per channel.
    pub channels: BTreeMap<Channel, Traffic>,
    /// The mesh's own frames: heartbeats, goodbyes.
    pub mesh: Traffic,
}

impl Sent {
    /// Counts one frame of `bytes` bytes that carried `wire`.
    pub(super) fn add(&mut self, wire: &Wire, bytes: usize) {
        match wire {
            Wire::Data { channel, .. } => self.channels.entry(*channel).or_default().add(bytes),
            _ => self.mesh.add(bytes),
        }
    }

    /// All frames together.
    pub fn total(&self) -> Traffic {
        self.channels
            .values()
            .chain([&self.mesh])
            .fold(Traffic::default(), |t, c| Traffic {
                frames: t.frames + c.frames,
                bytes: t.bytes + c.bytes,
            })
    }
}

/// The runtime's channels count down from `u32::MAX`, and read better that way.
fn channel_name(c: Channel) -> String {
    match u32::MAX - c {
        0 => "MAX".into(),
        k if k < 1024 => format!("MAX-{k}"),
        _ => c.to_string(),
    }
}

impl fmt::Display for Sent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.total())?;
        for (c, t) in &self.channels {
            write!(f, "; channel {}: {t}", channel_name(*c))?;
        }
        write!(f, "; mesh: {}", self.mesh)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_counted_per_channel_and_in_total() {
        let mut sent = Sent::default();
        let data = |channel| Wire::Data {
            channel,
            bytes: vec![],
        };
        sent.add(&data(u32::MAX - 1), 100);
        sent.add(&data(u32::MAX - 1), 50);
        sent.add(&data(3), 10);
        sent.add(&Wire::Beat, 5);
        assert_eq!(
            sent.channels[&(u32::MAX - 1)],
            Traffic {
                frames: 2,
                bytes: 150
            }
        );
        assert_eq!(
            sent.total(),
            Traffic {
                frames: 4,
                bytes: 165
            }
        );
        assert_eq!(
            sent.to_string(),
            "165 bytes in 4 frames; channel 3: 10 bytes in 1 frames; \
             channel MAX-1: 150 bytes in 2 frames; mesh: 5 bytes in 1 frames"
        );
    }
}
