//! The profiling files of a pipelined run's directory:
//!
//! - `metrics.jsonl` lines ([`crate::run::StepLine`], written by the caller): the step's
//!   metrics plus tokens/s, the step's measured bubble ratios and, with a filler, the share of its waits that filler work used
//!   and the drafter's progress (its held-out agreement every few steps: the curve of its
//!   training);
//! - `report.txt` / `report.json`: the bubble report of one steady-state step, measured next
//!   to the simulator's prediction under the measured costs
//!   ([`crate::profile::report`]), with the filler's bubble-fill ratio, step inflation
//!   (each step replayed without its fillers; against separate runs without filler in
//!   `pipefill bench filler`) and the drafter's final agreement;
//! - `trace.json`: the Chrome/Perfetto trace of the whole run, one process per rank, with
//!   lanes for compute, bubbles (idle slots of the measured timeline) and the runtime's
//!   measured waits for input (communication);
//! - `timeline.svg`: the reported step's timeline, in milliseconds.

use std::path::Path;

use crate::config::JobConfig;
use crate::pipeline::{Clock, PipelineRun};
use crate::profile::LaneSpan;
use crate::profile::chrome::{ChromeOptions, write_chrome_trace};
use crate::profile::report::{
    ActionCosts, BubbleReport, Filling, RunInfo, WorkFigures, action_costs, median_step_makespan,
    steady_iteration, step_inflations,
};
use crate::profile::svg::{SvgOptions, svg_with};
use crate::run::RunError;
use crate::run::show::Show;
use pipefill_actors::IterationProfile;

/// Name of the lane holding the runtime's measured waits for input.
const WAIT_LANE: &str = "waiting for input";
/// Name of the lane holding filler work run inside bubbles.
const FILLER_LANE: &str = "filler";

/// The filler figures of `run` over the whole run, with the median step makespan of a run
/// without filler (`baseline`: its per-step makespans, how it ran and its compute-action
/// costs; `pipefill bench filler`'s) when one was measured; what could not be measured is a
/// warning on `show`.
pub(super) fn filling(
    job: &JobConfig,
    run: &PipelineRun,
    baseline: Option<(&[f64], String, &ActionCosts)>,
    show: &mut dyn Show,
) -> Option<Filling> {
    let drafter = run.drafter.as_ref()?;
    let spans = run.filler_spans();
    let makespans: Vec<f64> = run.timelines().map(|t| t.makespan).collect();
    let name = format!("{:?}", job.filler).to_lowercase();
    let mut f = Filling::measure(&name, &run.report.overall, &spans).with_baseline(
        median_step_makespan(&makespans).unwrap_or(0.0),
        baseline
            .as_ref()
            .and_then(|(m, note, _)| Some((median_step_makespan(m)?, note.clone()))),
    );
    if let Some((_, _, without)) = baseline {
        f = f.with_action_costs(&action_costs(&run.report.iterations), without);
    }
    // Virtual clock: each step against itself replayed without fillers (no load noise).
    if let Clock::Virtual { link_latency } = run.report.clock {
        match step_inflations(&run.report.iterations, link_latency) {
            Ok(per_step) => f = f.with_replay(&per_step),
            Err(e) => show.line(&format!("warning: step inflation not replayed: {e}")),
        }
    }
    f.drafter_version = drafter.agreement.last().map(|a| a.1);
    f.work = drafter
        .router
        .kinds
        .iter()
        .map(|(kind, k)| WorkFigures {
            kind: kind.clone(),
            slices: k.slices,
            seconds: k.seconds,
            estimate: k.estimate.mean,
            overran: k.overran,
            failed: k.failed,
        })
        .collect();
    Some(f)
}

