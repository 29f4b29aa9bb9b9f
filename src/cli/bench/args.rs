//! The arguments of `pipefill bench`: which benchmark, and `bench rollout`'s settings.

use pipefill::rl::rollout::MIN_GROUP_ROWS;

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub(super) what: BenchWhat,
}

#[derive(clap::Subcommand)]
pub(super) enum BenchWhat {
    /// Plain vs fixed-K vs adaptive speculative rollout on a long-tail batch.
    Rollout(RolloutArgs),
    /// A job with its filler against the same job without, alternating (step inflation,
    /// bubble fill).
    Filler(super::filler::FillerArgs),
}

#[derive(clap::Args)]
pub struct RolloutArgs {
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub(super) json: bool,
    /// Target training steps before the rollouts (when `--run-dir` holds no target).
    #[arg(long, default_value_t = 100)]
    pub(super) steps: u64,
    /// Where the target and its drafters are kept: a directory holding a target (a
    /// `pipefill train` run, or an earlier bench's: its checkpoint and `[model]` win) is
    /// loaded; otherwise the bench trains one and saves it there. Drafters are kept there
    /// too, one per batch and setting, so reruns only measure. Remove it to retrain.
    #[arg(
        long,
        alias = "init",
        value_name = "RUN_DIR",
        default_value = "runs/bench-rollout"
    )]
    pub(super) run_dir: std::path::PathBuf,
    /// Run the long tail through the stage threads too (the engine's default runs a lone
    /// group through every stage on the driver's thread): to measure what that saves.
    #[arg(long)]
    pub(super) threaded_tail: bool,
    /// Drafter training slices on the rows of its own batch (self-distillation on the
    /// target's own generations). More slices raise the drafter's agreement and acceptance
    /// length, at a training cost that grows with `d_model`: on the d512 target, trained on
    /// prompts that still shared the measured batch's small tasks, 16000 took the acceptance
    /// length at K = 4 to 3.74 where 6000 gave 3.17 (docs/benchmarks.md, "A drafter that has
    /// not seen the measured batch"), in about 6 minutes on a 2-core box, once (it is kept).
    #[arg(long, default_value_t = 16000)]
    pub(super) drafter_slices: usize,
    /// Sequences of the drafter's own batch: other prompts of the same tasks, rolled out
    /// plainly, whose rows it trains on (it never sees the measured batch's). As TLT's
    /// drafter learns from many steps' rollouts: on the d512 target 1024 took held-out
    /// agreement from 65% (256) to 82% and the acceptance length at K = 4 from 2.30 to 3.92.
    #[arg(long, default_value_t = 1024)]
    pub(super) drafter_requests: usize,
    /// Sequences in the batch.
    #[arg(long, default_value_t = 128)]
    pub(super) requests: usize,
    /// Pipeline stages.
    #[arg(long, default_value_t = 4)]
    pub(super) stages: usize,
    /// Most stage threads, each a run of consecutive stages, and most groups of plain
    /// decode steps (default: the machine's cores): `--workers 4` runs a thread per stage
    /// and four plain groups, to measure what that costs.
    #[arg(long)]
    pub(super) workers: Option<usize>,
    /// Groups in flight (default: one per stage; plain decode steps at most `--workers`).
    #[arg(long)]
    pub(super) groups: Option<usize>,
    /// Fewest positions a group step carries: the engine merges smaller groups. The
    /// bench's d_model-512 target reads ~100 MB of weights per group step, so merging
    /// pays; `pipefill rl`'s `rl.advanced.min_group_rows` defaults to 1, chosen at d_model
    /// 256 (docs/benchmarks.md).
    #[arg(long, default_value_t = MIN_GROUP_ROWS)]
    pub(super) min_group_rows: usize,
    /// K of the fixed-K run.
    #[arg(long, default_value_t = 4)]
    pub(super) k: usize,
    /// Runs per mode (medians are reported).
    #[arg(long, default_value_t = 5)]
    pub(super) reps: usize,
    /// The draft tree of the tree variants, `DEPTH,BRANCH,WIDTH,NODES` (see
    /// `TreeShape`; the adaptive tree's depth is the bandit's K).
    #[arg(long, default_value = "6,3,3,12", value_name = "D,B,W,N")]
    pub(super) tree: String,
    /// Override job fields, e.g. `--set model.layers=4`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub(super) sets: Vec<String>,
    /// What the target, the rollouts and the drafter compute on: cpu or cuda (overrides
    /// device; cuda: GPU 0).
    #[arg(long, value_enum)]
    pub(super) device: Option<pipefill::config::DeviceKind>,
    /// Compare the full head's chains with draft vocabularies of these many tokens and stop
    /// (see the module docs).
    #[arg(long, value_name = "N,..", value_delimiter = ',')]
    pub(super) draft_vocab: Vec<usize>,
}
