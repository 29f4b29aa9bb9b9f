//! Heartbeats: a thread that sends [`Wire::Beat`] to every peer at a fixed interval, so a
//! silent connection means a dead (or hung) rank, not an idle one.
//!
//! The other half lives in each peer's reader (`tcp.rs`): a read that times out after the
//! mesh's silence window fails the mesh naming that rank, and an end of stream without a
//! goodbye does so at once (a killed process's sockets are closed by the kernel). With the
//! defaults (beat 1 s, silence 5 s) every surviving rank learns of a death within 5 s.

use std::sync::Arc;
use std::sync::mpsc::{RecvTimeoutError, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

use super::tcp::inner::Inner;
use super::tcp::wire::Wire;

/// The running heartbeat thread of one mesh.
pub(crate) struct Heartbeat {
    stop: Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeat {
    pub(crate) fn start(mesh: Arc<Inner>, every: Duration) -> Heartbeat {
        let (stop, stopped) = channel::<()>();
        let thread = std::thread::Builder::new()
            .name("pipefill-heartbeat".into())
            .spawn(move || {
                loop {
                    match stopped.recv_timeout(every) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    for peer in mesh.peers() {
                        // A failed send shows up as that peer's reader failing; the other
                        // peers still need their beats.
                        let _ = mesh.send_wire(peer, &Wire::Beat);
                    }
                }
            })
            .ok();
        Heartbeat { stop, thread }
    }

    /// Stops the thread (no more beats are sent once this returns).
    pub(crate) fn stop(mut self) {
        let _ = self.stop.send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
