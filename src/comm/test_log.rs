//! Log capture for the comm tests that check an error is logged (a dropped connection):
//! a `tracing` subscriber writing into a shared buffer. Threads the code under test
//! spawns inherit it (they carry the caller's dispatcher over).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The text logged through [`LogBuf::subscriber`].
#[derive(Clone, Default)]
pub(crate) struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogBuf {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogBuf {
    /// A subscriber that writes every event into this buffer.
    pub(crate) fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + 'static {
        let buf = self.clone();
        tracing_subscriber::fmt()
            .with_writer(move || buf.clone())
            .with_ansi(false)
            .finish()
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Waits up to `timeout` for a logged line containing `needle`; that line.
    pub(crate) fn wait_for(&self, needle: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.text().lines().find(|l| l.contains(needle)) {
                return Some(line.to_string());
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
