//! The filler part of a bubble report: how much of the bubbles filler work used, what it
//! cost the step, and how well the drafter it trained agrees with the target.
//!
//! Definitions (DESIGN.md, "Metrics"):
//! - a rank's **bubble** time is the total length of its bubble slots in the measured
//!   timeline of the whole run (its idle intervals inside the makespan);
//! - its **filled** time is the filler work that lies inside those slots;
//! - **bubble-fill ratio** = filled / bubble, per rank and over all ranks;
//! - **step inflation** = step makespan with fillers / without − 1. Under the virtual clock
//!   "without" is the same run replayed without its fillers ([`super::replay`]: same
//!   actions and optimizer-step work, same measured costs, the clock's rules), the median
//!   over steps of each step's ratio: the critical-path inflation from filling, and nothing
//!   else (an unfilled run replays to its own makespans exactly). What it leaves out is
//!   whether filling made the actions themselves dearer (two threads per core): that is
//!   the action costs, not the critical path.
//! - The separate run of the same job with `filler = "none"` gives a second figure (median
//!   step makespans compared, see [`median_step_makespan`]); it also measures how
//!   differently loaded the machine was during the two runs, so it is secondary (the only
//!   one under the wall clock, where nothing can be replayed).
//! - **action cost change under filling**: the compute actions' own measured time (thread
//!   CPU under the virtual clock), median per stage and kind, with fillers against the run
//!   without ([`action_costs`]). Filling keeps every stage thread busy, which changes what
//!   the actions themselves cost: dearer when the threads share too few cores, cheaper when
//!   a thread that would sleep through its bubbles stays hot. The replay takes the costs as
//!   measured and cannot see that; this figure does (it compares two runs, so it also
//!   carries their load difference).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use pipefill_actors::IterationProfile;
use pipefill_schedules::{ActionKind, Timeline};
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
    /// fillers − 1 (virtual clock only): the step inflation when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_inflation: Option<f64>,
    /// Each kind of filler work: slices run, their time and cost estimate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub work: Vec<WorkFigures>,
    /// Median compute-action costs with fillers and without, per stage and kind (when the
    /// run without fillers was measured).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub action_costs: Vec<CostChange>,
    /// Drafter steps taken when the agreement was last measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter_version: Option<u64>,
}

/// One kind of compute action of one stage: its median cost with fillers and without.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostChange {
    pub stage: u32,
    /// `F`, `I`, `W` or `B`.
    pub kind: String,
    /// How many ran per step.
    pub per_step: f64,
    pub with: f64,
    pub without: f64,
}

/// Median compute-action costs of a run: `(stage, kind) → (how many per step, median
/// seconds)`.
pub type ActionCosts = BTreeMap<(u32, String), (f64, f64)>;

