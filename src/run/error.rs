//! [`RunError`]: why a run (`pipefill train` or `pipefill rl`, on any path) stopped. The
//! error of the layer that failed is kept as the source, so the CLI's one line reads
//! "what the run was doing: why".

use std::path::{Path, PathBuf};

use crate::comm::CommError;
use crate::config::{ConfigError, JobConfig};
use crate::data::DataError;
use crate::launch::LaunchError;
use crate::model::ModelError;
use crate::pipeline::PipelineError;
use crate::profile::ProfileError;
use crate::rl::RlError;
use crate::schedules::ScheduleError;
use crate::tensor::TensorError;
use crate::train::TrainError;

/// An error of another layer, boxed where the runner adds what it was doing.
type Source = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Tensor(#[from] TensorError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(transparent)]
    Pipeline(Box<PipelineError>),
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error(transparent)]
    Rl(#[from] RlError),
    /// Joining the other ranks of a launched job.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// Closing the mesh after the run.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The job's schedule does not make a plan for its ranks.
    #[error("schedule {schedule} on {ranks} ranks")]
    Plan {
        schedule: String,
        ranks: usize,
        #[source]
        source: Box<PipelineError>,
    },
    /// The same job without filler, run to measure step inflation.
    #[error("the run without filler (for step inflation)")]
    Baseline {
        #[source]
        source: Box<PipelineError>,
    },
    #[error("cannot resume from {}", path.display())]
    Resume {
        path: PathBuf,
        #[source]
        source: Source,
    },
    /// `pipefill rl --init DIR`: `what` says which part of the run is wrong.
    #[error("--init {}{what}", dir.display())]
    Init {
        dir: PathBuf,
        what: &'static str,
        #[source]
        source: Source,
    },
    #[error("rl step {step}")]
    RlStep {
        step: u64,
        #[source]
        source: Box<RlError>,
    },
    #[error("cannot write {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// What a single process cannot replicate (the reference trainer, the RL update).
    #[error(
        "dp = {dp}: a single-process `pipefill {command}` {runs}; launch dp × stages = \
         {processes} processes (`pipefill launch -n {processes} -- {command} ...`), or set dp = 1"
    )]
    DpInOneProcess {
        dp: usize,
        processes: usize,
        command: &'static str,
        runs: &'static str,
    },
    #[error("dp = {dp} replicas cannot take equal shares of train.micro_batches = {micro_batches}")]
    DpShare { dp: usize, micro_batches: usize },
    #[error("the job's schedule \"{schedule}\": {mismatch}")]
    World {
        schedule: String,
        mismatch: Box<PipelineError>,
    },
    #[error(
        "{}: a sharded checkpoint of a pipelined run; schedule \"none\" resumes from a \
         whole-model one (a run's checkpoint/)",
        dir.display()
    )]
    ShardedForReference { dir: PathBuf },
    #[error("the runtime measured no step: no timeline to report")]
    NoStepMeasured,
    #[error(
        "the runtime did not measure every stage's costs, so the simulator has nothing to \
         predict with"
    )]
    NoCosts,
    #[error("some stage measured no forward in the merged profile: nothing to predict with")]
    NoMergedCosts,
    #[error("schedule \"none\": the RL update runs as a pipelined step; name a schedule")]
    RlWithoutSchedule,

    // ---- the run directory and its metrics log (`dir`, `log`)
    #[error(
        "out_dir is empty: name the run directory, or leave out_dir unset for a fresh one under runs/"
    )]
    EmptyOutDir,
    #[error(
        "run directory {path} already holds {what}: pass --overwrite to replace the run{}, or \
         choose another --out-dir",
        match resumable {
            true => format!(", --resume {} to continue it", path.display()),
            false => String::new(),
        }
    )]
    NotEmpty {
        path: PathBuf,
        what: String,
        /// The command can continue a run (`--resume`).
        resumable: bool,
    },
    #[error("run directory {path}: {source}")]
    RunDirIo {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A metrics line could not be written: the run stops there.
    #[error(
        "cannot write {path}: {cause}; the run stopped: {}",
        crate::model::checkpoint::last_complete_note(last.as_deref())
    )]
    Metrics {
        path: PathBuf,
        /// The checkpoint a resume of the run would continue from.
        last: Option<PathBuf>,
        /// Named in the message, not a `source`: the whole reason is one line.
        cause: std::io::Error,
    },
    #[error("{path}: line {line} is not a metrics line with a \"step\": {reason}")]
    BadMetrics {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("the checkpoint is at step {first_step}: nothing to do for train.steps = {steps}")]
    NothingToDo { first_step: u64, steps: u64 },
}

impl From<PipelineError> for RunError {
    fn from(e: PipelineError) -> Self {
        RunError::Pipeline(Box::new(e))
    }
}

impl RunError {
    /// `job`'s schedule could not be planned.
    pub(crate) fn plan(job: &JobConfig, source: PipelineError) -> Self {
        RunError::Plan {
            schedule: job.schedule.to_string(),
            ranks: job.stages,
            source: Box::new(source),
        }
    }

    /// Nothing can be resumed from `path`.
    pub(crate) fn resume(path: &Path, source: impl Into<Source>) -> Self {
        RunError::Resume {
            path: path.to_path_buf(),
            source: source.into(),
        }
    }

    /// `path` could not be written.
    pub(crate) fn write(path: &Path, source: std::io::Error) -> Self {
        RunError::Write {
            path: path.to_path_buf(),
            source,
        }
    }
}
