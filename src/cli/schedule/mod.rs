//! `pipefill schedule …`: show, validate, simulate, compare and export pipeline schedules.
//!
//! Everything here is the command line's edge: it turns arguments into calls of
//! `pipefill-schedules` (generators, file reader, validator, simulator) and of the timeline
//! writers in [`pipefill::profile`], and turns their errors into one-line messages. No
//! metric is computed here: figures come from the simulator's `Timeline`.
//!
//! - [`source`]: KIND|FILE and the shape options (`--stages`, `--microbatches`, `--chunks`).
//! - [`cost`]: the `--cost` specification.
//! - [`report`]: `simulate` and `compare`, as text tables or JSON.
//! - [`export`]: `export` to SVG, Chrome/Perfetto trace, CSV or TOML.
//! - [`auto`]: `auto`, the auto-scheduler's plan next to every built-in.

mod auto;
mod cost;
mod export;
mod report;
mod source;

use std::io::Write;

use anyhow::{Context, Result};
use clap::{Subcommand, ValueEnum};
use pipefill::profile::fmt_num;
use pipefill::profile::grid::{GridOptions, grid};
use pipefill_schedules::{
    CostModel, Plan, ScheduleError, Timeline, ValidateOptions, lower, simulate, to_csv, to_toml,
    validate,
};

use self::cost::CostSpec;
use pipefill::config::memory::MemoryLimit;

use self::source::{ACTION_BYTES, PlanArgs, describe_shape};

/// `pipefill schedule`: its subcommands, and the KIND|FILE help shown under them.
#[derive(clap::Args)]
#[command(after_help = "\
KIND is a built-in schedule: gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zb-h2, zb-v,
dualpipe-v.
FILE is a custom schedule: .csv (PyTorch pipelining's form: one row per rank, cells such as
0F3, 2I0, 1W2, (0F7;7B3)OVERLAP_F_B, an empty cell for an idle step) or .toml.

Examples:
  pipefill schedule show zb-h1 --stages 4 --microbatches 8
  pipefill schedule compare --stages 4 --microbatches 16 --cost f=1,i=1,w=1,comm=0.1
  pipefill schedule simulate zb-v -p 4 -m 8 --cost f=1:1:1:1:1:1:1:1.5 --json
  pipefill schedule validate examples/schedules/zb1p_2x2.toml --memory-limit 4
  pipefill schedule export zb-h2 -p 4 -m 8 --format chrome -o trace.json  (ui.perfetto.dev)
  pipefill schedule auto -p 4 -m 12 --cost f=1,i=1.07,w=0.93,comm=0.05 --memory-limit 8")]
pub struct ScheduleArgs {
    #[command(subcommand)]
    command: ScheduleCommand,
    /// Most memory a command may use to build and check its plans, e.g. `8GiB`, `512MiB`
    /// [default: the memory available, MemAvailable in /proc/meminfo]. A shape whose plan
    /// would need more is refused before it is built.
    #[arg(long, global = true, value_name = "SIZE")]
    max_memory: Option<String>,
}

#[derive(Subcommand)]
enum ScheduleCommand {
    /// Print a schedule: a grid with one row per rank (the unit-cost timeline: F, I, W each
    /// take one column), or the plan as CSV, TOML or JSON.
    Show(ShowArgs),
    /// Check a schedule file: every (stage, micro-batch) gets one F and one backward, the
    /// dependencies hold, it cannot deadlock, and its peak memory fits the limit.
    Validate(ValidateArgs),
    /// Time a schedule under a cost model: makespan, bubble ratios, peak memory, bubble slots.
    Simulate(report::SimulateArgs),
    /// Every built-in schedule side by side for one pipeline shape: the table to choose from.
    Compare(report::CompareArgs),
    /// Write a schedule's timeline as SVG or a Chrome/Perfetto trace, or the plan as CSV/TOML.
    Export(export::ExportArgs),
    /// The plan with the least steady bubble under a cost model and a memory limit (greedy
    /// list scheduling plus search), next to every built-in schedule's figures.
    Auto(auto::AutoArgs),
}