/// The median cost (seconds) of each plain compute action kind per stage, over the steps
/// after the first (which warms up), with how many ran per step.
pub fn action_costs(iterations: &[IterationProfile]) -> ActionCosts {
    let steady = if iterations.len() > 1 {
        &iterations[1..]
    } else {
        iterations
    };
    let mut samples: BTreeMap<(u32, String), Vec<f64>> = BTreeMap::new();
    for r in steady.iter().flat_map(|it| &it.records) {
        if matches!(
            r.action.kind,
            ActionKind::F | ActionKind::I | ActionKind::W | ActionKind::B
        ) {
            let key = (r.action.stage, format!("{:?}", r.action.kind));
            samples.entry(key).or_default().push(r.duration());
        }
    }
    samples
        .into_iter()
        .map(|(key, mut v)| {
            v.sort_by(f64::total_cmp);
            let n = v.len();
            let median = match n % 2 {
                1 => v[n / 2],
                _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
            };
            (key, (n as f64 / steady.len() as f64, median))
        })
        .collect()
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
            action_costs: Vec::new(),
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

    /// The step inflation: the replay's when the run could be replayed, else against the
    /// separate run without fillers (see the module docs).
    pub fn step_inflation(&self) -> Option<f64> {
        self.replay_inflation.or_else(|| self.run_inflation())
    }

    /// Sets the compute-action costs of this run (`with`) and of the run without fillers,
    /// both from [`action_costs`]; kinds measured in only one of them are left out.
    pub fn with_action_costs(mut self, with: &ActionCosts, without: &ActionCosts) -> Self {
        self.action_costs = with
            .iter()
            .filter_map(|((stage, kind), &(per_step, with))| {
                let &(_, without) = without.get(&(*stage, kind.clone()))?;
                Some(CostChange {
                    stage: *stage,
                    kind: kind.clone(),
                    per_step,
                    with,
                    without,
                })
            })
            .collect();
        self
    }

    /// The compute time of a step at the median costs with fillers / without − 1, over the
    /// stages and kinds whose name passes `kind` (each counted as often as it runs).
    pub fn action_cost_change(&self, kind: impl Fn(&str) -> bool) -> Option<f64> {
        let (with, without) = self
            .action_costs
            .iter()
            .filter(|c| kind(&c.kind))
            .fold((0.0, 0.0), |(a, b), c| {
                (a + c.per_step * c.with, b + c.per_step * c.without)
            });
        (without > 0.0).then(|| with / without - 1.0)
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
                "step inflation {:+.2}%: critical-path inflation from filling, replayed with the \
                 same measured action costs (median over steps of makespan / the same step \
                 replayed without its fillers − 1)",
                100.0 * inflation
            );
        }
        let against = match self.replay_inflation {
            Some(_) => "against a separate run",
            None => "step inflation",
        };
        match (self.run_inflation(), self.baseline_step_makespan) {
            (Some(inflation), Some(base)) => {
                let _ = writeln!(
                    out,
                    "{against} {:+.2}%: median step makespan {} {unit} with fillers, {} {unit} \
                     without ({}; includes the machine-load difference between the runs)",
                    100.0 * inflation,
                    t(self.step_makespan),
                    t(base),
                    self.baseline_note.as_deref().unwrap_or("baseline run")
                );
            }
            _ if self.replay_inflation.is_some() => {}
            _ => {
                let _ = writeln!(
                    out,
                    "step inflation: not measured (the wall clock cannot replay a step without \
                     its fillers; `pipefill bench filler` compares runs with and without)"
                );
            }
        }
        if let Some(all) = self.action_cost_change(|_| true) {
            let by_kind: Vec<String> = ["F", "I", "W", "B"]
                .iter()
                .filter_map(|k| {
                    let c = self.action_cost_change(|kind| kind == *k)?;
                    Some(format!("{k} {:+.1}%", 100.0 * c))
                })
                .collect();
            let _ = writeln!(
                out,
                "action cost change under filling {:+.2}%: the compute actions' own time (median \
                 per stage and kind, weighted by how often they run) against the run without \
                 fillers; {}",
                100.0 * all,
                by_kind.join(", ")
            );
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

/// The median of `values` (the mean of the middle two of an even count; `NaN` for none).
pub fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.into_iter().collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
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

    /// Iterations whose stage-0 forward lasts each of `f` (iteration 0 a warm-up of 100 s)
    /// and whose stage-0 backward input lasts 1 (twice per step).
    fn iterations(f: &[f64]) -> Vec<IterationProfile> {
        use pipefill_actors::ActionRecord;
        use pipefill_schedules::Action;
        std::iter::once(100.0)
            .chain(f.iter().copied())
            .enumerate()
            .map(|(iteration, d)| {
                let rec = |index, action, start: f64, end| ActionRecord {
                    rank: 0,
                    iteration: iteration as u64,
                    index,
                    action,
                    start,
                    end,
                    waited: 0.0,
                };
                let records = vec![
                    rec(0, Action::f(0, 0), 0.0, d),
                    rec(1, Action::i(0, 0), d, d + 1.0),
                    rec(2, Action::i(0, 1), d + 1.0, d + 2.0),
                ];
                let spans = records.iter().map(|r| r.span()).collect();
                IterationProfile {
                    iteration: iteration as u64,
                    timeline: Timeline::from_spans(1, spans, &[]),
                    records,
                    bubbles: Vec::new(),
                    fillers: Vec::new(),
                    steps: Vec::new(),
                    ranks_reported: 1,
                }
            })
            .collect()
    }

    #[test]
    fn action_cost_change_weighs_median_costs_by_how_often_they_run() {
        let with = action_costs(&iterations(&[3.0, 2.0, 7.0]));
        // Medians after the warm-up step: F 3 (once a step), I 1 (twice).
        assert_eq!(with[&(0, "F".to_string())], (1.0, 3.0));
        assert_eq!(with[&(0, "I".to_string())], (2.0, 1.0));
        let without = action_costs(&iterations(&[1.0, 2.0]));
        assert_eq!(without[&(0, "F".to_string())], (1.0, 1.5));
        let f = Filling::measure("drafter", &two_rank_timeline(), &spans());
        assert_eq!(f.action_cost_change(|_| true), None);
        let f = f.with_action_costs(&with, &without);
        // Per step: 3 + 2·1 with, 1.5 + 2·1 without.
        let all = f.action_cost_change(|_| true).unwrap();
        assert!((all - (5.0 / 3.5 - 1.0)).abs() < 1e-12, "{all}");
        assert_eq!(f.action_cost_change(|k| k == "F"), Some(1.0));
        assert_eq!(f.action_cost_change(|k| k == "I"), Some(0.0));
        let mut text = String::new();
        f.write_text(&mut text, "s", None, &|x| format!("{x}"), &|x| {
            format!("{x}")
        });
        assert!(
            text.contains("action cost change under filling +42.86%")
                && text.contains("F +100.0%, I +0.0%"),
            "{text}"
        );
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
        let text = |f: &Filling| {
            let mut text = String::new();
            f.write_text(&mut text, "s", None, &|x| format!("{x}"), &|x| {
                format!("{:.1}%", 100.0 * x)
            });
            text
        };
        assert!(
            text(&f).contains("\nstep inflation +2.00%: median step makespan"),
            "{}",
            text(&f)
        );
        // The replay's figure takes precedence; the separate run's is a secondary line.
        let f = f.with_replay(&[0.5, 0.01, 0.03, 0.04]);
        assert!((f.step_inflation().unwrap() - 0.03).abs() < 1e-12);
        assert!((f.run_inflation().unwrap() - 0.02).abs() < 1e-12);
        let text = text(&f);
        assert!(
            text.contains("\nstep inflation +3.00%: critical-path inflation from filling"),
            "{text}"
        );
        assert!(
            text.contains("\nagainst a separate run +2.00%: median step makespan"),
            "{text}"
        );
    }
}
