//! `pipefill rl [CONFIG.toml] [--set key=value ...] [--init RUN_DIR] [--steps N]`: GRPO on
//! the job's tasks (the `[rl]` section), each step a rollout batch then one pipelined
//! update with the job's schedule ([`pipefill::rl::trainer`]).
//!
//! The policy starts from a `pipefill train` run (`--init RUN_DIR`: its checkpoint, and its
//! `[model]` and data seed, which the checkpoint was trained with) or, without one, from
//! `rl.warmup_steps` supervised pipelined steps on the same tasks. With speculation the
//! rollouts' drafter starts from the `--init` checkpoint's when that run trained one in its
//! bubbles (`filler = "drafter"`). Two progress bars follow
//! the rollouts (mean reward) and the updates (loss, gradient norm, bubble ratio); the run
//! directory gets `job.toml`, `metrics.jsonl` (one line per RL step, see
//! [`RlStepMetrics`]) and the final `checkpoint/`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use pipefill::config::JobConfig;
use pipefill::config::memory::Workload;
use pipefill::model::checkpoint::Checkpoint;
use pipefill::rl::calibrate::Calibration;
use pipefill::rl::config::SpecThreshold;
use pipefill::rl::trainer::{RlStepMetrics, RlTrainer, RolloutEngine, warm_up};
use pipefill::rl::trainer_spec::{PipelineRollouts, ThresholdChoice};
use pipefill::run::{Existing, Resume, RunDir};
use pipefill::tensor::device::{OnBackend, RankBackend, on_backend};

#[derive(clap::Args)]
pub struct RlArgs {
    /// Job file (TOML). Without one, the embedded default job (examples/default.toml).
    config: Option<PathBuf>,
    /// Override one field of the job, e.g. `--set rl.group=8` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// The Hugging Face model in directory DIR (Llama, Qwen2, Mistral) as the starting
    /// policy: its config.json gives the shape, its safetensors the weights, its tokenizer
    /// the JSONL data's by default (sets `model.from`; the warm-up steps still run).
    #[arg(long, value_name = "DIR", conflicts_with = "init")]
    model: Option<PathBuf>,
    /// Start from this `pipefill train` run directory (its checkpoint/ and job.toml)
    /// instead of a supervised warm-up.
    #[arg(long, value_name = "RUN_DIR")]
    init: Option<PathBuf>,
    /// Number of RL steps (overrides rl.steps).
    #[arg(long)]
    steps: Option<u64>,
    /// Output directory (overrides out_dir).
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
    /// Replace the run already in the output directory (its job.toml, metrics and
    /// checkpoint; other files stay). Without it a non-empty output directory is refused.
    #[arg(long)]
    overwrite: bool,
    /// Most memory the run may use, e.g. `8GiB`, `512MiB` (a launched rank: its share of the
    /// job) [default: the memory available, MemAvailable in /proc/meminfo]. A job whose
    /// estimate exceeds it is refused before the rollouts and the update are built.
    #[arg(long, value_name = "SIZE")]
    max_memory: Option<String>,
}

/// Which drafter the rollouts start from, for the in-process and the launched run alike:
/// the starting checkpoint's after `version` optimizer steps, or untrained (`None`).
pub fn drafter_line(version: Option<u64>) -> String {
    match version {
        Some(steps) => format!(
            "drafter: the starting checkpoint's (trained in its run's bubbles, {steps} optimizer \
             steps)"
        ),
        None => "drafter: untrained (the starting checkpoint has none; a `pipefill train` run \
                 with filler = \"drafter\" trains one in its bubbles)"
            .into(),
    }
}

