//! `simulate` and `compare`: the simulator's figures as a text table or as JSON.
//!
//! Per-rank figures follow DESIGN.md's definitions, read off the `Timeline`: a rank's
//! bubble ratio is idle / makespan, and its steady bubble ratio is 1 − busy / (max span
//! over ranks), so the overall ratios are exactly the means of the per-rank ones.

use anyhow::{Context, Result};
use pipefill::profile::fmt_num;
use pipefill_schedules::{ScheduleError, ScheduleKind, Timeline, generate, simulate};
use serde_json::{Value, json};

use super::cost::CostSpec;
use super::source::{ACTION_BYTES, PlanArgs, check_plan_size, describe_shape};
use super::{CostArgs, check_memory, emit, maybe_lower};
use pipefill::config::memory::MemoryLimit;

#[derive(clap::Args)]
pub(crate) struct SimulateArgs {
    #[command(flatten)]
    plan: PlanArgs,
    #[command(flatten)]
    cost: CostArgs,
    /// Simulate the lowered plan (SEND/RECV inserted, blocking transfers) instead of the
    /// compute-only one.
    #[arg(long)]
    lower: bool,
    /// Print one JSON object (makespan, bubble ratios, per-rank figures, bubble slots).
    #[arg(long)]
    json: bool,
    /// Also list every bubble slot (rank, start, length, the actions around it): the idle
    /// intervals filler work can be placed in.
    #[arg(long)]
    slots: bool,
}

#[derive(clap::Args)]
pub(crate) struct CompareArgs {
    /// Pipeline ranks (devices), P.
    #[arg(short = 'p', long, visible_alias = "ranks", value_name = "P")]
    stages: usize,
    /// Micro-batches per iteration, M.
    #[arg(short = 'm', long, value_name = "M")]
    microbatches: usize,
    /// Stages per rank for the multi-chunk schedules (interleaved-1f1b, looped-bfs, zb-v,
    /// dualpipe-v) [default: each one's own, 2]; the others always hold one stage per rank.
    #[arg(long, value_name = "V")]
    chunks: Option<usize>,
    /// `--cost` here is one rank's share of the model: a schedule with v stages per rank
    /// runs each at 1/v of f, i, w and stashes 1/v of mb, mw, so the rows compare the same
    /// model on the same ranks (per-stage lists are taken as given).
    #[command(flatten)]
    cost: CostArgs,
    /// Print a JSON array, one object per schedule.
    #[arg(long)]
    json: bool,
}

pub(crate) fn simulate_cmd(args: SimulateArgs, limit: &MemoryLimit) -> Result<()> {
    let spec = args.cost.spec()?;
    let loaded = args.plan.load(ACTION_BYTES, limit)?;
    let plan = maybe_lower(loaded.plan, args.lower)?;
    let timeline = simulate(&plan, &spec.model(&plan)?)?;
    check_memory(&timeline, args.cost.memory_limit).context(loaded.name.clone())?;
    if args.json {
        let mut v = timeline_json(&timeline);
        v["schedule"] = json!(loaded.name);
        v["num_ranks"] = json!(plan.num_ranks());
        v["stages"] = json!(plan.stages);
        v["microbatches"] = json!(plan.microbatches);
        v["placement"] = json!(plan.placement.name());
        v["cost"] = json!(spec.describe());
        return emit(&(serde_json::to_string_pretty(&v)? + "\n"));
    }
    let t = &timeline;
    let mut out = format!(
        "schedule             {} ({})\ncost                 {}\n\
         makespan             {}\n\
         bubble ratio         {}  (iterations separated by a barrier)\n\
         steady bubble ratio  {}  (consecutive iterations overlapped)\n\
         bubble slots         {}, {} time units idle in all\n\n",
        loaded.name,
        describe_shape(&plan),
        spec.describe(),
        fmt_num(t.makespan, 4),
        fmt_num(t.bubble_ratio, 4),
        fmt_num(t.steady_bubble_ratio, 4),
        t.slots.len(),
        fmt_num(t.bubble_time(), 4),
    );
    out.push_str("rank      busy      idle      span  bubble  steady  peak memory\n");
    let max_span = max_span(t);
    for r in &t.ranks {
        out.push_str(&format!(
            "{:>4}  {:>8}  {:>8}  {:>8}  {:>6}  {:>6}  {:>11}\n",
            r.rank,
            fmt_num(r.busy, 3),
            fmt_num(r.idle, 3),
            fmt_num(r.span, 3),
            format!("{:.4}", r.bubble_ratio),
            format!("{:.4}", steady_of(r.busy, max_span)),
            fmt_num(r.peak_memory, 3),
        ));
    }
    if args.slots {
        out.push_str("\nrank     start    length  between\n");
        let text = |a: Option<pipefill_schedules::Action>| {
            a.map_or_else(|| "-".to_string(), |a| a.to_string())
        };
        for slot in &t.slots {
            out.push_str(&format!(
                "{:>4}  {:>8}  {:>8}  {} → {}\n",
                slot.rank,
                fmt_num(slot.start, 3),
                fmt_num(slot.length, 3),
                text(slot.before),
                text(slot.after),
            ));
        }
    }
    emit(&out)
}

