//! The filler part of a bubble report: how much of the bubbles filler work used, what it
//! cost the step, and how well the drafter it trained agrees with the target.
//!
//! Definitions (DESIGN.md, "Metrics"):
//! - a rank's **bubble** time is the total length of its bubble slots in the measured
//!   timeline of the whole run (its idle intervals inside the makespan);
//! - its **filled** time is the filler work that lies inside those slots;
//! - **bubble-fill ratio** = filled / bubble, per rank and over all ranks;
//! - **step inflation** = step makespan with fillers / without − 1, "without" being a
//!   separate run of the same job with `filler = "none"` (median step makespans compared, see
//!   [`median_step_makespan`]); it also measures how differently loaded the machine was.
//!   Under the virtual clock a second figure replays each filled step without its fillers
//!   (same actions, same measured costs, see [`super::replay`]): free of load noise, but an
//!   upper bound for now, because the replay does not model a rank's wait for the previous
//!   optimizer step's statistics, so it comes out short of an unfilled step's makespan (by up
//!   to ~1.5% measured on zb-h1).

use std::fmt::Write as _;

use pipefill_schedules::Timeline;
use serde::{Deserialize, Serialize};

/// One rank's bubble and filled time over the whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankFill {
    pub rank: usize,
    pub bubble: f64,
    pub filled: f64,
    /// filled / bubble (0 when the rank had no bubble).
    pub fill_ratio: f64,
}

/// Filler work over a whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Filling {
    /// What ran in the bubbles (`drafter`).
    pub filler: String,
    pub ranks: Vec<RankFill>,
    pub bubble: f64,
    pub filled: f64,
    /// Median step makespan of this run and of the run without fillers (seconds).
    pub step_makespan: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_step_makespan: Option<f64>,
    /// How the baseline was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_note: Option<String>,
    /// Median over the steps after the first of each step's makespan / its replay without
    /// fillers − 1 (virtual clock only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_inflation: Option<f64>,
    /// Each kind of filler work: slices run, their time and cost estimate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub work: Vec<WorkFigures>,
    /// Drafter steps taken when the agreement was last measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter_version: Option<u64>,
}

/// What the router did for one kind of filler work.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkFigures {
    pub kind: String,
    pub slices: u64,
    /// Their measured time in all.
    pub seconds: f64,
    /// The running estimate of one slice's cost at the end (mean).
    pub estimate: f64,
    /// Slices that ran longer than the idle time they were handed out for.
    pub overran: u64,
    pub failed: u64,
}

/// A measured filler span: `(rank, start, end)`.
pub type FillerSpan = (usize, f64, f64);

impl Filling {
    /// Bubble and filled time per rank of `overall`, the whole run's measured timeline, with
    /// `fillers` the filler spans of every step.
    pub fn measure(filler: &str, overall: &Timeline, fillers: &[FillerSpan]) -> Self {
        let ranks: Vec<RankFill> = (0..overall.ranks.len())
            .map(|rank| {
                let slots: Vec<(f64, f64)> = overall
                    .slots
                    .iter()
                    .filter(|s| s.rank == rank)
                    .map(|s| (s.start, s.start + s.length))
                    .collect();
                let bubble: f64 = slots.iter().map(|(a, b)| b - a).sum();
                let filled: f64 = fillers
                    .iter()
                    .filter(|f| f.0 == rank)
                    .map(|&(_, fs, fe)| {
                        slots
                            .iter()
                            .map(|&(a, b)| (fe.min(b) - fs.max(a)).max(0.0))
                            .sum::<f64>()
                    })
                    .sum();
                RankFill {
                    rank,
                    bubble,
                    filled,
                    fill_ratio: ratio(filled, bubble),
                }
            })
            .collect();
        Filling {
            filler: filler.to_string(),
            bubble: ranks.iter().map(|r| r.bubble).sum(),
            filled: ranks.iter().map(|r| r.filled).sum(),
            ranks,
            step_makespan: 0.0,
            baseline_step_makespan: None,
            baseline_note: None,
            replay_inflation: None,
            work: Vec::new(),
            drafter_version: None,
        }
    }

    /// filled / bubble over every rank.
    pub fn fill_ratio(&self) -> f64 {
        ratio(self.filled, self.bubble)
    }

    /// The step makespans with and without fillers; `note` says how the baseline ran.
    pub fn with_baseline(mut self, step_makespan: f64, baseline: Option<(f64, String)>) -> Self {
        self.step_makespan = step_makespan;
        if let Some((m, note)) = baseline {
            self.baseline_step_makespan = Some(m);
            self.baseline_note = Some(note);
        }
        self
    }

    /// Sets the step inflation measured by replaying each step without its fillers: the
    /// median of `per_step` after the first step (see [`median_step_makespan`]).
    pub fn with_replay(mut self, per_step: &[f64]) -> Self {
        self.replay_inflation = median_step_makespan(per_step);
        self
    }

    /// The step inflation: against the baseline run when measured, else the replay's upper
    /// bound (see the module docs).
    pub fn step_inflation(&self) -> Option<f64> {
        self.run_inflation().or(self.replay_inflation)
    }

    /// step makespan with fillers / without − 1 against the separate run without fillers.
    pub fn run_inflation(&self) -> Option<f64> {
        self.baseline_step_makespan
            .filter(|&b| b > 0.0)
            .map(|b| self.step_makespan / b - 1.0)
    }