pub fn run(args: RlArgs) -> anyhow::Result<()> {
    let mut sets = args.set.clone();
    if let Some(steps) = args.steps {
        sets.push(format!("rl.steps={steps}"));
    }
    if let Some(dir) = &args.out_dir {
        let dir = dir.display().to_string();
        sets.push(format!("out_dir={}", toml::Value::String(dir)));
    }
    if let Some(dir) = &args.model {
        let dir = dir.display().to_string();
        sets.push(format!("model.from={}", toml::Value::String(dir)));
    }
    let mut job = match &args.config {
        Some(path) => JobConfig::load(path, &sets)?,
        None => JobConfig::embedded(&sets)?,
    };
    // One rank of a multi-process job (pipefill launch, torchrun, mpirun, srun).
    let rank_env = pipefill::launch::RankEnv::detect()?;
    // Before anything runs: a device that cannot be used here ends the run at once.
    let cuda = job
        .device
        .usable_on_local_rank(rank_env.local_rank)?
        .is_cuda();
    let checkpoint = match &args.init {
        Some(dir) => init_from(&mut job, dir)?,
        None => None,
    };
    job.rl.validate(job.model.seq_len)?;
    crate::cli::train::check_memory(&job, &rank_env, args.max_memory.as_deref(), Workload::Rl)?;
    if job.schedule.is_none() {
        bail!("schedule \"none\": the RL update runs as a pipelined step; name a schedule");
    }
    let existing = Existing::overwrite(args.overwrite);
    if rank_env.is_distributed() {
        return crate::cli::launch::rl_distributed(&job, &rank_env, checkpoint, existing);
    }
    // Before any work: a run directory that holds another run ends the run at once.
    let run_dir = RunDir::claim(job.out_dir.as_deref(), "rl-", Resume::Unsupported, existing)?;
    let rl = job.rl.clone();
    println!(
        "model: {} params ({} layers, d_model {}, seq {}) on the {}; update: schedule {} on {} \
         ranks, {} sequences ({} prompts × group {}) per step, packed {} per micro-batch",
        job.model.param_count(),
        job.model.layers,
        job.model.d_model,
        job.model.seq_len,
        match cuda {
            true => "GPU (the update's rank r on GPU r mod their count)",
            false => "CPU",
        },
        job.schedule,
        job.stages,
        rl.sequences(),
        rl.prompts,
        rl.group,
        rl.group
    );
    let checkpoint = match checkpoint {
        Some(c) => c,
        None => supervised_warm_up(&job)?,
    };

    let run = InProcess {
        job: &job,
        checkpoint,
        run_dir: &run_dir,
    };
    on_backend(cuda, run)?
}

/// The in-process RL run after its checkpoint is known: rollouts, drafter, policy and the
/// update's ranks on the backend `B` of the job's `device`.
struct InProcess<'a> {
    job: &'a JobConfig,
    checkpoint: Checkpoint,
    run_dir: &'a RunDir,
}

impl OnBackend for InProcess<'_> {
    type Output = anyhow::Result<()>;
    fn run<B: RankBackend>(self) -> anyhow::Result<()> {
        rl_in_process::<B>(self.job, self.checkpoint, self.run_dir)
    }
}

