//! `pipefill schedule auto`: the auto-scheduler's plan for a pipeline shape, a cost model and
//! a memory limit, next to every built-in schedule's figures (or, with `--json`, the same
//! object `schedule simulate --json` prints, for the auto plan).
//!
//! As in `compare`, `--cost` is one rank's share of the model: a plan with `v` stages per
//! rank runs each at `1/v` of it and stashes `1/v` of the activations (per-stage lists are
//! taken as given), so every row is the same model on the same ranks.

use anyhow::{Result, bail};
use clap::ValueEnum;
use pipefill::model::{GptConfig, Recompute};
use pipefill::profile::fmt_num;
use pipefill_schedules::{
    Origin, Placement, Plan, Recomputation, ScheduleError, ScheduleKind, Timeline, auto_recomputing,
};
use serde_json::json;

use super::report::{builtin_timeline, timeline_json};
use super::source::{ACTION_BYTES, check_plan_size, describe_shape};
use super::{CostArgs, check_memory, emit};
use pipefill::config::memory::MemoryLimit;

/// Activation recomputation of the auto plan (`--recompute`).
#[derive(Clone, Copy, Debug, Default, ValueEnum)]
enum RecomputeArg {
    /// None.
    #[default]
    None,
    /// Attention's probabilities and output recomputed on every I.
    Selective,
    /// Each block's forward recomputed on every I (only its input kept).
    Full,
    /// None when a plan fits the memory limit without, else the first of selective and
    /// full with which one does.
    Auto,
}

/// What recomputing `mode` costs and saves, as shares of a stage's forward, for the
/// default `[model]` (its layers' stash sizes and multiply-adds at its `seq_len`).
fn recomputation(mode: Recompute) -> Recomputation {
    let model = GptConfig::default();
    mode.recomputation(&model, model.seq_len)
}

/// Where the auto plan's stages live (`--placement`).
#[derive(Clone, Copy, Debug, ValueEnum)]
enum PlacementArg {
    /// Rank r holds stages r·v .. (r+1)·v.
    Contiguous,
    /// Stage s lives on rank s mod p (interleaved 1F1B's).
    Looped,
    /// Two stages per rank, r and 2p − 1 − r (ZB-V's).
    VShape,
}

#[derive(clap::Args)]
#[command(after_help = "\
--cost is one rank's share of the model, as in `compare`: with V stages per rank each stage
runs at 1/V of f, i, w and stashes 1/V of mb, mw (per-stage lists are taken as given).
--memory-limit bounds every rank's peak activation memory; without it memory is unlimited.
--recompute shares are the default [model]'s: with recomputation a forward keeps that share
of mb (mw, what I keeps for W, does not change) and every I reruns that share of f.")]
pub(crate) struct AutoArgs {
    /// Pipeline ranks (devices), P.
    #[arg(short = 'p', long, visible_alias = "ranks", value_name = "P")]
    stages: usize,
    /// Micro-batches per iteration, M.
    #[arg(short = 'm', long, value_name = "M")]
    microbatches: usize,
    /// Stages (model chunks) per rank of the auto plan, V.
    #[arg(long, value_name = "V", default_value_t = 1)]
    chunks: usize,
    /// Placement of the auto plan's stages [default: contiguous for V = 1, v-shape for
    /// V = 2, looped otherwise].
    #[arg(long, value_enum)]
    placement: Option<PlacementArg>,
    #[command(flatten)]
    cost: CostArgs,
    /// Activation recomputation on every stage: `auto` turns it on only when no plan fits
    /// `--memory-limit` without it.
    #[arg(long, value_enum, default_value = "none")]
    recompute: RecomputeArg,
    /// Print the auto plan's figures as `schedule simulate --json` does.
    #[arg(long)]
    json: bool,
}

