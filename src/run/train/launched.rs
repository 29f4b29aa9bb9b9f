//! One rank of a launched job (`pipefill launch`, mpirun, srun, torchrun): joins the others,
//! trains this rank's stages ([`crate::pipeline::mesh::train_rank`]; each rank writes its
//! shard of the sharded checkpoints), and on rank 0 writes the run directory: `job.toml`,
//! the whole model's checkpoint, `metrics.jsonl` and the merged profile's report, trace and
//! timeline. A resumed run reads its checkpoint through [`ResumePoint::find`]; from a
//! sharded one each rank reads its own shard.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::engine::{Engine, Steps, drive, step_message};
use crate::comm::link::PeerLink;
use crate::comm::tcp::TcpMesh;
use crate::config::{Filler, JobConfig};
use crate::launch::{RankEnv, join, join_timeout, listen_ip, watchdog};
use crate::model::checkpoint::Checkpoint;
use crate::model::checkpoint::resume::{ResumePoint, verify_files};
use crate::pipeline::PipelineTrainer;
use crate::pipeline::mesh::auto::AutoChoice;
use crate::pipeline::mesh::profile::mean_cost;
use crate::pipeline::mesh::{RankResume, RankRun, check_world, train_rank};
use crate::profile::merge::MergedProfile;
use crate::profile::report::RunInfo;
use crate::run::RunError;
use crate::run::show::Show;
use crate::run::{Existing, Resume, RunDir, RunLog, StepLine, steps_left};
use crate::schedules::{Plan, simulate};
use crate::tensor::device::Device;

/// `job` as rank `env.rank` of `env.world`, from `resume` when given; the run directory
/// rank 0 chose.
pub(super) fn train(
    job: &JobConfig,
    env: &RankEnv,
    device: Device,
    resume: Option<&Path>,
    existing: Existing,
    show: &mut dyn Show,
) -> Result<PathBuf, RunError> {
    let rank = env.rank;
    // Each replica's pipeline runs its share of every step's micro-batches.
    let trainer = PipelineTrainer::from_job(job).map_err(|e| RunError::plan(job, e))?;
    // schedule = "auto": the trainer's plan is ZB-H1, which every rank runs until the ranks
    // have gathered their measured costs and switch to the same auto plan
    // (crate::pipeline::mesh::auto).
    let auto = job.schedule.is_auto();
    let plan = trainer.plan();
    check_world(plan.num_ranks(), job.dp, env.world).map_err(|mismatch| RunError::World {
        schedule: job.schedule.to_string(),
        mismatch: Box::new(mismatch),
    })?;
    let point = resume
        .map(|path| ResumePoint::find(path).map_err(|e| RunError::resume(path, e)))
        .transpose()?;
    let checkpoint = point
        .as_ref()
        .map(|point| {
            RankResume::load(point, job, plan, rank).map_err(|e| RunError::resume(point.dir(), e))
        })
        .transpose()?;
    let first_step = checkpoint.as_ref().map_or(0, RankResume::step);
    let left = steps_left(first_step, job.train.steps)?;
    // Rank 0 owns the run directory: it is claimed and made the run's once the job has been
    // checked against its checkpoint, before any rank joins (the others learn of a refusal
    // from the rendezvous). Its path goes to every rank with the job (agree_run_dir).
    let mut job = job.clone();
    let mut run_dir = None;
    if rank == 0 {
        // Every rank checks its own shard's hash, but rank 0 writes the run directory first:
        // every shard is checked here before that, so a bad one changes no file.
        if let Some(ResumePoint::Sharded(dir)) = &point {
            verify_files(dir).map_err(|e| RunError::resume(dir, e))?;
        }
        let dir = RunDir::claim(
            job.out_dir.as_deref(),
            "distributed-",
            resume.map_or(Resume::Fresh, Resume::From),
            existing,
        )?;
        let log = RunLog::open(&dir, &job, first_step)?;
        job.out_dir = Some(dir.path().to_path_buf());
        run_dir = Some((dir, log));
    }
    let job = &job;
    let mesh = Arc::new(join(env, listen_ip()?, join_timeout()?)?);
    if rank == 0 {
        show.line(&format!(
            "distributed: {} ranks ({:?} launcher), {} × schedule {} with {} stages, {} steps",
            env.world, env.launcher, job.dp, job.schedule, plan.stages, left
        ));
        if auto {
            show.line(
                "schedule auto: ZB-H1 until every rank has measured its stage, then the auto \
                 plan of the gathered costs",
            );
        }
        if job.filler != Filler::None && job.dp > 1 {
            show.line(
                "note: with dp > 1 only replica 0's pipeline fills its bubbles with the drafter",
            );
        }
    }
    watchdog(&mesh);
    if let Some((_, log)) = &mut run_dir {
        log.start_clock();
    }
    let mut engine = Launched {
        job,
        plan,
        mesh: &mesh,
        first_step,
        checkpoint: checkpoint.as_ref(),
        device,
        run_dir: None,
    };
    let (dir, log) = run_dir.unzip();
    drive(job, &mut engine, left, dir.as_ref().zip(log), show)?;
    mesh.close()?;
    Ok(engine.run_dir.unwrap_or_default())
}

