//! Where a plan comes from: a built-in schedule generated for `--stages`/`--microbatches`
//! /`--chunks`, or a custom schedule file (`.csv` or `.toml`).
//!
//! A name that is a built-in schedule wins; anything else is taken as a file path. A file
//! is checked by the validator as it is loaded, so every subcommand reports a broken file
//! the same way (the file name, then the validator's one-line reason).

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use pipefill::config::memory::{Bytes, MemoryLimit, SCHEDULE_FILE_BYTE_COST};
use pipefill::schedules::{Plan, ScheduleKind, ValidateOptions, read_plan, validate};

/// Bytes a schedule command holds per compute action of its plan: the plan, its lowered
/// copy, the validator's and simulator's tables, the timeline and the text written. At
/// 3 M actions (zb-h1, 1000 ranks × 1000 micro-batches) peak RSS was 33 bytes per action
/// for `validate`, 94 for `simulate`, 114 for `show --lower --format csv`; `show` (the
/// grid) 150 and `compare` 190 at 300 ranks.
pub const ACTION_BYTES: u64 = 256;
/// `export --format svg`: 260 bytes per action measured (300 × 1000).
pub const SVG_ACTION_BYTES: u64 = 512;
/// `export --format chrome`: its JSON tree, 3.6 KB per action measured (1000 × 1000).
pub const CHROME_ACTION_BYTES: u64 = 4096;

/// Refuses, before it is built, a plan of `kind` whose actions would need more than
/// `limit` at `per_action` bytes each; the error names the flags that size it.
pub fn check_plan_size(
    kind: ScheduleKind,
    ranks: usize,
    microbatches: usize,
    chunks: usize,
    per_action: u64,
    limit: &MemoryLimit,
) -> Result<()> {
    let shape = match chunks {
        1 => format!("--stages {ranks} × --microbatches {microbatches}"),
        v => format!("--stages {ranks} × --microbatches {microbatches} × --chunks {v}"),
    };
    let bytes = kind
        .compute_actions(ranks, microbatches, chunks)
        .and_then(|n| n.checked_mul(per_action).map(|b| (n, b)));
    let Some((actions, bytes)) = bytes else {
        bail!("{shape}: {kind}'s plan has more actions than 64-bit arithmetic counts");
    };
    if bytes > limit.bytes {
        bail!(
            "{shape}: {kind}'s plan has {actions} actions, an estimated {} to build and check, \
             over the memory limit of {} ({})",
            Bytes(bytes),
            Bytes(limit.bytes),
            limit.source
        );
    }
    Ok(())
}

/// The KIND|FILE argument and the shape options every plan-taking subcommand shares.
#[derive(clap::Args, Clone, Debug)]
pub struct PlanArgs {
    /// A built-in schedule (gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zb-h2, zb-v,
    /// dualpipe-v) or a custom schedule file (.csv in PyTorch pipelining's form, or .toml).
    #[arg(value_name = "KIND|FILE")]
    pub schedule: String,
    /// Pipeline ranks (devices), P. Required for a built-in schedule; for a file, checked
    /// against it.
    #[arg(short = 'p', long, visible_alias = "ranks", value_name = "P")]
    pub stages: Option<usize>,
    /// Micro-batches per iteration, M. Required for a built-in schedule; for a file,
    /// checked against it.
    #[arg(short = 'm', long, value_name = "M")]
    pub microbatches: Option<usize>,
    /// Stages (model chunks) per rank, V [default: the schedule's own: 2 for
    /// interleaved-1f1b, looped-bfs, zb-v and dualpipe-v, 1 otherwise]. For a file, checked
    /// against it.
    #[arg(long, value_name = "V")]
    pub chunks: Option<usize>,
}

/// A loaded plan and what to call it in reports.
pub struct Loaded {
    pub plan: Plan,
    /// The schedule's name (`zb-h1`) or the file's path as given: what errors and
    /// reports are prefixed with.
    pub name: String,
}

impl PlanArgs {
    /// Generates or reads the plan (compute-only for a built-in; a file as written), first
    /// checking that the command's `per_action` bytes for each of its actions fit `limit`.
    pub fn load(&self, per_action: u64, limit: &MemoryLimit) -> Result<Loaded> {
        match self.schedule.parse::<ScheduleKind>() {
            Ok(kind) => self.generate(kind, per_action, limit),
            Err(unknown) => {
                let path = Path::new(&self.schedule);
                if !looks_like_file(path) {
                    bail!(
                        "{unknown}; nor is it a schedule file (expected a path ending in .csv or .toml)"
                    );
                }
                self.read(path, per_action, limit)
            }
        }
    }

    fn generate(&self, kind: ScheduleKind, per_action: u64, limit: &MemoryLimit) -> Result<Loaded> {
        let name = kind.name();
        let (Some(ranks), Some(microbatches)) = (self.stages, self.microbatches) else {
            bail!("{name} needs --stages P and --microbatches M");
        };
        let chunks = self.chunks.unwrap_or(kind.default_chunks());
        check_plan_size(kind, ranks, microbatches, chunks, per_action, limit)?;
        let plan = pipefill_schedules::generate(kind, ranks, microbatches, chunks)?;
        Ok(Loaded {
            plan,
            name: name.to_string(),
        })
    }

    fn read(&self, path: &Path, per_action: u64, limit: &MemoryLimit) -> Result<Loaded> {
        let file = path.display().to_string();
        // A missing file is `read_plan`'s error; one too large to read is refused here.
        if let Ok(meta) = std::fs::metadata(path) {
            let bytes = meta
                .len()
                .saturating_mul(SCHEDULE_FILE_BYTE_COST.max(per_action / 4));
            if bytes > limit.bytes {
                bail!(
                    "{file}: a schedule file of {} needs an estimated {} to read and check, \
                     over the memory limit of {} ({})",
                    Bytes(meta.len()),
                    Bytes(bytes),
                    Bytes(limit.bytes),
                    limit.source
                );
            }
        }
        // `read_plan`'s errors already start with the file name.
        let plan = read_plan(path)?;
        let check = |flag: &str, given: Option<usize>, actual: usize, what: &str| match given {
            Some(g) if g != actual => Err(anyhow!(
                "{file}: the file has {actual} {what}, but {flag} says {g}"
            )),
            _ => Ok(()),
        };
        check("--stages", self.stages, plan.num_ranks(), "ranks")?;
        check(
            "--microbatches",
            self.microbatches,
            plan.microbatches,
            "micro-batches",
        )?;
        check(
            "--chunks",
            self.chunks,
            plan.stages_per_rank(),
            "stages per rank",
        )?;
        validate(&plan, &ValidateOptions::default()).with_context(|| file.clone())?;
        Ok(Loaded { plan, name: file })
    }
}

/// Whether `path` is meant as a schedule file rather than a misspelt schedule name.
fn looks_like_file(path: &Path) -> bool {
    path.exists()
        || path.extension().is_some()
        || path.to_string_lossy().contains(std::path::MAIN_SEPARATOR)
        || path.to_string_lossy().contains('/')
}

/// One line describing a plan's shape: ranks, stages per rank and placement, micro-batches.
pub fn describe_shape(plan: &Plan) -> String {
    let ranks = plan.num_ranks();
    let v = plan.stages_per_rank();
    format!(
        "{ranks} rank{}, {} stage{} ({v} per rank, {} placement), {} micro-batch{}",
        plural(ranks),
        plan.stages,
        plural(plan.stages),
        plan.placement.name(),
        plan.microbatches,
        if plan.microbatches == 1 { "" } else { "es" }
    )
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}