/// The longest span over ranks: the steady bubble ratio's denominator.
fn max_span(t: &Timeline) -> f64 {
    t.ranks.iter().map(|r| r.span).fold(0.0, f64::max)
}

/// A rank's share of the steady bubble: 1 − busy / max span.
fn steady_of(busy: f64, max_span: f64) -> f64 {
    if max_span > 0.0 {
        1.0 - busy / max_span
    } else {
        0.0
    }
}

/// The timeline's figures as JSON: makespan, both ratios, per-rank figures, bubble slots
/// (with the neighbouring actions in their text form).
pub(crate) fn timeline_json(t: &Timeline) -> Value {
    let max_span = max_span(t);
    let ranks: Vec<Value> = t
        .ranks
        .iter()
        .map(|r| {
            json!({
                "rank": r.rank,
                "busy": r.busy,
                "idle": r.idle,
                "span": r.span,
                "bubble_ratio": r.bubble_ratio,
                "steady_bubble_ratio": steady_of(r.busy, max_span),
                "peak_memory": r.peak_memory,
            })
        })
        .collect();
    let slots: Vec<Value> = t
        .slots
        .iter()
        .map(|s| {
            json!({
                "rank": s.rank,
                "start": s.start,
                "length": s.length,
                "before": s.before.map(|a| a.to_string()),
                "after": s.after.map(|a| a.to_string()),
            })
        })
        .collect();
    json!({
        "makespan": t.makespan,
        "bubble_ratio": t.bubble_ratio,
        "steady_bubble_ratio": t.steady_bubble_ratio,
        "bubble_time": t.bubble_time(),
        "ranks": ranks,
        "slots": slots,
    })
}

/// One schedule's row of `compare`.
struct Row {
    kind: ScheduleKind,
    chunks: usize,
    outcome: Result<Figures, String>,
}

struct Figures {
    makespan: f64,
    bubble_ratio: f64,
    steady_bubble_ratio: f64,
    peak_memory: f64,
    /// Set when the peak exceeds `--memory-limit`: the limit error's text.
    over_limit: Option<String>,
}

/// Stages per rank `compare` gives `kind`: `--chunks` for the multi-chunk families.
fn compare_chunks(kind: ScheduleKind, args: &CompareArgs) -> usize {
    match args.chunks {
        Some(v) if kind.default_chunks() > 1 => v,
        _ => kind.default_chunks(),
    }
}

/// Built-in `kind`'s simulated timeline under its share of `spec`, or why there is none.
pub(super) fn builtin_timeline(
    kind: ScheduleKind,
    p: usize,
    m: usize,
    chunks: usize,
    spec: &CostSpec,
) -> Result<Timeline, String> {
    let plan = generate(kind, p, m, chunks).map_err(|e| match e {
        ScheduleError::Unsupported { reason, .. } => format!("unsupported: {reason}"),
        e => format!("error: {e}"),
    })?;
    // Like for like: the cost describes a rank's share of the model, split over its chunks.
    let cost = spec
        .per_chunk(chunks)
        .model(&plan)
        .map_err(|e| format!("error: {e}"))?;
    simulate(&plan, &cost).map_err(|e| format!("error: {e}"))
}

fn compare_row(kind: ScheduleKind, args: &CompareArgs, spec: &CostSpec) -> Row {
    let chunks = compare_chunks(kind, args);
    let outcome = (|| -> Result<Figures, String> {
        let t = builtin_timeline(kind, args.stages, args.microbatches, chunks, spec)?;
        Ok(Figures {
            makespan: t.makespan,
            bubble_ratio: t.bubble_ratio,
            steady_bubble_ratio: t.steady_bubble_ratio,
            peak_memory: t.peak_memory(),
            over_limit: check_memory(&t, args.cost.memory_limit)
                .err()
                .map(|e| e.to_string()),
        })
    })();
    Row {
        kind,
        chunks,
        outcome,
    }
}

