//! Links between stage actors: the [`Transport`] trait and its in-process implementation.
//!
//! A payload is tagged with what it is (activation or gradient), the stage that consumes
//! it, the micro-batch and the iteration; a receiver asks for one tag and gets exactly that
//! payload, whatever else arrived first. Tagging by iteration is what lets consecutive
//! iterations overlap: an early arrival for iteration k+1 waits in the receiver's buffer
//! while the receiver still works on iteration k.
//!
//! The trait is shaped for the transports to come as well as for the in-process one:
//! a TCP or NCCL link also sends to a rank and receives by tag with a blocking call,
//! can fail ([`LinkError`]), and must be closable so that a failing job wakes every
//! blocked receiver instead of hanging. Each envelope carries the sender's clock reading
//! so the receiver can apply the virtual-clock rule (see [`crate::clock`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Condvar, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::error::LinkError;

/// Which way a payload flows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Flow {
    /// A forward activation, from stage `s − 1` to stage `s`.
    Activation,
    /// An input gradient, from stage `s + 1` to stage `s`.
    Gradient,
    /// A rank's gradient statistics after an iteration ([`crate::GradStats`]), sent to
    /// every other rank for the optimizer step's decision. The tag's `stage` holds the
    /// sending rank and its `microbatch` is 0. They travel on their own transport
    /// (`Transport<GradStats>`), so a tensor link never carries them.
    GradStats,
}

/// What a payload is: `(flow, consuming stage, micro-batch, iteration)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Tag {
    pub flow: Flow,
    /// The stage that consumes the payload (the sender's stage ± 1).
    pub stage: u32,
    pub microbatch: u32,
    pub iteration: u64,
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.flow {
            Flow::Activation => "activation",
            Flow::Gradient => "gradient",
            Flow::GradStats => {
                return write!(
                    f,
                    "gradient statistics of rank {} (iteration {})",
                    self.stage, self.iteration
                );
            }
        };
        write!(
            f,
            "{what} for stage {} micro-batch {} (iteration {})",
            self.stage, self.microbatch, self.iteration
        )
    }
}

/// A payload in flight, with its tag, its sender and the sender's clock when it was sent
/// (seconds; virtual or wall, as the run's [`crate::Clock`]).
#[derive(Debug)]
pub struct Envelope<T> {
    pub tag: Tag,
    pub from: usize,
    pub sent_at: f64,
    pub payload: T,
}

/// A link layer between the ranks of one job.
///
/// `rank` in the receiving calls is the local receiver: an in-process transport serves
/// every rank, a TCP or NCCL transport the ranks of its own process.
pub trait Transport<T>: Send + Sync + 'static {
    /// Number of ranks the job spans.
    fn ranks(&self) -> usize;
    /// Sends `envelope` to rank `to` (moves the payload; never blocks on the receiver).
    fn send(&self, to: usize, envelope: Envelope<T>) -> Result<(), LinkError>;
    /// Takes the payload tagged `tag` for `rank` if it has arrived.
    fn try_recv(&self, rank: usize, tag: &Tag) -> Result<Option<Envelope<T>>, LinkError>;
    /// Waits until the payload tagged `tag` for `rank` arrives, or the transport closes.
    fn recv(&self, rank: usize, tag: &Tag) -> Result<Envelope<T>, LinkError>;
    /// Closes every link: blocked and later receives of what has not arrived fail with
    /// [`LinkError::Closed`].
    fn close(&self);
}

/// One rank's receive buffer.
struct Inbox<T> {
    arrived: HashMap<Tag, Envelope<T>>,
    closed: bool,
}

struct Port<T> {
    inbox: Mutex<Inbox<T>>,
    ready: Condvar,
}

/// Zero-copy message passing between stage actors of one process: a payload is moved into
/// the receiver's buffer and moved out by the receiver.
pub struct InProcess<T> {
    ports: Vec<Port<T>>,
}

impl<T: Send + 'static> InProcess<T> {
    /// A transport between `ranks` ranks of this process.
    pub fn new(ranks: usize) -> Self {
        InProcess {
            ports: (0..ranks)
                .map(|_| Port {
                    inbox: Mutex::new(Inbox {
                        arrived: HashMap::new(),
                        closed: false,
                    }),
                    ready: Condvar::new(),
                })
                .collect(),
        }
    }

    fn port(&self, rank: usize) -> Result<&Port<T>, LinkError> {
        self.ports.get(rank).ok_or(LinkError::NoSuchRank {
            to: rank,
            ranks: self.ports.len(),
        })
    }
}

