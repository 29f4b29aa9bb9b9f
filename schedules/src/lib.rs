//! pipefill-schedules: *what runs when*.
//!
//! Pure Rust, no tensors, no I/O (a schedule file is read by its user and parsed here).
//! The types here are the project's spine: the runtime executes [`Plan`]s, and the profiler
//! builds the same [`Timeline`] the simulator predicts, so measured and predicted figures
//! share one set of definitions.
//!
//! - [`action`]: the action IR and its text form (PyTorch pipelining's grammar).
//! - [`plan`]: per-rank action lists and the stage → rank placement.
//! - [`timeline`]: cost model, spans, bubble slots and the metric definitions.
//! - [`generators`]: the built-in schedules (GPipe, 1F1B, interleaved, looped BFS, ZB-H1/H2/V,
//!   DualPipeV).
//! - [`simulate`](mod@simulate): the discrete-event simulator that times a plan under a cost model.
//! - [`auto`](mod@auto): the auto-scheduler, the plan with the least bubble under a memory limit.
//! - [`recompute`]: activation recomputation's cost and saving in the cost model, and the
//!   auto-scheduler that turns it on when a memory limit needs it.

pub mod action;
pub mod auto;
pub mod error;
pub mod file;
pub mod generators;
pub mod lower;
pub mod memory;
pub mod plan;
pub mod recompute;
pub mod simulate;
pub mod timeline;
pub mod validate;

pub use action::{Action, ActionKind, ParseActionError, StageMb};
pub use auto::{AutoPlan, AutoReplanner, Origin, auto, auto_plan};
pub use error::{Result, ScheduleError};
pub use file::{parse_csv, parse_plan, parse_toml, to_csv, to_toml};
pub use generators::{ScheduleKind, build, generate};
pub use lower::lower;
pub use memory::{joint_peak_memory, peak_memory, rank_peak_memory};
pub use plan::{Placement, Plan};
pub use recompute::{Recomputation, RecomputedPlan, auto_recomputing};
pub use simulate::{simulate, simulate_measured};
pub use timeline::{BubbleSlot, CostModel, RankStats, Span, StageCost, Timeline};
pub use validate::{ValidateOptions, Validation, validate};
