//! The bubble report of a training run: per rank busy time, bubble time and bubble ratio as
//! measured, next to what the schedule simulator predicts for the same plan under the
//! costs the run measured.
//!
//! A run writes the report twice into its run directory: `report.json` (the
//! [`BubbleReport`] itself, for programs) and `report.txt` (its [`BubbleReport::to_text`],
//! for people). `pipefill profile RUN_DIR` reads `report.json` back and prints the same text,
//! so the text is a pure function of the JSON and the two can never disagree.
//!
//! Which timeline the report describes: one steady-state iteration, chosen by
//! [`steady_iteration`] (the iteration of median makespan, the first iteration excluded since
//! it warms caches and allocators). The header says which one. The figures follow DESIGN.md's
//! "Metrics" section: they are copied from [`Timeline`]s built by `Timeline::from_spans`, the
//! one implementation of those definitions; this module never recomputes a metric. A
//! closing line gives the whole run's figures (every step's timeline together), when known.
//! A run with filler work adds its bubble-fill ratio, step inflation and drafter agreement
//! (`fill`); its step inflation comes from replaying each filled step without its
//! fillers ([`replay`]).

mod fill;
mod replay;

use crate::profile::ProfileError;
pub use fill::{
    ActionCosts, CostChange, FillerSpan, Filling, RankFill, WorkFigures, action_costs, median,
    median_step_makespan,
};
pub use replay::{replay, replay_makespans, step_inflations};

use std::fmt::Write as _;
use std::path::Path;

use pipefill_schedules::Timeline;
use serde::{Deserialize, Serialize};

/// File name of the machine-readable report in a run directory.
pub const REPORT_JSON: &str = "report.json";
/// File name of the human-readable report in a run directory.
pub const REPORT_TXT: &str = "report.txt";

/// What the report is about, besides the timelines themselves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    /// The schedule's name (`zb-h1`) or the custom schedule file's path.
    pub schedule: String,
    /// `virtual` or `wall`.
    pub clock: String,
    /// Pipeline stages (model chunks) of the plan.
    pub stages: usize,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// Optimizer steps the run made.
    pub steps: u64,
    /// Unit of every time figure (`s` for a measured run, `units` for cost units).
    pub units: String,
    /// The 0-based step whose timeline the report describes.
    pub iteration: usize,
    /// Why that step (see [`steady_iteration`]).
    pub iteration_note: String,
    /// Which measured costs the prediction simulates the plan under (`mean per-stage costs
    /// measured over steps 1–399`).
    pub cost_basis: String,
}

/// One rank's figures, measured and predicted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankFigures {
    pub rank: usize,
    /// Sum of the rank's compute actions.
    pub busy: f64,
    /// makespan − busy.
    pub bubble: f64,
    /// bubble / makespan.
    pub bubble_ratio: f64,
    /// From the rank's first action's start to its last action's end.
    pub span: f64,
    pub predicted_busy: f64,
    pub predicted_bubble: f64,
    pub predicted_bubble_ratio: f64,
}

/// The report: one measured steady-state iteration next to the simulator's prediction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BubbleReport {
    #[serde(flatten)]
    pub info: RunInfo,
    pub ranks_count: usize,
    pub makespan: f64,
    /// Synchronous bubble ratio, measured.
    pub bubble_ratio: f64,
    /// Steady (overlapping iterations) bubble ratio, measured.
    pub steady_bubble_ratio: f64,
    pub predicted_makespan: f64,
    pub predicted_bubble_ratio: f64,
    pub predicted_steady_bubble_ratio: f64,
    pub ranks: Vec<RankFigures>,
    /// The whole run's measured figures, when the run gave its all-steps timeline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub whole_run: Option<WholeRun>,
    /// Filler work in the bubbles, per rank, over the whole run (runs with a filler).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filling: Option<Filling>,
    /// Filled / bubble time over the whole run and every rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bubble_fill_ratio: Option<f64>,
    /// Step makespan with fillers / without − 1: under the virtual clock the critical-path
    /// inflation of the run replayed without its fillers, else against a separate run
    /// ([`Filling::step_inflation`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_inflation: Option<f64>,
    /// The drafter's top-1 agreement with the target on held-out rows, at the end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter_agreement: Option<f64>,
}

/// The measured timeline of every step of a run together: what the steps cost one after
/// the other, including whatever separates them (a barrier, the optimizer step).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WholeRun {
    /// Steps the timeline covers.
    pub steps: usize,
    pub makespan: f64,
    pub bubble_ratio: f64,
    pub steady_bubble_ratio: f64,
}