/// A poisoned lock only means another stage panicked while holding it; the buffer itself
/// is a plain map and stays consistent, so keep going (the panic is reported elsewhere).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T: Send + 'static> Transport<T> for InProcess<T> {
    fn ranks(&self) -> usize {
        self.ports.len()
    }

    fn send(&self, to: usize, envelope: Envelope<T>) -> Result<(), LinkError> {
        let port = self.port(to)?;
        let mut inbox = lock(&port.inbox);
        if inbox.closed {
            return Err(LinkError::Closed);
        }
        let tag = envelope.tag;
        if inbox.arrived.insert(tag, envelope).is_some() {
            return Err(LinkError::Duplicate { to, tag });
        }
        drop(inbox);
        port.ready.notify_one();
        Ok(())
    }

    fn try_recv(&self, rank: usize, tag: &Tag) -> Result<Option<Envelope<T>>, LinkError> {
        let mut inbox = lock(&self.port(rank)?.inbox);
        match inbox.arrived.remove(tag) {
            Some(env) => Ok(Some(env)),
            None if inbox.closed => Err(LinkError::Closed),
            None => Ok(None),
        }
    }

    fn recv(&self, rank: usize, tag: &Tag) -> Result<Envelope<T>, LinkError> {
        let port = self.port(rank)?;
        let mut inbox = lock(&port.inbox);
        loop {
            // What arrived before the close is still delivered, as `try_recv` does: ranks
            // of one job split over processes that share this transport (tests/split.rs)
            // close it when their part ends, while a peer may still take its last message.
            if let Some(env) = inbox.arrived.remove(tag) {
                return Ok(env);
            }
            if inbox.closed {
                return Err(LinkError::Closed);
            }
            inbox = port.ready.wait(inbox).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn close(&self) {
        for port in &self.ports {
            lock(&port.inbox).closed = true;
            port.ready.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn tag(mb: u32, iteration: u64) -> Tag {
        Tag {
            flow: Flow::Activation,
            stage: 1,
            microbatch: mb,
            iteration,
        }
    }

    fn env(mb: u32, iteration: u64, payload: u32) -> Envelope<u32> {
        Envelope {
            tag: tag(mb, iteration),
            from: 0,
            sent_at: 0.0,
            payload,
        }
    }

    #[test]
    fn receives_by_tag_whatever_the_arrival_order() {
        let t = InProcess::new(2);
        t.send(1, env(0, 1, 10)).unwrap();
        t.send(1, env(0, 0, 20)).unwrap();
        assert!(t.try_recv(1, &tag(1, 0)).unwrap().is_none());
        assert_eq!(t.recv(1, &tag(0, 0)).unwrap().payload, 20);
        assert_eq!(t.recv(1, &tag(0, 1)).unwrap().payload, 10);
    }

    #[test]
    fn rejects_duplicates_and_unknown_ranks() {
        let t = InProcess::new(2);
        t.send(1, env(0, 0, 1)).unwrap();
        assert!(matches!(
            t.send(1, env(0, 0, 2)),
            Err(LinkError::Duplicate { to: 1, .. })
        ));
        assert_eq!(
            t.send(5, env(0, 0, 1)).unwrap_err(),
            LinkError::NoSuchRank { to: 5, ranks: 2 }
        );
    }

    /// A message that arrived before the close is still delivered, by `recv` as by
    /// `try_recv`; only what has not arrived is `Closed`.
    #[test]
    fn what_arrived_before_a_close_is_still_received() {
        let t = InProcess::new(2);
        t.send(1, env(0, 0, 7)).unwrap();
        t.send(1, env(0, 1, 8)).unwrap();
        t.close();
        assert_eq!(t.recv(1, &tag(0, 0)).unwrap().payload, 7);
        assert_eq!(t.try_recv(1, &tag(0, 1)).unwrap().unwrap().payload, 8);
        assert_eq!(t.recv(1, &tag(0, 0)).unwrap_err(), LinkError::Closed);
    }

    #[test]
    fn close_wakes_a_blocked_receiver() {
        let t = Arc::new(InProcess::<u32>::new(2));
        let t2 = Arc::clone(&t);
        let waiter = std::thread::spawn(move || t2.recv(1, &tag(0, 0)));
        std::thread::sleep(std::time::Duration::from_millis(20));
        t.close();
        assert_eq!(waiter.join().unwrap().unwrap_err(), LinkError::Closed);
        assert_eq!(t.send(1, env(0, 0, 1)).unwrap_err(), LinkError::Closed);
    }
}
