//! Pipelined training: the real model run through the actor runtime (`pipefill-actors`).
//!
//! The runtime is model-free; this module gives it the model. [`RankCompute`] implements
//! the runtime's `StageCompute` for one rank (its model chunks, backend, AdamW and data
//! access), and [`PipelineTrainer`] runs a whole job: it builds one `RankCompute` per rank
//! of a [`Plan`](crate::schedules::Plan), runs K optimizer steps (one runtime iteration each) and gathers what was
//! learned and measured into a [`PipelineRun`].
//!
//! Pipelined training reproduces the single-device reference trainer
//! ([`crate::train::Trainer`]): same micro-batches, same loss scales, same clipping and
//! AdamW. `tests/pipeline_oracle.rs` checks it for every built-in schedule: without
//! clipping the parameters after K steps are bitwise the reference's; with clipping they
//! differ by ~1e-7, because the runtime's clip factor (`pipefill_actors::decide`) is
//! `max / (norm + 1e-6)` where the reference's is `max / norm`.
//!
//! # API
//!
//! ```no_run
//! use pipefill::config::JobConfig;
//! use pipefill::pipeline::{PipelineTrainer, PipelineRun};
//! use pipefill::schedules::ScheduleKind;
//!
//! # fn main() -> Result<(), pipefill::pipeline::PipelineError> {
//! let job = JobConfig { stages: 4, schedule: "zb-h1".parse().unwrap(), ..JobConfig::default() };
//! // From the job's `schedule` (a built-in name or a .csv/.toml file) and `stages`:
//! let trainer = PipelineTrainer::from_job(&job)?;
//! // or explicitly: PipelineTrainer::builtin(&job, ScheduleKind::ZbH1, None)?
//! //            or: PipelineTrainer::new(&job, plan)?
//! let run: PipelineRun = trainer.run(10, |m| println!("step {} loss {:.4}", m.step, m.loss))?;
//! println!("{}", run.side_by_side());
//! let embed = run.param_values("embed.tokens")?;
//! let checkpoint = run.checkpoint()?; // save with Checkpoint::save
//! # Ok(()) }
//! ```
//!
//! - [`PipelineTrainer`]: `from_job`, `builtin`, `new` (any [`Plan`](crate::schedules::Plan), e.g. from
//!   [`crate::schedules::read_plan`]), then `clock(...)` (virtual by default, from
//!   `job.clock`), `step_mode(...)` and `speculative_steps(...)` (optimizer
//!   post-validation), `resume(&checkpoint)`, and `run(steps, on_step)`. `on_step` is called on
//!   the caller's thread once per completed optimizer step with that step's
//!   [`StepMetrics`] (the same type the reference trainer writes to `metrics.jsonl`).
//! - [`PipelineRun`]: `steps` (per-step metrics), `report` (the runtime's
//!   [`RunReport`]: per-iteration measured timelines and action records, the overall
//!   timeline), `measured_cost` (per-stage T_F/T_I/T_W medians, seconds), `predicted`
//!   (the simulator's timeline of the plan under the measured costs), the final parameters
//!   by name (`param_names`, `param_values`), `model()` and `checkpoint()`.
//!
//! Files: [`trainer`] (the trainer and the run), [`compute`] (the per-rank compute),
//! [`feed`] (each step's data), [`shared`] (global gradient norm, step log, final state).

pub mod compute;
mod error;
pub mod executor;
pub mod feed;
pub mod fill;
mod join;
pub mod mesh;
pub mod shared;
pub mod trainer;

pub use compute::RankCompute;
pub(crate) use compute::RankJob;
pub use error::PipelineError;
pub use join::{DrafterRun, DrafterStep, StepView};
pub use pipefill_actors::{Clock, RunReport, StepMode};
pub use trainer::PipelineTrainer;
pub use trainer::kept::{KeptRanks, KeptRun};
pub use trainer::outcome::PipelineRun;

pub use crate::train::StepMetrics;