pub(crate) fn compare_cmd(args: CompareArgs, limit: &MemoryLimit) -> Result<()> {
    let spec = args.cost.spec()?;
    if args.stages == 0 {
        anyhow::bail!("--stages must be at least 1");
    }
    if args.microbatches == 0 {
        anyhow::bail!("--microbatches must be at least 1");
    }
    // Each schedule's plan is built, simulated and dropped in turn: each must fit, and the
    // costs must not overflow the largest (a row each would repeat the same error).
    for kind in ScheduleKind::ALL {
        let chunks = compare_chunks(kind, &args);
        check_plan_size(
            kind,
            args.stages,
            args.microbatches,
            chunks,
            ACTION_BYTES,
            limit,
        )?;
        spec.per_chunk(chunks)
            .check_overflow(args.stages.saturating_mul(chunks), args.microbatches)?;
    }
    let rows: Vec<Row> = ScheduleKind::ALL
        .into_iter()
        .map(|k| compare_row(k, &args, &spec))
        .collect();
    if args.json {
        let v: Vec<Value> = rows
            .iter()
            .map(|r| {
                let mut o = json!({ "schedule": r.kind.name(), "chunks": r.chunks });
                match &r.outcome {
                    Ok(f) => {
                        o["makespan"] = json!(f.makespan);
                        o["bubble_ratio"] = json!(f.bubble_ratio);
                        o["steady_bubble_ratio"] = json!(f.steady_bubble_ratio);
                        o["peak_memory"] = json!(f.peak_memory);
                        o["over_memory_limit"] = json!(f.over_limit);
                    }
                    Err(reason) => o["unsupported"] = json!(reason),
                }
                o
            })
            .collect();
        return emit(&(serde_json::to_string_pretty(&v)? + "\n"));
    }
    let mut out = format!(
        "p = {} ranks, m = {} micro-batches, cost {}\n\
         costs are one rank's share of the model: with v stages per rank each stage runs at \
         1/v of them and stashes 1/v of the activations\n\
         bubble: iterations separated by a barrier; steady: consecutive iterations overlapped\n\n\
         {:<17} {:>2}  {:>9}  {:>7}  {:>7}  {:>8}\n",
        args.stages,
        args.microbatches,
        spec.describe(),
        "schedule",
        "v",
        "makespan",
        "bubble",
        "steady",
        "peak mem",
    );
    for r in &rows {
        let line = match &r.outcome {
            Ok(f) => {
                let mut l = format!(
                    "{:<17} {:>2}  {:>9}  {:>7.4}  {:>7.4}  {:>8}",
                    r.kind.name(),
                    r.chunks,
                    fmt_num(f.makespan, 3),
                    f.bubble_ratio,
                    f.steady_bubble_ratio,
                    fmt_num(f.peak_memory, 3)
                );
                if let Some(e) = &f.over_limit {
                    l.push_str(&format!("  over --memory-limit: {e}"));
                }
                l
            }
            Err(reason) => format!("{:<17} {:>2}  {reason}", r.kind.name(), r.chunks),
        };
        out.push_str(&line);
        out.push('\n');
    }
    out.push_str(&best_lines(&rows));
    emit(&out)
}

/// The closing summary of `compare`: which runnable schedule (within the memory limit, if
/// any) has the lowest steady bubble, the lowest synchronous bubble and the lowest peak
/// memory. Ties go to the schedule listed first.
fn best_lines(rows: &[Row]) -> String {
    let fit: Vec<(&Row, &Figures)> = rows
        .iter()
        .filter_map(|r| r.outcome.as_ref().ok().map(|f| (r, f)))
        .filter(|(_, f)| f.over_limit.is_none())
        .collect();
    if fit.is_empty() {
        return "\nno schedule runs for this shape within the limits\n".to_string();
    }
    let best = |key: fn(&Figures) -> f64| {
        fit.iter()
            .copied()
            .reduce(|a, b| if key(b.1) < key(a.1) { b } else { a })
            .map(|(r, f)| (r.kind.name(), key(f)))
            .unwrap_or(("-", 0.0))
    };
    let (steady, s) = best(|f| f.steady_bubble_ratio);
    let (sync, b) = best(|f| f.bubble_ratio);
    let (mem, m) = best(|f| f.peak_memory);
    format!(
        "\nlowest steady bubble: {steady} ({s:.4}); lowest bubble: {sync} ({b:.4}); \
         lowest peak memory: {mem} ({})\n",
        fmt_num(m, 3)
    )
}