impl BubbleReport {
    /// The SVG timeline's title: `head` (what was measured) over a line of both bubble
    /// ratios, measured and predicted.
    pub fn timeline_title(&self, head: &str) -> String {
        format!(
            "{head}\nbubble ratio {:.1}% (predicted {:.1}%) · steady {:.1}% (predicted {:.1}%)",
            100.0 * self.bubble_ratio,
            100.0 * self.predicted_bubble_ratio,
            100.0 * self.steady_bubble_ratio,
            100.0 * self.predicted_steady_bubble_ratio,
        )
    }

    /// The report of `measured` next to `predicted` (same ranks, same plan).
    pub fn new(
        info: RunInfo,
        measured: &Timeline,
        predicted: &Timeline,
    ) -> Result<Self, ProfileError> {
        if measured.ranks.len() != predicted.ranks.len() {
            return Err(ProfileError::RankMismatch {
                measured: measured.ranks.len(),
                predicted: predicted.ranks.len(),
            });
        }
        let ranks = measured
            .ranks
            .iter()
            .zip(&predicted.ranks)
            .map(|(m, p)| RankFigures {
                rank: m.rank,
                busy: m.busy,
                bubble: m.idle,
                bubble_ratio: m.bubble_ratio,
                span: m.span,
                predicted_busy: p.busy,
                predicted_bubble: p.idle,
                predicted_bubble_ratio: p.bubble_ratio,
            })
            .collect();
        Ok(BubbleReport {
            info,
            ranks_count: measured.ranks.len(),
            makespan: measured.makespan,
            bubble_ratio: measured.bubble_ratio,
            steady_bubble_ratio: measured.steady_bubble_ratio,
            predicted_makespan: predicted.makespan,
            predicted_bubble_ratio: predicted.bubble_ratio,
            predicted_steady_bubble_ratio: predicted.steady_bubble_ratio,
            ranks,
            whole_run: None,
            filling: None,
            bubble_fill_ratio: None,
            step_inflation: None,
            drafter_agreement: None,
        })
    }

    /// Adds the filler figures of the run and the drafter's last held-out agreement.
    pub fn with_filling(mut self, filling: Filling, drafter_agreement: Option<f64>) -> Self {
        self.bubble_fill_ratio = Some(filling.fill_ratio());
        self.step_inflation = filling.step_inflation();
        self.drafter_agreement = drafter_agreement;
        self.filling = Some(filling);
        self
    }

    /// Adds the figures of `overall`, the measured timeline of all `steps` steps together.
    pub fn with_whole_run(mut self, overall: &Timeline, steps: usize) -> Self {
        self.whole_run = Some(WholeRun {
            steps,
            makespan: overall.makespan,
            bubble_ratio: overall.bubble_ratio,
            steady_bubble_ratio: overall.steady_bubble_ratio,
        });
        self
    }

    /// The report as people read it (`report.txt`, `pipefill profile`).
    ///
    /// Times in seconds are shown in milliseconds; ratios as percentages.
    pub fn to_text(&self) -> String {
        let i = &self.info;
        let (scale, unit) = display_unit(&i.units);
        let t = |x: f64| fmt_fixed(x * scale, 3);
        let pct = |x: f64| format!("{}%", fmt_fixed(100.0 * x, 1));
        let mut out = String::new();
        let _ = writeln!(
            out,
            "bubble report: schedule {}, {} stages on {} ranks, {} micro-batches, {} steps, {} clock",
            i.schedule, i.stages, self.ranks_count, i.microbatches, i.steps, i.clock
        );
        let _ = writeln!(
            out,
            "timeline: step {} ({}); times in {unit}",
            i.iteration, i.iteration_note
        );
        let _ = writeln!(
            out,
            "predicted: the schedule simulator on the same plan under the {}",
            i.cost_basis
        );
        let _ = writeln!(out);
        // Group labels centred over their three columns (12 + 12 + 9 wide).
        let _ = writeln!(out, "{:<6}{:^33}   {:^33}", "", "measured", "predicted");
        let _ = writeln!(
            out,
            "{:<6}{:>12}{:>12}{:>9}   {:>12}{:>12}{:>9}",
            "rank", "busy", "bubble", "ratio", "busy", "bubble", "ratio"
        );
        for r in &self.ranks {
            let _ = writeln!(
                out,
                "{:<6}{:>12}{:>12}{:>9}   {:>12}{:>12}{:>9}",
                r.rank,
                t(r.busy),
                t(r.bubble),
                pct(r.bubble_ratio),
                t(r.predicted_busy),
                t(r.predicted_bubble),
                pct(r.predicted_bubble_ratio)
            );
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "{:<22}{:>12}{:>12}", "", "measured", "predicted");
        let _ = writeln!(
            out,
            "{:<22}{:>12}{:>12}",
            format!("makespan ({unit})"),
            t(self.makespan),
            t(self.predicted_makespan)
        );
        let _ = writeln!(
            out,
            "{:<22}{:>12}{:>12}",
            "bubble ratio",
            pct(self.bubble_ratio),
            pct(self.predicted_bubble_ratio)
        );
        let _ = writeln!(
            out,
            "{:<22}{:>12}{:>12}",
            "steady bubble ratio",
            pct(self.steady_bubble_ratio),
            pct(self.predicted_steady_bubble_ratio)
        );
        if let Some(w) = &self.whole_run {
            let _ = writeln!(
                out,
                "whole run, {} steps measured: makespan {} {unit}, bubble ratio {}, steady {}",
                w.steps,
                t(w.makespan),
                pct(w.bubble_ratio),
                pct(w.steady_bubble_ratio)
            );
        }
        if let Some(f) = &self.filling {
            let _ = writeln!(out);
            f.write_text(&mut out, unit, self.drafter_agreement, &t, &pct);
            let _ = writeln!(out);
        }
        let _ = writeln!(
            out,
            "bubble ratio: Σ(makespan − busy) / (ranks × makespan), steps apart (a barrier);\n\
             steady bubble ratio: 1 − Σ busy / (ranks × max span), steps overlapping;\n\
             busy: a rank's compute time; bubble: makespan − busy (DESIGN.md, \"Metrics\")"
        );
        out
    }

