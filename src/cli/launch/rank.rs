//! What `pipefill train` and `pipefill rl` do when they find themselves one rank of a
//! multi-process job (started by `pipefill launch`, mpirun, srun or torchrun):
//! [`train_distributed`] and [`rl_distributed`]. Rank 0 owns the run directory.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};

use pipefill::config::JobConfig;
use pipefill::launch::auto::AutoChoice;
use pipefill::launch::profile::mean_cost;
use pipefill::launch::rl::{RankOptions, RlLaunchRun, RlLaunchStep, rl_rank_on};
use pipefill::launch::train::{RankResume, train_rank};
use pipefill::launch::{RankEnv, join, join_timeout, listen_ip};
use pipefill::model::checkpoint::resume::{ResumePoint, verify_files};
use pipefill::pipeline::PipelineTrainer;
use pipefill::profile::merge::MergedProfile;
use pipefill::profile::report::RunInfo;
use pipefill::run::{Existing, Resume, RunDir, RunLog, StepLine, steps_left};
use pipefill::schedules::{Plan, simulate};
use pipefill::tensor::device::{OnBackend, RankBackend, on_backend};

/// `pipefill train` as one rank of a multi-process job: joins the others, trains this
/// rank's stages (each rank writing its shard of the sharded checkpoints), and on rank 0
/// writes the run directory: `job.toml`, the whole model's checkpoint, `metrics.jsonl` and
/// the merged profile's report, trace and timeline. `--resume` takes a run directory or a
/// checkpoint directory ([`ResumePoint::find`]); from a sharded one each rank reads its own
/// shard.
pub fn train_distributed(
    job: &JobConfig,
    env: &RankEnv,
    resume: Option<&Path>,
    existing: Existing,
) -> anyhow::Result<()> {
    let rank = env.rank;
    // Each replica's pipeline runs its share of every step's micro-batches.
    if !job.train.micro_batches.is_multiple_of(job.dp) {
        bail!(
            "dp = {} replicas cannot take equal shares of train.micro_batches = {}",
            job.dp,
            job.train.micro_batches
        );
    }
    let mut share = job.clone();
    share.train.micro_batches /= job.dp;
    let trainer = PipelineTrainer::from_job(&share)
        .with_context(|| format!("schedule {} on {} ranks", job.schedule, job.stages))?;
    // schedule = "auto": the trainer's plan is ZB-H1, which every rank runs until the ranks
    // have gathered their measured costs and switch to the same auto plan
    // (pipefill::launch::auto).
    let auto = job.schedule.is_auto();
    let plan = trainer.plan();
    if plan.num_ranks() * job.dp != env.world {
        bail!(
            "the job's schedule \"{}\" has {} ranks × dp = {} but {} processes were launched: one rank per process (set stages × dp = {})",
            job.schedule,
            plan.num_ranks(),
            job.dp,
            env.world,
            env.world
        );
    }
    let point = resume
        .map(|path| {
            ResumePoint::find(path)
                .with_context(|| format!("cannot resume from {}", path.display()))
        })
        .transpose()?;
    let checkpoint = point
        .as_ref()
        .map(|point| {
            RankResume::load(point, job, plan, rank)
                .with_context(|| format!("cannot resume from {}", point.dir().display()))
        })
        .transpose()?;
    let first_step = checkpoint.as_ref().map_or(0, RankResume::step);
    steps_left(first_step, job.train.steps)?;
    // Rank 0 owns the run directory: it is claimed and made the run's once the job has been
    // checked against its checkpoint, before any rank joins (the others learn of a refusal
    // from the rendezvous). Its path goes to every rank with the job (agree_run_dir).
    let mut job = job.clone();
    let mut run_dir = None;
    if rank == 0 {
        // Every rank checks its own shard's hash, but rank 0 writes the run directory first:
        // every shard is checked here before that, so a bad one changes no file.
        if let Some(ResumePoint::Sharded(dir)) = &point {
            verify_files(dir).with_context(|| format!("cannot resume from {}", dir.display()))?;
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
    let mesh = std::sync::Arc::new(join(env, listen_ip()?, join_timeout()?)?);
    if rank == 0 {
        println!(
            "distributed: {} ranks ({:?} launcher), {} × schedule {} with {} stages, {} steps",
            env.world,
            env.launcher,
            job.dp,
            job.schedule,
            plan.stages,
            job.train.steps - first_step
        );
    }
    if rank == 0 && auto {
        println!(
            "schedule auto: ZB-H1 until every rank has measured its stage, then the auto plan of the gathered costs"
        );
    }
    if rank == 0 && job.filler != pipefill::config::Filler::None && job.dp > 1 {
        println!("note: with dp > 1 only replica 0's pipeline fills its bubbles with the drafter");
    }
    watchdog(&mesh);
    if let Some((_, log)) = &mut run_dir {
        log.start_clock();
    }
    let run = train_rank(
        job,
        plan,
        &mesh,
        job.clock.runtime(),
        job.train.steps - first_step,
        checkpoint.as_ref(),
        job.device.on_local_rank(env.local_rank),
    )?;
    if let Some(choice) = &run.auto {
        print_auto_choice(rank, first_step, choice);
    }
    // An auto-scheduled run is reported by the plan its last step ran.
    let plan = run.report.plan.as_deref().unwrap_or(plan);
    if rank == 0 {
        for m in &run.metrics {
            println!(
                "step {:>5}/{} loss {:.4} grad norm {:.4}",
                m.step + 1,
                job.train.steps,
                m.loss,
                m.grad_norm
            );
        }
    }
    if let (Some(mut checkpoint), Some((run_dir, mut log))) = (run.checkpoint, run_dir) {
        let out_dir = run_dir.path().to_path_buf();
        if let Some(last) = run.checkpoints.last() {
            println!(
                "sharded checkpoints: {} (last {})",
                run.checkpoints.len(),
                last.display()
            );
        }
        let merged = run.merged.as_ref();
        for m in &run.metrics {
            let timeline = merged.and_then(|p| p.iterations.get((m.step - first_step) as usize));
            log.record(&StepLine::new(m, timeline));
        }
        let summary = log.finish()?;
        run_dir.save_final(&mut checkpoint, job)?;
        if let Some(merged) = merged {
            write_profile(&out_dir, job, plan, merged, first_step)?;
        }
        println!(
            "done: {summary}; run directory {} (job.toml, metrics.jsonl, report.txt, \
             report.json, trace.json, timeline.svg, checkpoint/, checkpoints/)",
            out_dir.display()
        );
    }
    use pipefill::comm::link::PeerLink;
    mesh.close()?;
    Ok(())
}

/// What the ranks of an auto-scheduled run agreed on: every rank names the plan (a digest
/// of its text, equal on every rank) and what its stage measured; rank 0 the gathered costs.
fn print_auto_choice(rank: usize, first_step: u64, choice: &AutoChoice) {
    let c = &choice.measured;
    println!(
        "schedule auto: from step {} the auto plan {:016x} of the measured costs; stage {} measured F {:?} I {:?} W {:?}",
        first_step + choice.iteration + 1,
        choice.plan_hash(),
        choice.stage,
        c.f,
        c.i,
        c.w
    );
    if rank == 0 {
        let stages: Vec<String> = choice
            .cost
            .stage
            .iter()
            .map(|c| format!("[{:?}, {:?}, {:?}]", c.f, c.i, c.w))
            .collect();
        println!(
            "schedule auto: gathered costs (F, I, W by stage): [{}]",
            stages.join(", ")
        );
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
) -> anyhow::Result<()> {
    // Means after the warm-up step, as a single-process run predicts with.
    let skip = usize::from(merged.iterations.len() > 1);
    let cost = mean_cost(plan, &merged.iterations, skip)
        .context("some stage measured no forward in the merged profile: nothing to predict with")?;
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

/// Ends the process a few seconds after the mesh fails, whatever the rank is doing then (a
/// compute action runs to its end before the runtime notices): a dead peer must end every
/// rank within 10 s.
fn watchdog(mesh: &pipefill::comm::tcp::TcpMesh) {
    let failure = mesh.failure_watch();
    std::thread::spawn(move || {
        let reason = failure();
        std::thread::sleep(Duration::from_secs(3));
        eprintln!("error: {reason}");
        std::process::exit(1);
    });
}

/// `pipefill rl` as one rank of a multi-process job ([`pipefill::launch::rl`]): joins the
/// others, runs its stages of every update (rank 0 also the rollouts), and on rank 0 writes
/// the run directory: `job.toml`, `metrics.jsonl` (one line per RL step) and the final
/// policy's `checkpoint/`.
pub fn rl_distributed(
    job: &JobConfig,
    env: &RankEnv,
    init: Option<pipefill::model::checkpoint::Checkpoint>,
    existing: Existing,
) -> anyhow::Result<()> {
    let rank = env.rank;
    // Rank 0 writes the run directory; it is claimed before any rank joins.
    let run_dir = match rank {
        0 => Some(RunDir::claim(
            job.out_dir.as_deref(),
            "rl-distributed-",
            Resume::Unsupported,
            existing,
        )?),
        _ => None,
    };
    let mesh = std::sync::Arc::new(join(env, listen_ip()?, join_timeout()?)?);
    if rank == 0 {
        println!(
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
        );
    }
    if rank == 0 && job.rl.speculation {
        let start = pipefill::launch::rl::starting_drafter(job, init.as_ref());
        let version = start.map(|d| d.weights.version);
        println!("{}", crate::cli::rl::drafter_line(version));
    }
    watchdog(&mesh);
    let mut lines = String::new();
    let on_step = |m: &RlLaunchStep| {
        println!(
            "step {:>4}/{} reward {:.3} | rollout {:.2} s | weight sync {:.3} s | update {:.2} s, loss {:+.4}, grad norm {:.3}",
            m.step + 1,
            job.rl.steps,
            m.reward,
            m.rollout_seconds,
            m.sync_seconds,
            m.update_seconds,
            m.surrogate_loss,
            m.grad_norm
        );
        lines += &serde_json::to_string(m).expect("a step line always serializes");
        lines.push('\n');
    };
    // This rank computes on its local rank's GPU with device = "cuda", else a CPU thread.
    let ranked = Ranked {
        job,
        mesh: &mesh,
        init: init.as_ref(),
        local_rank: env.local_rank,
        on_step,
    };
    let cuda = job.device == pipefill::config::DeviceKind::Cuda;
    let run = on_backend(cuda, ranked)??;
    let (Some(mut run), Some(run_dir)) = (run, run_dir) else {
        return Ok(());
    };
    let out_dir = run_dir.path().to_path_buf();
    let mut metrics = run_dir.create(&job.to_toml(), 0)?;
    metrics
        .write_all(lines.as_bytes())
        .and_then(|()| metrics.flush())
        .with_context(|| format!("cannot write {}/metrics.jsonl", out_dir.display()))?;
    run_dir.save_final(&mut run.checkpoint, job)?;
    println!(
        "done: {} RL steps over {} processes; run directory {} (job.toml, metrics.jsonl, checkpoint/)",
        run.steps.len(),
        env.world,
        out_dir.display()
    );
    Ok(())
}

/// A launched rl rank's run on the backend of its device ([`on_backend`]).
struct Ranked<'a, F> {
    job: &'a JobConfig,
    mesh: &'a std::sync::Arc<pipefill::comm::tcp::TcpMesh>,
    init: Option<&'a pipefill::model::checkpoint::Checkpoint>,
    local_rank: usize,
    on_step: F,
}

impl<F: FnMut(&RlLaunchStep)> OnBackend for Ranked<'_, F> {
    type Output = anyhow::Result<Option<RlLaunchRun>>;
    fn run<B: RankBackend>(self) -> Self::Output {
        let backend = B::for_rank(self.local_rank)?;
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