/// This process's rank of a launched job as an [`Engine`]: its steps run in
/// [`train_rank`]; rank 0 then holds every step's losses, the whole model and the merged
/// profile.
struct Launched<'a> {
    job: &'a JobConfig,
    plan: &'a Plan,
    mesh: &'a Arc<TcpMesh>,
    first_step: u64,
    checkpoint: Option<&'a RankResume>,
    device: Device,
    /// The run directory the ranks agreed on (rank 0's), once they have.
    run_dir: Option<PathBuf>,
}

impl Engine for Launched<'_> {
    type Ran = RankRun;

    fn run(&mut self, steps: u64, out: &mut Steps<'_>) -> Result<RankRun, RunError> {
        let (job, first_step) = (self.job, self.first_step);
        let run = train_rank(
            job,
            self.plan,
            self.mesh,
            job.clock.runtime(),
            steps,
            self.checkpoint,
            self.device,
        )?;
        self.run_dir = Some(run.run_dir.clone());
        if let Some(choice) = &run.auto {
            show_auto_choice(self.mesh.rank(), first_step, choice, out.show());
        }
        // Rank 0 has every step's losses (the others none), and the merged profile's
        // timelines for their bubble ratios.
        let merged = run.merged.as_ref();
        for m in &run.metrics {
            let timeline = merged.and_then(|p| {
                let index = m.step.checked_sub(first_step)?;
                p.iterations.get(usize::try_from(index).ok()?)
            });
            out.step(&StepLine::new(m, timeline), &step_message(m, timeline))?;
        }
        Ok(run)
    }

    fn checkpoint(&mut self, run: &mut RankRun) -> Result<Option<Checkpoint>, RunError> {
        Ok(run.checkpoint.take())
    }

    fn after(
        &mut self,
        run: RankRun,
        dir: &Path,
        show: &mut dyn Show,
    ) -> Result<&'static str, RunError> {
        if let Some(last) = run.checkpoints.last() {
            show.line(&format!(
                "sharded checkpoints: {} (last {})",
                run.checkpoints.len(),
                last.display()
            ));
        }
        if let Some(merged) = &run.merged {
            // An auto-scheduled run is reported by the plan its last step ran.
            let plan = run.report.plan.as_deref().unwrap_or(self.plan);
            write_profile(dir, self.job, plan, merged, self.first_step)?;
        }
        Ok(
            "job.toml, metrics.jsonl, report.txt, report.json, trace.json, timeline.svg, \
            checkpoint/, checkpoints/",
        )
    }
}

/// What the ranks of an auto-scheduled run agreed on: every rank names the plan (a digest
/// of its text, equal on every rank) and what its stage measured; rank 0 the gathered costs.
fn show_auto_choice(rank: usize, first_step: u64, choice: &AutoChoice, show: &mut dyn Show) {
    let c = &choice.measured;
    show.line(&format!(
        "schedule auto: from step {} the auto plan {:016x} of the measured costs; stage {} measured F {:?} I {:?} W {:?}",
        first_step + choice.iteration + 1,
        choice.plan_hash(),
        choice.stage,
        c.f,
        c.i,
        c.w
    ));
    if rank == 0 {
        let stages: Vec<String> = choice
            .cost
            .stage
            .iter()
            .map(|c| format!("[{:?}, {:?}, {:?}]", c.f, c.i, c.w))
            .collect();
        show.line(&format!(
            "schedule auto: gathered costs (F, I, W by stage): [{}]",
            stages.join(", ")
        ));
    }
}

/// Rank 0's profile files from the merged profile: the bubble report of a steady step next
/// to the simulator's prediction under the mean measured costs, `trace.json` and
/// `timeline.svg`.
fn write_profile(
    dir: &Path,
    job: &JobConfig,
    plan: &Plan,
    merged: &MergedProfile,
    first_step: u64,
) -> Result<(), RunError> {
    // Means after the warm-up step, as a single-process run predicts with.
    let skip = usize::from(merged.iterations.len() > 1);
    let cost = mean_cost(plan, &merged.iterations, skip).ok_or(RunError::NoMergedCosts)?;
    let predicted = simulate(plan, &cost)?;
    let info = RunInfo {
        schedule: job.schedule.to_string(),
        clock: job.clock.name().into(),
        stages: plan.stages,
        microbatches: plan.microbatches,
        steps: first_step + merged.iterations.len() as u64,
        units: "s".into(),
        iteration: 0,
        iteration_note: String::new(),
        cost_basis: format!(
            "mean per-stage costs measured over steps {}–{} (merged from {} processes)",
            first_step + skip as u64,
            first_step + merged.iterations.len() as u64 - 1,
            merged.overall.ranks.len()
        ),
    };
    merged.write_files(
        dir,
        info,
        first_step,
        &predicted,
        plan.stages_per_rank() > 1,
    )?;
    Ok(())
}