/// Output forms of `show`.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum ShowFormat {
    /// A grid, one row per rank, one column per unit-cost time step.
    Text,
    /// PyTorch pipelining's CSV form.
    Csv,
    /// pipefill's TOML form.
    Toml,
    /// The plan as JSON (serde form of `Plan`).
    Json,
}

#[derive(clap::Args)]
struct ShowArgs {
    #[command(flatten)]
    plan: PlanArgs,
    /// Output form.
    #[arg(long, value_enum, default_value = "text")]
    format: ShowFormat,
    /// Insert SEND/RECV for every cross-rank transfer first (the plan a runtime executes).
    #[arg(long)]
    lower: bool,
}

/// `--cost` and `--memory-limit`, shared by the subcommands that time or size a plan.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct CostArgs {
    /// Cost model as comma-separated key=value: f, i, w (time of a forward, input-gradient
    /// and weight-gradient backward; one value, or a per-stage list `f=1:1:1.5:1`), comm
    /// (latency of one transfer between ranks), mb, mw (activation memory a forward holds,
    /// and the part kept from I until W), speed (per-rank speed factor, `speed=1:0.5`).
    /// Keys left out keep their defaults.
    #[arg(
        long,
        value_name = "SPEC",
        default_value = "f=1,i=1,w=1,comm=0,mb=1,mw=0.5"
    )]
    cost: String,
    /// Peak activation memory allowed on any rank, in units of `mb`; a plan over it is an error.
    #[arg(long, value_name = "N")]
    memory_limit: Option<f64>,
}

impl CostArgs {
    pub(crate) fn spec(&self) -> Result<CostSpec> {
        if let Some(limit) = self.memory_limit
            && !(limit.is_finite() && limit >= 0.0)
        {
            anyhow::bail!("--memory-limit: {limit} is not a finite number ≥ 0");
        }
        CostSpec::parse(&self.cost)
    }
}

#[derive(clap::Args)]
struct ValidateArgs {
    #[command(flatten)]
    plan: PlanArgs,
    #[command(flatten)]
    cost: CostArgs,
}

/// Runs `pipefill schedule …`.
pub fn run(args: ScheduleArgs) -> Result<()> {
    let result = MemoryLimit::resolve(args.max_memory.as_deref())
        .map_err(anyhow::Error::from)
        .and_then(|limit| match args.command {
            ScheduleCommand::Show(a) => show(a, &limit),
            ScheduleCommand::Validate(a) => validate_cmd(a, &limit),
            ScheduleCommand::Simulate(a) => report::simulate_cmd(a, &limit),
            ScheduleCommand::Compare(a) => report::compare_cmd(a, &limit),
            ScheduleCommand::Export(a) => export::export_cmd(a, &limit),
            ScheduleCommand::Auto(a) => auto::auto_cmd(a, &limit),
        });
    result.map_err(one_line)
}

/// The error's chain as one line: `context: cause: cause`, skipping a cause whose text
/// its parent already quotes (library errors often print their source), and folding
/// any line breaks, so the user reads exactly one `error: …` line.
fn one_line(e: anyhow::Error) -> anyhow::Error {
    let mut msg = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
        if text.is_empty() || msg.contains(&text) {
            continue;
        }
        if !msg.is_empty() {
            msg.push_str(": ");
        }
        msg.push_str(&text);
    }
    anyhow::anyhow!(msg)
}