fn rl_in_process<B: RankBackend>(
    job: &JobConfig,
    checkpoint: Checkpoint,
    run_dir: &RunDir,
) -> anyhow::Result<()> {
    let rl = job.rl.clone();
    let out_dir = run_dir.path().to_path_buf();
    let mut metrics = run_dir.create(&job.to_toml(), 0)?;

    // Rank 0's work (policy, reference, drafter) on one backend, the update's ranks each on
    // their own.
    let backend = B::for_rank(0)?;
    let mut engine = PipelineRollouts::on(job, backend.clone())?;
    let mut version = None;
    if rl.speculation
        && let Some(state) = &checkpoint.drafter
    {
        engine = engine.with_drafter(state)?;
        version = Some(engine.drafter_version());
    }
    let mut trainer = RlTrainer::on(job, checkpoint, backend)?;
    if let (Some(n), Some(path)) = (trainer.prompts().records(), &job.data.path) {
        println!(
            "prompts: {n} prompt/answer records of {} (each once per epoch), scored by rl.reward = {:?}",
            path.display(),
            rl.reward
        );
    }
    if rl.speculation {
        let arms = match rl.advanced.plain_arm {
            true => format!("K ∈ 0..={} (0: plain)", rl.draft_k),
            false => format!("K ≤ {}", rl.draft_k),
        };
        let below = match rl.spec_threshold {
            SpecThreshold::Live(n) => format!("at most {n} sequences (rl.spec_threshold)"),
            SpecThreshold::Auto => "at most a threshold calibrated on the policy".into(),
        };
        println!(
            "rollouts: speculative decoding while {below} are live ({arms} chosen by a \
             bandit), drafter trained {} slices per step on the rollouts",
            rl.drafter_slices
        );
        if let Some(t) = &rl.draft_tree {
            println!(
                "rollouts: draft trees of up to {} nodes ({} children of the {} best nodes a \
                 level), as deep as the bandit's K",
                t.nodes, t.branch, t.width
            );
        }
        println!("{}", drafter_line(version));
        engine.calibrate(trainer.policy())?;
        if let Some(line) = calibration_line(&engine) {
            println!("{line}");
        }
    } else {
        println!("rollouts: plain sampling (rl.speculation = false)");
    }
    let bars = MultiProgress::new();
    let rollout_bar = bars.add(bar(rl.steps, "rollout"));
    let update_bar = bars.add(bar(rl.steps, "update "));
    let started = Instant::now();
    let mut history: Vec<RlStepMetrics> = Vec::new();
    for _ in 0..rl.steps {
        let m = trainer
            .run_step(&mut engine as &mut dyn RolloutEngine<B>, |reward| {
                rollout_bar.set_message(format!("reward {reward:.3}"));
                rollout_bar.inc(1);
            })
            .with_context(|| format!("rl step {}", trainer.step()))?;
        update_bar.set_message(format!(
            "loss {:+.4} | grad norm {:.3} | bubble {}",
            m.surrogate_loss,
            m.grad_norm,
            m.bubble_ratio
                .map_or("-".into(), |b| format!("{:.1}%", 100.0 * b))
        ));
        update_bar.inc(1);
        if rollout_bar.is_hidden() {
            println!(
                "step {:>4}/{} reward {:.3} | rollout {:.2} s ({:.0} tok/s, {:.0}% of the step, \
                 stages idle {}){} | drafter {:.2} s | reference {:.2} s | update {:.2} s, grad \
                 norm {:.3}",
                m.step + 1,
                rl.steps,
                m.reward,
                m.rollout_seconds,
                m.tokens_per_s,
                100.0 * m.rollout_share,
                idle_line(&m),
                engine
                    .threshold()
                    .map_or(String::new(), |t| format!(" speculating ≤ {}", t.threshold)),
                m.drafter_seconds,
                m.reference_seconds,
                m.update_seconds,
                m.grad_norm
            );
        }
        let line = MetricsLine {
            step: &m,
            spec_threshold: engine.threshold(),
            calibration: (m.step == 0).then(|| engine.calibration()).flatten(),
        };
        serde_json::to_writer(&mut metrics, &line)?;
        writeln!(metrics)?;
        metrics.flush().context("cannot write metrics.jsonl")?;
        history.push(m);
    }
    rollout_bar.finish();
    update_bar.finish();

    run_dir.save_final(&mut trainer.checkpoint()?, job)?;
    let window = history.len().clamp(1, 5);
    let mean = |ms: &[RlStepMetrics]| ms.iter().map(|m| m.reward).sum::<f64>() / ms.len() as f64;
    let rollout: f64 = history.iter().map(|m| m.rollout_seconds).sum();
    let total = started.elapsed().as_secs_f64();
    let median = |f: fn(&RlStepMetrics) -> f64| {
        let mut v: Vec<f64> = history.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "median step {:.3} s: rollout {:.3} s, drafter {:.3} s, reference {:.3} s, update {:.3} s",
        median(|m| m.step_seconds),
        median(|m| m.rollout_seconds),
        median(|m| m.drafter_seconds),
        median(|m| m.reference_seconds),
        median(|m| m.update_seconds),
    );
    println!(
        "done: {} RL steps in {total:.1} s (rollouts {:.0}%); reward {:.3} → {:.3} (mean of \
         first/last {window} steps); run directory {} (metrics.jsonl, checkpoint/)",
        history.len(),
        100.0 * rollout / total.max(1e-9),
        mean(&history[..window]),
        mean(&history[history.len() - window..]),
        out_dir.display()
    );
    Ok(())
}

