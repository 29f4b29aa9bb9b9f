//! Pipelined training: the real model run through the actor runtime (`pipefill-actors`).
//!
//! The runtime is model-free; this module gives it the model. [`RankCompute`] implements
//! the runtime's `StageCompute` for one rank (its model chunks, backend, AdamW and data
//! access), and [`PipelineTrainer`] runs a whole job: it builds one `RankCompute` per rank
//! of a [`Plan`], runs K optimizer steps (one runtime iteration each) and gathers what was
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
//! - [`PipelineTrainer`]: `from_job`, `builtin`, `new` (any [`Plan`], e.g. from
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
pub mod executor;
pub mod feed;
pub mod fill;
mod join;
pub mod mesh;
pub mod shared;
pub mod trainer;

pub use compute::RankCompute;
pub(crate) use compute::RankJob;
pub use join::{DrafterRun, DrafterStep, StepView};
pub use pipefill_actors::{Clock, RunReport, StepMode};
pub use trainer::{KeptRanks, KeptRun, PipelineRun, PipelineTrainer};

use crate::schedules::Plan;
pub use crate::train::StepMetrics;

/// What can go wrong setting up or running a pipelined job.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The job and the plan do not fit together; names the field or figure.
    #[error("pipeline setup: `{field}` {reason}")]
    Config { field: &'static str, reason: String },
    /// A plan action names a stage this rank does not hold.
    #[error("rank {rank} holds no stage {stage}")]
    NotHere { rank: usize, stage: u32 },
    /// A plan action names a micro-batch the step does not have.
    #[error("micro-batch {microbatch} does not exist: the step has {have}")]
    NoMicroBatch { microbatch: u32, have: usize },
    /// A stage produced something the pipeline cannot use.
    #[error("stage {stage}: {reason}")]
    Stage { stage: u32, reason: String },
    /// The sharded optimizer's exchange between replicas failed, or its state does not fit.
    #[error("sharded optimizer (optimizer.shard) of rank {rank}: {reason}")]
    Shard { rank: usize, reason: String },
    /// The runtime ran a rank's optimizer steps out of order.
    #[error("rank {rank}: optimizer step of iteration {got}, expected iteration {expected}")]
    OutOfOrder {
        rank: usize,
        expected: u64,
        got: u64,
    },
    /// The run was stopped (a periodic checkpoint could not be written, or the caller
    /// asked): the rank ended at the end of its step.
    #[error(
        "rank {rank} stopped: the run was stopped (a checkpoint or metrics write failed, or \
         the caller asked)"
    )]
    Stopped { rank: usize },
    /// A rank never handed over its final parameters.
    #[error("the run ended without every rank's final parameters")]
    NoFinalState,
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Train(#[from] crate::train::TrainError),
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    #[error(transparent)]
    Checkpoint(#[from] crate::model::checkpoint::CheckpointError),
    #[error(transparent)]
    Schedule(#[from] crate::schedules::ScheduleError),
    #[error(transparent)]
    Runtime(#[from] pipefill_actors::RuntimeError),
    #[error(transparent)]
    Drafter(#[from] crate::model::drafter::DrafterError),
    /// A job setting that cannot be used here (e.g. `device = "cuda"` without a GPU).
    #[error(transparent)]
    Job(#[from] crate::config::ConfigError),
}

/// Stages per rank of `plan`, or why the plan cannot drive the model.
fn check_plan(plan: &Plan, layers: usize, microbatches: usize) -> Result<(), PipelineError> {
    let bad = |field, reason| Err(PipelineError::Config { field, reason });
    if plan.num_ranks() == 0 || plan.stages == 0 {
        return bad("plan", "has no ranks or no stages".into());
    }
    if plan.stages > layers {
        return bad(
            "model.layers",
            format!(
                "is {layers}, fewer than the plan's {} stages (each stage needs a block)",
                plan.stages
            ),
        );
    }
    if plan.microbatches != microbatches {
        return bad(
            "train.micro_batches",
            format!(
                "is {microbatches}, but the plan runs {} micro-batches per step",
                plan.microbatches
            ),
        );
    }
    if plan.stage_rank.len() != plan.stages {
        return bad(
            "plan",
            format!(
                "places {} stages but has {}",
                plan.stage_rank.len(),
                plan.stages
            ),
        );
    }
    if let Some(r) = (0..plan.num_ranks()).find(|&r| plan.stages_of(r).is_empty()) {
        return bad("plan", format!("rank {r} holds no stage"));
    }
    Ok(())
}
