//! `pipefill rl` as one rank of a launched job ([`crate::rl::launched`]): joins the others,
//! runs its stages of every update (rank 0 also the rollouts), and on rank 0 writes the run
//! directory: `job.toml`, `metrics.jsonl` (one line per RL step) and the final policy's
//! `checkpoint/`.

use std::path::PathBuf;
use std::sync::Arc;

use super::drafter_line;
use super::line::{MetricsLine, step_line, summary_lines, write_line};
use crate::comm::select::TransportKind;
use crate::comm::tcp::TcpMesh;
use crate::config::{ConfigError, JobConfig};
use crate::launch::{RankEnv, join, join_timeout, listen_ip, watchdog};
use crate::model::checkpoint::Checkpoint;
use crate::rl::launched::{RankOptions, RlLaunchRun, rl_rank_on, starting_drafter};
use crate::rl::step_metrics::RlStepMetrics;
use crate::run::RunError;
use crate::run::dir::METRICS_FILE;
use crate::run::show::Show;
use crate::run::{Existing, Resume, RunDir};
use crate::tensor::device::{OnBackend, RankBackend, on_backend};

/// `job`'s RL as rank `env.rank` of `env.world` on the GPU of its local rank (`cuda`) or a
/// CPU thread, the policy from `init` when given; rank 0 returns the run directory.
pub(super) fn rl(
    job: &JobConfig,
    env: &RankEnv,
    cuda: bool,
    init: Option<Checkpoint>,
    existing: Existing,
    show: &mut dyn Show,
) -> Result<Option<PathBuf>, RunError> {
    let rank = env.rank;
    // The update's ranks open their transports for each step over the mesh (TCP): a job
    // that asks for NCCL is refused, not run over TCP behind its back.
    if job.transport == TransportKind::Nccl {
        return Err(ConfigError::Invalid {
            field: "transport".into(),
            reason: "is \"nccl\", but a launched `rl` runs its update over TCP: set \"tcp\" or \
                     \"auto\""
                .into(),
        }
        .into());
    }
    // Rank 0 writes the run directory; it is claimed before any rank joins, and made the
    // run's (job.toml, metrics.jsonl) at the first step, once every rank has checked the job.
    let run_dir = match rank {
        0 => Some(RunDir::claim(
            job.out_dir.as_deref(),
            "rl-distributed-",
            Resume::Unsupported,
            existing,
        )?),
        _ => None,
    };
    let mesh = Arc::new(join(env, listen_ip()?, join_timeout()?)?);
    if rank == 0 {
        show.line(&format!(
            "distributed rl: {} ranks ({:?} launcher), update schedule {} with {} stages, {} steps; rank 0 runs the rollouts ({})",
            env.world,
            env.launcher,
            job.schedule,
            job.stages,
            job.rl.steps,
            if job.rl.speculation {
                "speculative"
            } else {
                "plain sampling"
            }
        ));
        if init.is_none() {
            show.line(&super::warm_up_line(job));
        }
        if job.rl.speculation {
            let version = starting_drafter(job, init.as_ref()).map(|d| d.weights.version);
            show.line(&drafter_line(version));
        }
    }
    watchdog(&mesh);
    // Only rank 0 sees the steps: each is shown and logged as it completes.
    let mut metrics = None;
    let mut written = Ok(());
    let on_step = |m: &RlStepMetrics| {
        show.line(&step_line(m, job.rl.steps, None));
        let (Some(dir), Ok(())) = (&run_dir, &written) else {
            return;
        };
        let path = &dir.path().join(METRICS_FILE);
        let line = MetricsLine {
            step: m,
            spec_threshold: None,
            calibration: None,
        };
        written = match &mut metrics {
            Some(file) => write_line(file, path, &line),
            None => dir
                .create(&job.to_toml(), 0)
                .and_then(|file| write_line(metrics.insert(file), path, &line)),
        };
    };
    let ranked = Ranked {
        job,
        mesh: &mesh,
        init: init.as_ref(),
        local_rank: env.local_rank,
        on_step,
    };
    let run = on_backend(cuda, ranked)??;
    written?;
    let (Some(mut run), Some(run_dir)) = (run, run_dir) else {
        return Ok(None);
    };
    let out_dir = run_dir.path().to_path_buf();
    run_dir.save_final(&mut run.checkpoint, job)?;
    let ran = format!(
        "over {} processes; run directory {} (job.toml, metrics.jsonl, checkpoint/)",
        env.world,
        out_dir.display()
    );
    for line in summary_lines(&run.steps, &ran) {
        show.line(&line);
    }
    Ok(Some(out_dir))
}

/// A launched rl rank's run on the backend of its device ([`on_backend`]): its local
/// rank's GPU with `device = "cuda"`, else a CPU thread.
struct Ranked<'a, F> {
    job: &'a JobConfig,
    mesh: &'a Arc<TcpMesh>,
    init: Option<&'a Checkpoint>,
    local_rank: usize,
    on_step: F,
}

impl<F: FnMut(&RlStepMetrics)> OnBackend for Ranked<'_, F> {
    type Output = Result<Option<RlLaunchRun>, RunError>;
    fn run<B: RankBackend>(self) -> Self::Output {
        let backend = B::for_rank(self.local_rank, self.job.train.precision)?;
        let job = self.job;
        Ok(rl_rank_on(
            backend,
            job,
            self.mesh,
            job.clock.runtime(),
            self.init,
            RankOptions::default(),
            self.on_step,
        )?)
    }
}
