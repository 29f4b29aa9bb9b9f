//! Clocks: how a stage measures the time of its actions.
//!
//! - [`Clock::Wall`]: real time since the job's start. The truth on real devices.
//! - [`Clock::Virtual`]: each rank keeps its own clock, advanced by the thread CPU time each
//!   action used, as if every rank had a device of its own. A payload sent at the sender's
//!   time `t` is available to the receiver at `t + link_latency`, so a receive completes at
//!   `max(receiver clock, sender clock + link latency)`. On a small shared CPU machine this
//!   gives the timeline the job would have with one device per rank, independent of how the
//!   OS interleaves the stage threads.

use std::time::Instant;

use serde::{Deserialize, Serialize};

/// Which clock a run measures its timeline with.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Clock {
    /// Real elapsed time.
    Wall,
    /// Per-rank virtual time from thread CPU time; `link_latency` (seconds) is added to every
    /// payload that crosses ranks.
    Virtual { link_latency: f64 },
}

impl Clock {
    /// A virtual clock with free links.
    pub const fn virtual_free() -> Clock {
        Clock::Virtual { link_latency: 0.0 }
    }
}

/// CPU time consumed so far by the calling thread, in seconds.
pub fn thread_cpu_time() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID is supported on
    // every Linux kernel this project targets. On failure `ts` stays zero.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Spins on the calling thread until it has used `seconds` more CPU time. A helper for fakes
/// and benchmarks whose cost must be known exactly.
pub fn spin_cpu(seconds: f64) {
    let until = thread_cpu_time() + seconds;
    while thread_cpu_time() < until {
        std::hint::spin_loop();
    }
}

/// One rank's reading of the run's clock.
#[derive(Debug)]
pub(crate) struct RankClock {
    mode: Clock,
    epoch: Instant,
    /// Virtual time of this rank (unused in wall mode).
    virtual_now: f64,
}

/// A measurement in progress (see [`RankClock::start`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stopwatch {
    pub start: f64,
    cpu: f64,
}

impl RankClock {
    pub fn new(mode: Clock, epoch: Instant) -> Self {
        RankClock {
            mode,
            epoch,
            virtual_now: 0.0,
        }
    }

    pub fn is_virtual(&self) -> bool {
        matches!(self.mode, Clock::Virtual { .. })
    }

    /// The rank's current time.
    pub fn now(&self) -> f64 {
        match self.mode {
            Clock::Wall => self.epoch.elapsed().as_secs_f64(),
            Clock::Virtual { .. } => self.virtual_now,
        }
    }

    /// Starts timing a piece of work run on this thread.
    pub fn start(&self) -> Stopwatch {
        Stopwatch {
            start: self.now(),
            cpu: if self.is_virtual() {
                thread_cpu_time()
            } else {
                0.0
            },
        }
    }

    /// Ends the measurement: returns `(start, end)` and, in virtual mode, advances the clock
    /// by the CPU time used since [`RankClock::start`].
    pub fn stop(&mut self, watch: Stopwatch) -> (f64, f64) {
        match self.mode {
            Clock::Wall => (watch.start, self.now()),
            Clock::Virtual { .. } => {
                let used = (thread_cpu_time() - watch.cpu).max(0.0);
                self.virtual_now = watch.start + used;
                (watch.start, self.virtual_now)
            }
        }
    }

    /// When a payload sent at `sent_at` by rank `from` is available to rank `to`: the
    /// virtual-clock rule; in wall mode, the moment it was taken (now).
    pub fn arrival(&self, from: usize, to: usize, sent_at: f64) -> f64 {
        match self.mode {
            Clock::Wall => self.now(),
            Clock::Virtual { link_latency } => {
                let latency = if from == to { 0.0 } else { link_latency };
                sent_at + latency
            }
        }
    }

    /// Moves a virtual clock forward to `t` (a receive that completes later than now); no
    /// effect in wall mode, where time moves by itself.
    pub fn advance_to(&mut self, t: f64) {
        if self.is_virtual() && t > self.virtual_now {
            self.virtual_now = t;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_time_is_cpu_time_not_sleep() {
        let mut c = RankClock::new(Clock::virtual_free(), Instant::now());
        let w = c.start();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let (s, e) = c.stop(w);
        assert!(e - s < 0.005, "sleeping used {}s of virtual time", e - s);
        let w = c.start();
        spin_cpu(0.01);
        let (s, e) = c.stop(w);
        assert!(
            (e - s - 0.01).abs() < 0.002,
            "spinning 10ms measured {}s",
            e - s
        );
    }

    #[test]
    fn arrival_follows_the_virtual_rule() {
        let mut c = RankClock::new(Clock::Virtual { link_latency: 0.5 }, Instant::now());
        c.advance_to(2.0);
        assert_eq!(c.arrival(0, 1, 1.0), 1.5);
        assert_eq!(c.arrival(1, 1, 1.0), 1.0);
        c.advance_to(1.5); // never backwards
        assert_eq!(c.now(), 2.0);
    }
}
