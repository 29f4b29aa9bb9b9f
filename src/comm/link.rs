//! The point-to-point seam between processes: [`PeerLink`], plus [`InProcessLink`], an
//! implementation for tests and single-process runs.
//!
//! A link joins the `world` ranks of a job. Any rank can send a byte frame to any other rank
//! on a numbered channel; frames between one (sender, receiver, channel) triple arrive in the
//! order they were sent, and channels are independent, so a collective on one channel never
//! reads a frame that belongs to another (the gradient all-reduce of each stage uses its own
//! channel). The launcher implements the trait over its TCP mesh; the collectives in
//! [`super::collective`] and the data-parallel trainer only ever see the trait.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};

use crate::comm::CommError;

/// A numbered stream of frames between two ranks.
pub type Channel = u32;

/// Byte frames between the ranks of one job.
///
/// `send` may return before the peer received the frame (it is buffered), so two ranks that
/// both send before they receive do not deadlock. `recv` blocks until the next frame from
/// that peer on that channel arrives, or fails once the peer has closed and nothing is left.
pub trait PeerLink: Send + Sync {
    /// This process's rank, in `0..world()`.
    fn rank(&self) -> usize;
    /// The number of ranks in the job.
    fn world(&self) -> usize;
    /// Sends one frame to rank `to` on `channel`.
    fn send(&self, to: usize, channel: Channel, frame: &[u8]) -> Result<(), CommError>;
    /// The next frame from rank `from` on `channel`, waiting for it.
    fn recv(&self, from: usize, channel: Channel) -> Result<Vec<u8>, CommError>;
    /// Ends this rank's side: peers blocked on a frame from it get [`CommError::Closed`] once
    /// the frames already sent are read. Closing twice is harmless.
    fn close(&self) -> Result<(), CommError>;
}

/// Checks that `peer` is another rank of a world of `world` ranks.
pub fn check_peer(
    rank: usize,
    world: usize,
    peer: usize,
    channel: Channel,
) -> Result<(), CommError> {
    if peer >= world {
        return Err(CommError::NoSuchRank { rank: peer, world });
    }
    if peer == rank {
        return Err(CommError::ToSelf { rank, channel });
    }
    Ok(())
}

/// Queues of undelivered frames by (from, to, channel), and which ranks have closed.
#[derive(Default)]
struct Mailboxes {
    queues: HashMap<(usize, usize, Channel), VecDeque<Vec<u8>>>,
    closed: Vec<bool>,
}

struct Hub {
    boxes: Mutex<Mailboxes>,
    arrived: Condvar,
}

/// One rank's end of an in-process link: every rank of the group shares one set of queues,
/// so a "send" is a push and a "recv" waits on a condition variable.
#[derive(Clone)]
pub struct InProcessLink {
    rank: usize,
    world: usize,
    hub: Arc<Hub>,
}

impl InProcessLink {
    /// The `world` ends of one link, indexed by rank.
    pub fn group(world: usize) -> Vec<InProcessLink> {
        let hub = Arc::new(Hub {
            boxes: Mutex::new(Mailboxes {
                queues: HashMap::new(),
                closed: vec![false; world],
            }),
            arrived: Condvar::new(),
        });
        (0..world)
            .map(|rank| InProcessLink {
                rank,
                world,
                hub: Arc::clone(&hub),
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Mailboxes> {
        // A panic while holding the lock cannot leave the queues half-updated (every update
        // is one push or pop), so a poisoned lock is still consistent.
        self.hub
            .boxes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl PeerLink for InProcessLink {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn send(&self, to: usize, channel: Channel, frame: &[u8]) -> Result<(), CommError> {
        check_peer(self.rank, self.world, to, channel)?;
        let mut boxes = self.lock();
        if boxes.closed[self.rank] || boxes.closed[to] {
            return Err(CommError::Closed { peer: to, channel });
        }
        boxes
            .queues
            .entry((self.rank, to, channel))
            .or_default()
            .push_back(frame.to_vec());
        drop(boxes);
        self.hub.arrived.notify_all();
        Ok(())
    }

    fn recv(&self, from: usize, channel: Channel) -> Result<Vec<u8>, CommError> {
        check_peer(self.rank, self.world, from, channel)?;
        let mut boxes = self.lock();
        loop {
            if let Some(frame) = boxes
                .queues
                .get_mut(&(from, self.rank, channel))
                .and_then(VecDeque::pop_front)
            {
                return Ok(frame);
            }
            if boxes.closed[from] || boxes.closed[self.rank] {
                return Err(CommError::Closed {
                    peer: from,
                    channel,
                });
            }
            boxes = self
                .hub
                .arrived
                .wait(boxes)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    fn close(&self) -> Result<(), CommError> {
        self.lock().closed[self.rank] = true;
        self.hub.arrived.notify_all();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_arrive_in_order_per_channel() {
        let links = InProcessLink::group(3);
        links[0].send(2, 7, b"a").unwrap();
        links[0].send(2, 9, b"x").unwrap();
        links[0].send(2, 7, b"b").unwrap();
        links[1].send(2, 7, b"c").unwrap();
        assert_eq!(links[2].recv(0, 9).unwrap(), b"x");
        assert_eq!(links[2].recv(1, 7).unwrap(), b"c");
        assert_eq!(links[2].recv(0, 7).unwrap(), b"a");
        assert_eq!(links[2].recv(0, 7).unwrap(), b"b");
    }

    #[test]
    fn recv_waits_for_a_frame_from_another_thread() {
        let links = InProcessLink::group(2);
        let sender = links[1].clone();
        let handle = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            sender.send(0, 1, &[1, 2, 3]).unwrap();
        });
        assert_eq!(links[0].recv(1, 1).unwrap(), vec![1, 2, 3]);
        handle.join().unwrap();
    }

    #[test]
    fn bad_peers_and_closed_links_are_errors() {
        let links = InProcessLink::group(2);
        assert!(matches!(
            links[0].send(2, 0, b""),
            Err(CommError::NoSuchRank { rank: 2, world: 2 })
        ));
        assert!(matches!(
            links[0].send(0, 3, b""),
            Err(CommError::ToSelf {
                rank: 0,
                channel: 3
            })
        ));
        links[1].send(0, 0, b"last").unwrap();
        links[1].close().unwrap();
        // Frames sent before the close are still delivered; after them the close shows.
        assert_eq!(links[0].recv(1, 0).unwrap(), b"last");
        assert!(matches!(
            links[0].recv(1, 0),
            Err(CommError::Closed {
                peer: 1,
                channel: 0
            })
        ));
        assert!(matches!(
            links[0].send(1, 0, b"late"),
            Err(CommError::Closed { peer: 1, .. })
        ));
    }
}
