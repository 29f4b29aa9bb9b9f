//! `pipefill rl [CONFIG.toml] [--set key=value ...] [--init RUN_DIR] [--steps N]`: GRPO on
//! the job's tasks (the `[rl]` section), each step a rollout batch then one pipelined
//! update with the job's schedule ([`pipefill::rl::trainer`]).
//!
//! The policy starts from a `pipefill train` run (`--init RUN_DIR`: its checkpoint, and its
//! `[model]` and data seed, which the checkpoint was trained with) or, without one, from
//! `rl.warmup_steps` supervised pipelined steps on the same tasks. With speculation the
//! rollouts' drafter starts from the `--init` checkpoint's when that run trained one in its
//! bubbles (`filler = "drafter"`). Two progress bars follow the rollouts (mean reward) and
//! the updates (loss, gradient norm, bubble ratio); the run directory gets `job.toml`,
//! `metrics.jsonl` (one line per RL step, see [`pipefill::rl::step_metrics::RlStepMetrics`])
//! and the final `checkpoint/`.
//!
//! This module parses the arguments; the run itself, in one process or as one rank of a
//! launched job, is [`pipefill::run::rl`].

use std::path::PathBuf;

use crate::cli::job::JobArgs;
use crate::cli::show::Terminal;
use pipefill::launch::RankEnv;

#[derive(clap::Args)]
pub struct RlArgs {
    #[command(flatten)]
    job: JobArgs,
    /// The Hugging Face model in directory DIR (Llama, Qwen2, Mistral) as the starting
    /// policy: its config.json gives the shape, its safetensors the weights, its tokenizer
    /// the JSONL data's by default (sets `model.from`; no warm-up unless rl.warmup_steps is
    /// set).
    #[arg(long, value_name = "DIR", conflicts_with = "init")]
    model: Option<PathBuf>,
    /// Start from this `pipefill train` run directory (its checkpoint/ and job.toml)
    /// instead of a supervised warm-up.
    #[arg(long, value_name = "RUN_DIR")]
    init: Option<PathBuf>,
    /// Number of RL steps (overrides rl.steps).
    #[arg(long)]
    steps: Option<u64>,
}

pub fn run(args: RlArgs) -> anyhow::Result<()> {
    let mut sets = Vec::new();
    if let Some(steps) = args.steps {
        sets.push(format!("rl.steps={steps}"));
    }
    let job = args.job.job(sets, args.model.as_deref())?;
    // One rank of a multi-process job (pipefill launch, torchrun, mpirun, srun), or alone.
    let env = RankEnv::detect()?;
    let start = args.job.start(&env);
    pipefill::run::rl(&job, args.init.as_deref(), &start, &mut Terminal::default())?;
    Ok(())
}
