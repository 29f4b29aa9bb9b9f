//! Running a job. [`train`](fn@train) and [`rl`](fn@rl) are the runners every way of running a job
//! goes through (the reference trainer, the in-process pipeline, a launched rank, `pipefill rl`);
//! the CLI only parses arguments and draws what the runner [`show`]s. What they share: the run
//! directory ([`dir`]), which decides whether a run may write where it was told to; the line of
//! `metrics.jsonl` ([`metrics`]); the training log that writes those lines and sums the run up
//! ([`log`]); the process's measured peak memory it ends with ([`peak`]); and why a run stopped
//! ([`error`]).
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use pipefill::{config::JobConfig, launch::RankEnv, run};
//!
//! let job = JobConfig::embedded(&["train.steps=10".to_string(), "schedule=\"1f1b\"".to_string()])?;
//! let env = RankEnv::detect()?; // alone, or one rank of pipefill launch, mpirun, srun, torchrun
//! let start = run::Start { env: &env, existing: run::Existing::overwrite(false), max_memory: None };
//! let run_dir = run::train(&job, None, &start, &mut run::Quiet)?;
//! # let _ = run_dir;
//! # Ok(())
//! # }
//! ```

pub mod dir;
pub mod error;
pub mod log;
pub mod metrics;
pub mod peak;
pub mod rl;
pub mod show;
#[cfg(test)]
pub(crate) mod show_tests;
pub mod train;

pub use dir::{Existing, Resume, RunDir};
pub use error::RunError;
pub use log::{RunLog, RunSummary, steps_left};
pub use metrics::StepLine;
pub use rl::rl;
pub use show::{Bar, Quiet, Show, Tick};
pub use train::train;

use crate::config::JobConfig;
use crate::config::memory::{Bytes, MemoryLimit, Workload};

/// How a run was asked to start, whatever it runs ([`train`](fn@train), [`rl`](fn@rl)).
#[derive(Debug, Clone, Copy)]
pub struct Start<'a> {
    /// Where this process stands: alone, or one rank of a launched job.
    pub env: &'a crate::launch::RankEnv,
    /// What to do with a run already in the output directory.
    pub existing: Existing,
    /// The most memory the run may use (`8GiB`, ...; a launched rank: its share); `None`:
    /// the memory available.
    pub max_memory: Option<&'a str>,
}

/// Before anything is allocated: the job's sizes against `max_memory` (or the memory there
/// is), a launched rank's share of them on each rank; `dp` replicas must share the step's
/// micro-batches equally. A single process shows its estimate, and refuses `dp > 1` where
/// it runs one model (the reference trainer) or keeps one update pipeline (`rl`). Both
/// runners call it before any work.
fn check_memory(
    job: &JobConfig,
    start: &Start,
    workload: Workload,
    show: &mut dyn Show,
) -> Result<(), RunError> {
    let env = start.env;
    let limit = MemoryLimit::resolve(start.max_memory)?;
    let processes = if env.is_distributed() { env.world } else { 1 };
    let estimate = job.check_memory(workload, &limit, processes)?;
    if !job.train.micro_batches.is_multiple_of(job.dp) {
        return Err(RunError::DpShare {
            dp: job.dp,
            micro_batches: job.train.micro_batches,
        });
    }
    if !env.is_distributed() {
        if job.dp > 1 && (workload == Workload::Rl || job.schedule.is_none()) {
            return Err(RunError::DpInOneProcess {
                dp: job.dp,
                processes: job.dp.saturating_mul(job.stages),
                command: match workload {
                    Workload::Train => "train",
                    Workload::Rl => "rl",
                },
                runs: match workload {
                    Workload::Train => "with schedule = \"none\" trains one model",
                    Workload::Rl => "keeps one pipeline of update ranks",
                },
            });
        }
        let parts: Vec<String> = (estimate.parts.iter())
            .map(|p| format!("{} {}", p.what, Bytes(p.bytes)))
            .collect();
        show.line(&format!(
            "memory: {} estimated ({}), {limit}",
            Bytes(estimate.total),
            parts.join(", ")
        ));
    }
    Ok(())
}
