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
//! - [`step`]: gradient statistics, clip/skip decisions and optimizer post-validation.
//! - [`stage`]: [`StageActor`], one per rank, on its own OS thread.
//! - [`record`]: per-action records and per-iteration stage reports.
//! - [`schedule`]: [`ScheduleActor`], which builds, checks and dispatches each iteration's
//!   plan and turns measured costs into a [`pipefill_schedules::CostModel`].
//! - [`profiler`]: [`Profiler`], which builds measured [`pipefill_schedules::Timeline`]s.
//! - [`router`]: [`FillerRouter`], the queue of filler work (drafter training, rollout
//!   verification) routed into bubbles it fits, and [`WeightBoard`] for versioned weights.
//! - [`runtime`]: [`Pipeline`] and [`run_iterations`], the entry points.
//!
//! ```no_run
//! # async fn demo<C: pipefill_actors::StageCompute>(computes: Vec<C>) -> pipefill_actors::Result<()> {
//! use pipefill_actors::{Clock, Pipeline, PlanSource};
//! use pipefill_schedules::ScheduleKind;
//!
//! let source = PlanSource::Builtin { kind: ScheduleKind::ZbH1, ranks: 4, microbatches: 8, chunks: 1 };
//! let report = Pipeline::new(source, Clock::virtual_free()).iterations(2).run(computes).await?;
//! println!("{}", report.iterations[0].timeline.bubble_ratio);
//! # Ok(())
//! # }
//! ```

pub mod clock;
pub mod compute;
pub mod error;
pub mod filler;
pub mod profiler;
pub mod record;
pub mod router;
pub mod runtime;
pub mod schedule;
pub mod stage;
pub mod step;
pub mod transport;

pub use clock::{Clock, declare_cost, spin_cpu, thread_cpu_time};
pub use compute::StageCompute;
pub use error::{LinkError, Result, RuntimeError};
pub use filler::{Bubble, BubbleFiller, BubbleSpan, FillerSpan, FillerWork, NoFiller};
pub use profiler::{Collect, IterationProfile, PlanMemory, Profile, Profiler};
pub use record::{ActionRecord, StageReport, StepRecord, StepWork};
pub use router::{
    FillerRouter, FillerSource, Request, RoutedFiller, RouterConfig, RouterStats, Slice, Versioned,
    WeightBoard,
};
pub use runtime::{Pipeline, RunReport, run_iterations};
pub use schedule::{CostSamples, PlanSource, Replanner, ScheduleActor, predict};
pub use stage::{Measured, RunIteration, StageActor, StageEvent, StageWiring};
pub use step::{GradStats, RankStep, StepDecision, StepMode, StepPolicy, StepReport, decide};
pub use transport::{Envelope, Flow, InProcess, Tag, Transport};