/// Writes `report.json`, `report.txt`, `trace.json` and `timeline.svg` of `run` into `dir`
/// and returns the report.
pub(super) fn write_profile(
    dir: &Path,
    job: &JobConfig,
    run: &PipelineRun,
    filling: Option<Filling>,
) -> Result<BubbleReport, RunError> {
    let clock = job.clock.name();
    let iterations = &run.report.iterations;
    let makespans: Vec<f64> = iterations.iter().map(|i| i.timeline.makespan).collect();
    let first_step = run.next_step() - iterations.len() as u64;
    let Some((index, note)) = steady_iteration(&makespans, first_step) else {
        return Err(RunError::NoStepMeasured);
    };
    // Mean costs after the warm-up step predict busy time (a sum of costs) without the
    // medians' bias; the runtime's median model is the fallback.
    let skip = usize::from(iterations.len() > 1);
    let (predicted, cost_basis) = match run.mean_cost(skip) {
        Some(cost) => (
            run.predict(&cost)?,
            format!(
                "mean per-stage costs measured over steps {}–{}",
                first_step + skip as u64,
                run.next_step() - 1
            ),
        ),
        None => match &run.predicted {
            Some(p) => (
                p.clone(),
                "median per-stage costs the runtime measured".into(),
            ),
            None => return Err(RunError::NoCosts),
        },
    };
    let step = first_step as usize + index;
    let measured = &iterations[index];
    let info = RunInfo {
        schedule: job.schedule.to_string(),
        clock: clock.to_string(),
        stages: run.plan.stages,
        microbatches: run.plan.microbatches,
        steps: run.next_step(),
        units: "s".into(),
        iteration: step,
        iteration_note: note,
        cost_basis,
    };
    let mut report = BubbleReport::new(info, &measured.timeline, &predicted)?
        .with_whole_run(&run.report.overall, iterations.len());
    if let Some(f) = filling {
        let agreement = run
            .drafter
            .as_ref()
            .and_then(|d| d.agreement.last())
            .map(|a| a.2);
        report = report.with_filling(f, agreement);
    }
    report.write(dir)?;

    // The trace covers the whole run; times are seconds, trace events microseconds.
    let mut extra = Vec::new();
    for it in iterations {
        extra.extend(lane_spans(it));
    }
    let path = dir.join("trace.json");
    let file = std::fs::File::create(&path).map_err(|e| RunError::write(&path, e))?;
    write_chrome_trace(
        file,
        &run.report.overall,
        &extra,
        &ChromeOptions {
            us_per_unit: 1e6,
            bubbles: true,
            ..ChromeOptions::default()
        },
    )
    .map_err(|e| RunError::write(&path, e))?;

    // The picture shows the reported step in milliseconds, with the filler work (if any)
    // along the bottom of each lane. Waits are left out: they are the bubbles themselves.
    let timeline_ms = measured.timeline.rescaled(0.0, 1e3);
    let fillers: Vec<LaneSpan> = lane_spans(measured)
        .filter(|l| l.lane == FILLER_LANE)
        .map(|l| l.rescaled(0.0, 1e3))
        .collect();
    let title = report.timeline_title(&format!(
        "{} · {} ranks · {} micro-batches · step {step} measured ({clock} clock) · ms",
        report.info.schedule, report.ranks_count, report.info.microbatches,
    ));
    let svg = svg_with(
        &timeline_ms,
        &fillers,
        &SvgOptions {
            title: Some(title),
            show_stage: run.plan.stages_per_rank() > 1,
            ..SvgOptions::default()
        },
    );
    let path = dir.join("timeline.svg");
    std::fs::write(&path, svg).map_err(|e| RunError::write(&path, e))?;
    Ok(report)
}

/// The runtime's measured waits and filler work of one step, as extra lanes.
fn lane_spans(it: &IterationProfile) -> impl Iterator<Item = LaneSpan> + '_ {
    let waits = it.bubbles.iter().map(|b| LaneSpan {
        rank: b.rank,
        lane: WAIT_LANE.into(),
        start: b.start,
        end: b.end,
        label: format!("wait for {}", b.waiting_for),
    });
    let fillers = it.fillers.iter().map(|f| LaneSpan {
        rank: f.rank,
        lane: FILLER_LANE.into(),
        start: f.start,
        end: f.end,
        label: f.label.clone(),
    });
    waits.chain(fillers)
}