    /// The report as pretty-printed JSON (`report.json`).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report always serializes") + "\n"
    }

    /// Parses `report.json`'s text; `path` labels errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self, ProfileError> {
        serde_json::from_str(text).map_err(|e| ProfileError::Corrupt {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// Writes `report.json` and `report.txt` into `dir` (which must exist).
    pub fn write(&self, dir: &Path) -> Result<(), ProfileError> {
        for (name, text) in [(REPORT_JSON, self.to_json()), (REPORT_TXT, self.to_text())] {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|error| ProfileError::Write { path, error })?;
        }
        Ok(())
    }

    /// Reads the report of the run directory `dir` back from its `report.json`.
    pub fn read(dir: &Path) -> Result<Self, ProfileError> {
        if !dir.is_dir() {
            return Err(ProfileError::NoRunDir {
                path: dir.to_path_buf(),
            });
        }
        let path = dir.join(REPORT_JSON);
        let text = crate::input::read_text(&path, MAX_REPORT_BYTES, "a bubble report")?;
        Self::from_json(&text, &path)
    }
}

/// The largest `report.json` read back: a report holds one step's timelines, a few MB at
/// thousands of actions.
const MAX_REPORT_BYTES: u64 = 256 << 20;

/// Seconds are shown as milliseconds (step times of a small model are a few ms); any other
/// unit as it is.
fn display_unit(units: &str) -> (f64, &str) {
    match units {
        "s" => (1e3, "ms"),
        other => (1.0, other),
    }
}

/// `x` with exactly `decimals` digits after the point (a table's columns line up); `-0`
/// prints as `0`.
fn fmt_fixed(x: f64, decimals: usize) -> String {
    let s = format!("{x:.decimals$}");
    if s.trim_start_matches('-')
        .chars()
        .all(|c| c == '0' || c == '.')
    {
        s.trim_start_matches('-').to_string()
    } else {
        s
    }
}

/// The step whose timeline best shows the steady state of a run whose steps
/// `first_step, first_step + 1, …` had these makespans: the median makespan among every
/// step but the first (which warms caches and allocators), or the first when it is the only
/// one. Returns the index into `makespans` and a note naming the steps it was chosen from.
///
/// `None` when there are no steps.
pub fn steady_iteration(makespans: &[f64], first_step: u64) -> Option<(usize, String)> {
    let n = makespans.len();
    let note = match n {
        0 => return None,
        1 => return Some((0, "the only step measured".to_string())),
        2 => format!("the only step after step {first_step}, which warms up"),
        _ => format!(
            "median makespan of steps {}–{}; step {first_step} warms up",
            first_step + 1,
            first_step + n as u64 - 1
        ),
    };
    let mut order: Vec<usize> = (1..n).collect();
    order.sort_by(|&a, &b| makespans[a].total_cmp(&makespans[b]).then(a.cmp(&b)));
    Some((order[(order.len() - 1) / 2], note))
}

#[cfg(test)]
mod tests;