/// A line of metrics.jsonl: the step's [`RlStepMetrics`], the live-batch threshold its
/// rollout speculated below (and where it came from), and on the first line the step costs
/// a calibrated threshold was derived from.
#[derive(serde::Serialize)]
struct MetricsLine<'a> {
    #[serde(flatten)]
    step: &'a RlStepMetrics,
    spec_threshold: Option<&'a ThresholdChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    calibration: Option<&'a Calibration>,
}

/// The calibration in one line: what it measured, the acceptance it starts from and the
/// threshold of the first rollout; `None` without one.
fn calibration_line<B: RankBackend>(engine: &PipelineRollouts<B>) -> Option<String> {
    let c = engine.calibration()?;
    let t = engine.next_threshold()?;
    let outcome = match (t.source, t.alpha, t.alpha_from) {
        ("cannot pay", ..) => "speculation cannot pay on this target (not even with every \
                               draft accepted): plain decoding, drafter not trained"
            .to_string(),
        (_, Some(alpha), Some(from)) => format!(
            "per-token acceptance {alpha:.2} ({from}) → speculate while live ≤ {} ({} per \
             group × {} groups), re-derived each step",
            t.threshold,
            t.threshold / c.groups,
            c.groups
        ),
        _ => "no acceptance measured yet → no speculation in the first rollout, re-derived \
              each step"
            .to_string(),
    };
    Some(format!(
        "calibration ({:.2} s, fastest of {}): {}; {outcome}",
        c.seconds,
        c.reps,
        c.summary()
    ))
}

/// `"1.23 s, 45% filled (6 slices)"`, or `-` without an idle-work router.
fn idle_line(m: &RlStepMetrics) -> String {
    match (m.rollout_idle_seconds, m.rollout_idle_filled_seconds) {
        (Some(idle), Some(filled)) => format!(
            "{idle:.2} s, {:.0}% filled ({} drafter slices)",
            100.0 * filled / idle.max(1e-9),
            m.idle_drafter_slices
        ),
        _ => "-".into(),
    }
}

/// The checkpoint of the `pipefill train` run in `dir`, adopting its `[model]` and data
/// seed (the checkpoint holds that model, trained on that stream).
pub(super) fn init_from(job: &mut JobConfig, dir: &Path) -> anyhow::Result<Option<Checkpoint>> {
    let job_path = dir.join("job.toml");
    let init = JobConfig::load(&job_path, &[])
        .with_context(|| format!("--init {}: not a pipefill train run", dir.display()))?;
    if init.model != job.model || init.train.seed != job.train.seed {
        println!(
            "--init {}: using its [model] and train.seed (the checkpoint's)",
            dir.display()
        );
        job.model = init.model;
        job.train.seed = init.train.seed;
    }
    let checkpoint = Checkpoint::load(&dir.join("checkpoint"))
        .with_context(|| format!("--init {}", dir.display()))?;
    println!(
        "policy: {} at step {}",
        dir.join("checkpoint").display(),
        checkpoint.meta.step
    );
    Ok(Some(checkpoint))
}

/// `rl.warmup_steps` supervised pipelined steps, with a progress bar.
fn supervised_warm_up(job: &JobConfig) -> anyhow::Result<Checkpoint> {
    let steps = job.rl.warmup_steps;
    if steps == 0 {
        bail!("rl.warmup_steps is 0 and no --init run is given: the policy would be untrained");
    }
    println!("warm-up: {steps} supervised steps on the job's tasks (no --init run)");
    let warm = bar(steps, "warm-up");
    let checkpoint = warm_up(job, |m| {
        warm.set_message(format!("loss {:.4}", m.loss));
        warm.inc(1);
    })?;
    warm.finish();
    Ok(checkpoint)
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(&format!("{what} {{bar:30}} {{pos}}/{{len}} {{msg}}"))
            .expect("valid template"),
    );
    bar
}