fn show(args: ShowArgs, limit: &MemoryLimit) -> Result<()> {
    let loaded = args.plan.load(ACTION_BYTES, limit)?;
    let plan = maybe_lower(loaded.plan, args.lower)?;
    let text = match args.format {
        ShowFormat::Text => {
            let timeline = simulate(&plan, &CostModel::default())?;
            let show_stage = plan.stages > plan.num_ranks();
            let mut out = format!(
                "{}: {}\nunit costs: F = I = W = 1 column, B = 2, F+B = 3; blank = idle\n\n",
                loaded.name,
                describe_shape(&plan)
            );
            out.push_str(&grid(
                &timeline,
                &GridOptions {
                    unit: 1.0,
                    show_stage,
                },
            ));
            out.push_str(&format!(
                "\nmakespan {}, bubble ratio {}, steady bubble ratio {}\n",
                fmt_num(timeline.makespan, 3),
                fmt_num(timeline.bubble_ratio, 4),
                fmt_num(timeline.steady_bubble_ratio, 4)
            ));
            out
        }
        ShowFormat::Csv => to_csv(&plan),
        ShowFormat::Toml => to_toml(&plan),
        ShowFormat::Json => serde_json::to_string_pretty(&plan)? + "\n",
    };
    emit(&text)
}

fn validate_cmd(args: ValidateArgs, limit: &MemoryLimit) -> Result<()> {
    let spec = args.cost.spec()?;
    let loaded = args.plan.load(ACTION_BYTES, limit)?;
    let plan = &loaded.plan;
    let opts = ValidateOptions {
        cost: spec.model(plan)?,
        memory_limit: args.cost.memory_limit,
    };
    let v = validate(plan, &opts).with_context(|| loaded.name.clone())?;
    let comm = plan.iter().filter(|(_, _, a)| a.kind.is_comm()).count();
    let stage_rank: Vec<String> = plan.stage_rank.iter().map(usize::to_string).collect();
    let peaks: Vec<String> = v
        .peak_memory
        .iter()
        .enumerate()
        .map(|(r, m)| format!("rank {r}: {}", fmt_num(*m, 3)))
        .collect();
    let mut out = format!(
        "{}\nranks          {}\nstages         {} ({} per rank)\nmicro-batches  {}\n\
         placement      {} (stage → rank: {})\nactions        {} compute, {comm} send/recv\n",
        loaded.name,
        plan.num_ranks(),
        plan.stages,
        plan.stages_per_rank(),
        plan.microbatches,
        plan.placement.name(),
        stage_rank.join(" "),
        plan.num_actions() - comm,
    );
    out.push_str("valid\n");
    out.push_str(&format!(
        "peak memory    {} (units: mb = {}{})\n",
        peaks.join(", "),
        fmt_num(opts.cost.m_b, 3),
        match args.cost.memory_limit {
            Some(l) => format!(", limit {}", fmt_num(l, 3)),
            None => String::new(),
        }
    ));
    emit(&out)
}

/// The plan as given, or lowered (SEND/RECV inserted) when asked.
fn maybe_lower(plan: Plan, lower_it: bool) -> Result<Plan> {
    Ok(if lower_it { lower(&plan)? } else { plan })
}

/// The first rank whose peak memory exceeds `limit`, as the schedules crate's error.
fn check_memory(timeline: &Timeline, limit: Option<f64>) -> Result<(), ScheduleError> {
    let Some(limit) = limit else { return Ok(()) };
    match timeline.ranks.iter().find(|r| r.peak_memory > limit) {
        Some(r) => Err(ScheduleError::Memory {
            rank: r.rank,
            peak: r.peak_memory,
            limit,
        }),
        None => Ok(()),
    }
}

/// Writes `text` to stdout; a closed pipe (`… | head`) ends the output quietly.
fn emit(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("rank 0, step 1: {0}")]
    struct Quoting(#[source] std::fmt::Error);

    #[test]
    fn errors_become_one_line_without_repeats() {
        let e = anyhow::Error::new(Quoting(std::fmt::Error)).context("plan.csv");
        let text = one_line(e).to_string();
        assert_eq!(
            text,
            format!("plan.csv: rank 0, step 1: {}", std::fmt::Error)
        );
        let e = anyhow::anyhow!("line 3: expected\n  a table").context("f.toml");
        assert_eq!(one_line(e).to_string(), "f.toml: line 3: expected a table");
    }
}