    /// The report's filler lines; `t` formats a time, `pct` a ratio.
    pub(super) fn write_text(
        &self,
        out: &mut String,
        unit: &str,
        agreement: Option<f64>,
        t: &dyn Fn(f64) -> String,
        pct: &dyn Fn(f64) -> String,
    ) {
        let _ = writeln!(
            out,
            "filler {}: whole run, per rank (bubble = idle slots of the measured timeline)",
            self.filler
        );
        let _ = writeln!(
            out,
            "{:<6}{:>12}{:>12}{:>9}",
            "rank", "bubble", "filled", "fill"
        );
        for r in &self.ranks {
            let _ = writeln!(
                out,
                "{:<6}{:>12}{:>12}{:>9}",
                r.rank,
                t(r.bubble),
                t(r.filled),
                pct(r.fill_ratio)
            );
        }
        let _ = writeln!(
            out,
            "{:<6}{:>12}{:>12}{:>9}",
            "all",
            t(self.bubble),
            t(self.filled),
            pct(self.fill_ratio())
        );
        let _ = writeln!(out, "bubble-fill ratio {}", pct(self.fill_ratio()));
        for w in &self.work {
            let _ = writeln!(
                out,
                "{}: {} slices, {} {unit} in all, {} {unit} each (estimate), {} overran their bubble, {} failed",
                w.kind,
                w.slices,
                t(w.seconds),
                t(w.estimate),
                w.overran,
                w.failed
            );
        }
        if let Some(inflation) = self.replay_inflation {
            let _ = writeln!(
                out,
                "replayed step inflation {:+.2}% (upper bound): median over steps of makespan / \
                 the same step replayed without its fillers (same actions, same measured costs) − 1",
                100.0 * inflation
            );
        }
        match (self.run_inflation(), self.baseline_step_makespan) {
            (Some(inflation), Some(base)) => {
                let _ = writeln!(
                    out,
                    "step inflation {:+.2}%: median step makespan {} {unit} with fillers, {} {unit} without ({})",
                    100.0 * inflation,
                    t(self.step_makespan),
                    t(base),
                    self.baseline_note.as_deref().unwrap_or("baseline run")
                );
            }
            _ if self.replay_inflation.is_some() => {}
            _ => {
                let _ = writeln!(out, "step inflation: not measured (no run without fillers)");
            }
        }
        if let Some(a) = agreement {
            let version = self
                .drafter_version
                .map_or(String::new(), |v| format!(" after {v} drafter steps"));
            let _ = writeln!(
                out,
                "drafter: top-1 agreement with the target on held-out rows {}{version}",
                pct(a)
            );
        }
    }
}

fn ratio(part: f64, whole: f64) -> f64 {
    if whole > 0.0 { part / whole } else { 0.0 }
}

/// The median makespan of the steps after the first (which warms up), or of the only step.
pub fn median_step_makespan(makespans: &[f64]) -> Option<f64> {
    let steady = if makespans.len() > 1 {
        &makespans[1..]
    } else {
        makespans
    };
    let mut v = steady.to_vec();
    v.sort_by(f64::total_cmp);
    v.get((v.len().checked_sub(1)?) / 2).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::test_support::{fillers, two_rank_timeline};

    fn spans() -> Vec<FillerSpan> {
        fillers().iter().map(|f| (f.rank, f.start, f.end)).collect()
    }

    #[test]
    fn filled_time_is_filler_work_inside_the_idle_slots() {
        // Rank 0 idles [2,3) and fills 0.75 of it; rank 1 idles [0,1) and [4,6), fills 1.5.
        let f = Filling::measure("drafter", &two_rank_timeline(), &spans());
        assert_eq!(f.ranks[0].bubble, 1.0);
        assert_eq!(f.ranks[0].filled, 0.75);
        assert_eq!(f.ranks[1].bubble, 3.0);
        assert_eq!(f.ranks[1].filled, 1.5);
        assert_eq!(f.ranks[1].fill_ratio, 0.5);
        assert_eq!((f.bubble, f.filled), (4.0, 2.25));
        assert_eq!(f.fill_ratio(), 2.25 / 4.0);
        // Work outside every slot (overlapping compute) does not count.
        let f = Filling::measure("drafter", &two_rank_timeline(), &[(0, 0.5, 2.5)]);
        assert_eq!(f.ranks[0].filled, 0.5);
    }

    #[test]
    fn inflation_compares_median_step_makespans() {
        let f = Filling::measure("drafter", &two_rank_timeline(), &spans());
        assert_eq!(f.step_inflation(), None);
        let f = f.with_baseline(10.2, Some((10.0, "same job".into())));
        assert!((f.step_inflation().unwrap() - 0.02).abs() < 1e-12);
        assert_eq!(median_step_makespan(&[]), None);
        assert_eq!(median_step_makespan(&[7.0]), Some(7.0));
        // The first step warms up and is left out: median of 3, 1, 2 is 2.
        assert_eq!(median_step_makespan(&[9.0, 3.0, 1.0, 2.0]), Some(2.0));
        // The separate run's figure takes precedence; the replay's is its own line.
        let f = f.with_replay(&[0.5, 0.01, 0.03, 0.04]);
        assert!((f.step_inflation().unwrap() - 0.02).abs() < 1e-12);
        assert_eq!(f.replay_inflation, Some(0.03));
        let mut text = String::new();
        f.write_text(&mut text, "s", None, &|x| format!("{x}"), &|x| {
            format!("{:.1}%", 100.0 * x)
        });
        assert!(
            text.contains("replayed step inflation +3.00% (upper bound)"),
            "{text}"
        );
        assert!(
            text.contains("step inflation +2.00%: median step makespan"),
            "{text}"
        );
    }
}
