//! Clocks: how a stage measures the time of its actions.
//!
//! - [`Clock::Wall`]: real time since the job's start. The truth on real devices.
//! - [`Clock::Virtual`]: each rank keeps its own clock, advanced by the thread CPU time each
//!   action used, as if every rank had a device of its own. A payload sent at the sender's
//!   time `t` is available to the receiver at `t + link_latency`, so a receive completes at
//!   `max(receiver clock, sender clock + link latency)`. On a small shared CPU machine this
//!   gives the timeline the job would have with one device per rank, independent of how the
//!   OS interleaves the stage threads.
//! - [`Clock::Declared`]: the virtual clock's rules, but an action lasts exactly what its
//!   work declared with [`declare_cost`] on the stage's thread, whatever the host did
//!   meanwhile. It runs the real runtime against a chosen cost profile (a what-if replay of
//!   costs measured elsewhere, or a test whose timeline must equal the simulator's to the
//!   bit): the thread CPU clock of a shared VM now and then reads milliseconds late.

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
    /// Per-rank virtual time advanced by the costs work declares ([`declare_cost`]), with
    /// the virtual clock's link rule.
    Declared { link_latency: f64 },
}

impl Clock {
    /// A virtual clock with free links.
    pub const fn virtual_free() -> Clock {
        Clock::Virtual { link_latency: 0.0 }
    }

    /// A declared-cost clock with free links.
    pub const fn declared_free() -> Clock {
        Clock::Declared { link_latency: 0.0 }
    }

    /// Whether each rank keeps its own clock (virtual or declared), so predicted idle time
    /// is exact and a receive completes at the virtual-clock rule's time.
    pub const fn is_virtual(&self) -> bool {
        matches!(self, Clock::Virtual { .. } | Clock::Declared { .. })
    }

    /// Seconds added to every payload that crosses ranks (0 on the wall clock, where the
    /// links take what they take).
    pub const fn link_latency(&self) -> f64 {
        match *self {
            Clock::Virtual { link_latency } | Clock::Declared { link_latency } => link_latency,
            Clock::Wall => 0.0,
        }
    }
}

thread_local! {
    /// Seconds of cost declared so far on this thread ([`Clock::Declared`]).
    static DECLARED: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
}

/// Declares that the work running on this thread costs `seconds`: under
/// [`Clock::Declared`] the action (or filler slice) in progress lasts the sum of what it
/// declared. Other clocks ignore it, so work can both spin and declare.
pub fn declare_cost(seconds: f64) {
    DECLARED.with(|d| d.set(d.get() + seconds.max(0.0)));
}

fn declared_time() -> f64 {
    DECLARED.with(|d| d.get())
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
    /// The meter's reading at the start: thread CPU time (virtual) or the declared costs
    /// (declared); unused on the wall clock.
    meter: f64,
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
        self.mode.is_virtual()
    }

    /// The rank's current time.
    pub fn now(&self) -> f64 {
        match self.mode {
            Clock::Wall => self.epoch.elapsed().as_secs_f64(),
            Clock::Virtual { .. } | Clock::Declared { .. } => self.virtual_now,
        }
    }

    /// Starts timing a piece of work run on this thread.
    pub fn start(&self) -> Stopwatch {
        Stopwatch {
            start: self.now(),
            meter: match self.mode {
                Clock::Wall => 0.0,
                Clock::Virtual { .. } => thread_cpu_time(),
                Clock::Declared { .. } => declared_time(),
            },
        }
    }

    /// Ends the measurement: returns `(start, end)` and, in virtual mode, advances the clock
    /// by the CPU time used (declared mode: the cost declared) since [`RankClock::start`].
    pub fn stop(&mut self, watch: Stopwatch) -> (f64, f64) {
        let used = match self.mode {
            Clock::Wall => return (watch.start, self.now()),
            Clock::Virtual { .. } => thread_cpu_time() - watch.meter,
            Clock::Declared { .. } => declared_time() - watch.meter,
        };
        self.virtual_now = watch.start + used.max(0.0);
        (watch.start, self.virtual_now)
    }

    /// When a payload sent at `sent_at` by rank `from` is available to rank `to`: the
    /// virtual-clock rule; in wall mode, the moment it was taken (now).
    pub fn arrival(&self, from: usize, to: usize, sent_at: f64) -> f64 {
        if !self.is_virtual() {
            return self.now();
        }
        let latency = if from == to {
            0.0
        } else {
            self.mode.link_latency()
        };
        sent_at + latency
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
    fn declared_time_is_what_the_work_declared() {
        let mut c = RankClock::new(Clock::declared_free(), Instant::now());
        let w = c.start();
        spin_cpu(0.005);
        let (s, e) = c.stop(w);
        assert_eq!(e - s, 0.0, "undeclared spinning took declared time");
        let w = c.start();
        declare_cost(0.25);
        declare_cost(0.5);
        let (s, e) = c.stop(w);
        assert_eq!((s, e), (0.0, 0.75));
        let mut c = RankClock::new(Clock::Declared { link_latency: 0.5 }, Instant::now());
        assert_eq!(c.arrival(0, 1, 1.0), 1.5);
        c.advance_to(3.0);
        assert_eq!(c.now(), 3.0);
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
