//! pipefill-actors: *who runs it*.
//!
//! A generic actor runtime (kameo on tokio) that executes [`pipefill_schedules::Plan`]s over
//! a [`StageCompute`] trait. It never depends on a concrete model: `src/` implements
//! [`StageCompute`] for a real model shard, tests implement it with a fake.
//!
//! - [`compute`]: the [`StageCompute`] trait (F, I, W, B, optimizer step of one rank).
//! - [`transport`]: the [`Transport`] trait between stage actors and [`InProcess`].
//! - [`clock`]: wall and virtual clocks (thread CPU time, one virtual clock per rank).
//! - [`filler`]: the [`BubbleFiller`] seam called when a stage waits in a bubble.
//! - [`stage`]: [`StageActor`], one per rank, on its own OS thread.
//! - [`record`]: per-action records and per-iteration stage reports.

pub mod clock;
pub mod compute;
pub mod error;
pub mod filler;
pub mod profiler;
pub mod record;
pub mod runtime;
pub mod schedule;
pub mod stage;
pub mod transport;

pub use clock::{Clock, spin_cpu, thread_cpu_time};
pub use compute::StageCompute;
pub use error::{LinkError, Result, RuntimeError};
pub use filler::{Bubble, BubbleFiller, BubbleSpan, FillerSpan, FillerWork, NoFiller};
pub use profiler::{Collect, IterationProfile, Profile, Profiler};
pub use record::{ActionRecord, StageReport};
pub use runtime::{Pipeline, RunReport, run_iterations};
pub use schedule::{CostSamples, PlanSource, Replanner, ScheduleActor, predict};
pub use stage::{Measured, RunIteration, StageActor, StageEvent, StageWiring};
pub use transport::{Envelope, Flow, InProcess, Tag, Transport};