pub(crate) fn auto_cmd(args: AutoArgs, limit: &MemoryLimit) -> Result<()> {
    let spec = args.cost.spec()?;
    let (p, m, v) = (args.stages, args.microbatches, args.chunks);
    if p == 0 || m == 0 || v == 0 {
        bail!("--stages, --microbatches and --chunks must be at least 1");
    }
    // The search holds a few candidate plans (F, I and W each) at once; the built-ins after
    // it are built one at a time.
    check_plan_size(ScheduleKind::ZbH1, p, m, v, AUTO_ACTION_BYTES, limit)?;
    for kind in ScheduleKind::ALL {
        check_plan_size(kind, p, m, builtin_chunks(kind, v), ACTION_BYTES, limit)?;
    }
    let placement = match args.placement {
        Some(PlacementArg::Contiguous) => Placement::Contiguous,
        Some(PlacementArg::Looped) => Placement::Looped,
        Some(PlacementArg::VShape) => Placement::VShape,
        None if v == 1 => Placement::Contiguous,
        None if v == 2 => Placement::VShape,
        None => Placement::Looped,
    };
    let limit = args.cost.memory_limit.unwrap_or(f64::INFINITY);
    // The shape only carries the stage count the cost lists are checked against.
    let shape = Plan::new(p, p * v, m, placement.clone());
    let modes: Vec<Recompute> = match args.recompute {
        RecomputeArg::None => vec![],
        RecomputeArg::Selective => vec![Recompute::Selective],
        RecomputeArg::Full => vec![Recompute::Full],
        RecomputeArg::Auto => vec![Recompute::Selective, Recompute::Full],
    };
    let offered: Vec<Recomputation> = modes.iter().map(|&m| recomputation(m)).collect();
    let forced = !matches!(args.recompute, RecomputeArg::None | RecomputeArg::Auto);
    // A mode asked for is the cost model; `auto` offers them when the plain one fails.
    let (base, offered) = match forced {
        true => (spec.recomputed(&offered[0]), vec![]),
        false => (spec.clone(), offered),
    };
    let auto_spec = base.per_chunk(v);
    let cost = auto_spec.model(&shape)?;
    let found = auto_recomputing(&cost, p, m, v, placement, limit, &offered)?;
    let chosen = match (forced, found.recompute) {
        (true, _) => Some(recomputation(modes[0])),
        (false, Some(i)) => Some(offered[i].clone()),
        (false, None) => None,
    };
    // The built-ins are timed with the same recomputation as the plan.
    let spec = match (&chosen, forced) {
        (Some(r), false) => spec.recomputed(r),
        _ => base,
    };
    let auto_spec = spec.per_chunk(v);
    let found = found.auto;
    let plan = &found.plan;
    if args.json {
        let mut j = timeline_json(&found.timeline);
        j["schedule"] = json!("auto");
        j["num_ranks"] = json!(plan.num_ranks());
        j["stages"] = json!(plan.stages);
        j["microbatches"] = json!(plan.microbatches);
        j["placement"] = json!(plan.placement.name());
        j["cost"] = json!(auto_spec.describe());
        // Only with recomputation: otherwise the object is simulate's, key for key.
        if let Some(r) = &chosen {
            j["recompute"] = json!(r.name);
        }
        return emit(&(serde_json::to_string_pretty(&j)? + "\n"));
    }

    let limit_text = match args.cost.memory_limit {
        Some(l) => fmt_num(l, 3),
        None => "none".into(),
    };
    let origin = match found.origin {
        Origin::Greedy => "the greedy list scheduler".to_string(),
        Origin::Search => "the search over the greedy plans".to_string(),
        Origin::Builtin(kind) => format!("{kind} (nothing built beat it)"),
    };
    let recompute = match &chosen {
        None => "none".to_string(),
        Some(r) => format!(
            "{} (a forward keeps {:.1}% of mb, every I reruns {:.1}% of f)",
            r.name,
            100.0 * r.keep,
            100.0 * r.rerun
        ),
    };
    let mut out = format!(
        "auto: {}\ncost {} (one rank's share), memory limit {limit_text}\n\
         recompute: {recompute}\nfound by {origin}, {} plans simulated\n\n",
        describe_shape(plan),
        spec.describe(),
        found.evaluated,
    );
    for (r, list) in plan.ranks.iter().enumerate() {
        let actions: Vec<String> = list.iter().flatten().map(|a| a.to_string()).collect();
        out.push_str(&format!("rank {r}: {}\n", actions.join(" ")));
    }
    out.push_str(&format!(
        "\nbubble: iterations separated by a barrier; steady: consecutive iterations overlapped\n\n\
         {:<17} {:>2}  {:>9}  {:>7}  {:>7}  {:>8}\n",
        "schedule", "v", "makespan", "bubble", "steady", "peak mem"
    ));
    out.push_str(&row("auto", v, Ok(&found.timeline), None));
    for kind in ScheduleKind::ALL {
        let chunks = builtin_chunks(kind, v);
        let outcome = builtin_timeline(kind, p, m, chunks, &spec);
        let over = outcome
            .as_ref()
            .ok()
            .and_then(|t| check_memory(t, args.cost.memory_limit).err());
        out.push_str(&row(kind.name(), chunks, outcome.as_ref(), over));
    }
    emit(&out)
}

/// Bytes per action of the auto plan's search: the greedy scheduler's and the search's
/// candidates held at once.
const AUTO_ACTION_BYTES: u64 = 4 * ACTION_BYTES;

/// Stages per rank of built-in `kind` next to an auto plan of `v`: `v` for the multi-chunk
/// families when `v > 1`, each kind's own otherwise.
fn builtin_chunks(kind: ScheduleKind, v: usize) -> usize {
    if kind.default_chunks() > 1 && v > 1 {
        v
    } else {
        kind.default_chunks()
    }
}

/// One line of the table: the figures, or the reason there are none.
fn row(
    name: &str,
    chunks: usize,
    outcome: Result<&Timeline, &String>,
    over: Option<ScheduleError>,
) -> String {
    let mut line = match outcome {
        Ok(t) => format!(
            "{name:<17} {chunks:>2}  {:>9}  {:>7.4}  {:>7.4}  {:>8}",
            fmt_num(t.makespan, 3),
            t.bubble_ratio,
            t.steady_bubble_ratio,
            fmt_num(t.peak_memory(), 3)
        ),
        Err(reason) => format!("{name:<17} {chunks:>2}  {reason}"),
    };
    if let Some(e) = over {
        line.push_str(&format!("  over --memory-limit: {e}"));
    }
    line.push('\n');
    line
}
