//! Timeline writers: the pictures and traces a person reads to see where a pipeline idles.
//!
//! Every writer takes a [`Timeline`](crate::schedules::Timeline) (what ran where and when, with its
//! bubble slots and metrics), never command-line arguments, so the same code draws a *predicted*
//! timeline (from the schedule simulator, `pipefill schedule export`) and a *measured* one (from
//! the runtime's profiler), and the two can be laid side by side.
//!
//! - [`svg`]: a self-contained SVG picture, one lane per rank, with a legend and a time axis.
//! - [`chrome`]: a Chrome trace-event JSON file that opens in Perfetto (`ui.perfetto.dev`)
//!   or `chrome://tracing`, one process per rank.
//! - [`report`]: the bubble report of a run (per rank busy / bubble, measured next to
//!   predicted), as `report.json` and `report.txt`.
//! - [`merge`]: every rank's spans of a multi-process run on rank 0's clock (offsets
//!   estimated at rendezvous), written as the same files as a single-process run.
//! - [`grid`]: the text grid people draw schedules with, one row per rank and one column
//!   per time step.
//! - [`error`]: [`ProfileError`], the one error of this layer.

pub mod chrome;
pub mod error;
pub mod grid;
pub mod merge;
pub mod report;
pub mod svg;

pub use error::ProfileError;
use pipefill_schedules::{Action, ActionKind};

/// Work drawn beside a timeline's compute actions on one rank: filler work run inside a
/// bubble (a drafter-training slice, a rollout verification), a transfer, …
///
/// The timeline itself holds compute only (its metrics are defined on compute); the
/// runtime's profiler passes what else it measured as lane spans, and the writers draw
/// each distinct `lane` name as its own track of the rank. Spans of one rank and lane are
/// expected not to overlap, like the actions of one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct LaneSpan {
    pub rank: usize,
    /// The track's name (`filler`, `comm`, …); also the Chrome trace's `cat`.
    pub lane: String,
    pub start: f64,
    pub end: f64,
    /// What ran (`drafter step 3`, `verify 12 tokens`).
    pub label: String,
}

impl LaneSpan {
    /// The same span with every time `t` as `(t - origin) × scale` ([`Timeline::rescaled`]).
    ///
    /// [`Timeline::rescaled`]: crate::schedules::Timeline::rescaled
    pub fn rescaled(self, origin: f64, scale: f64) -> LaneSpan {
        LaneSpan {
            start: (self.start - origin) * scale,
            end: (self.end - origin) * scale,
            ..self
        }
    }
}

/// The distinct lane names of `extra`, in order of first appearance.
pub(crate) fn lane_names(extra: &[LaneSpan]) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for s in extra {
        if !names.contains(&s.lane.as_str()) {
            names.push(&s.lane);
        }
    }
    names
}

/// The short label of an action: `F3`, `I3`, `W3`, `B3`, `F7+B3` for an overlapped pair,
/// prefixed by the stage (`2F3`, `0F7+7B3`) when `with_stage` is set — which a reader needs
/// as soon as a rank holds more than one stage.
pub fn action_label(action: &Action, with_stage: bool) -> String {
    let part = |kind: &str, stage: u32, mb: u32| {
        if with_stage {
            format!("{stage}{kind}{mb}")
        } else {
            format!("{kind}{mb}")
        }
    };
    match (action.kind, action.pair) {
        (ActionKind::OverlapFB, Some(b)) => format!(
            "{}+{}",
            part("F", action.stage, action.microbatch),
            part("B", b.stage, b.microbatch)
        ),
        _ => part(action.kind.as_str(), action.stage, action.microbatch),
    }
}

/// A compact decimal form of a time or cost figure: at most `decimals` digits after the
/// point, trailing zeros dropped (`3`, `2.5`, `0.33`), so labels and reports stay short.
pub fn fmt_num(x: f64, decimals: usize) -> String {
    let s = format!("{x:.decimals$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    };
    if s == "-0" { "0".to_string() } else { s }
}

#[cfg(test)]
pub(crate) mod test_support {
    //! A hand-built two-rank timeline shared by the writers' tests.

    use pipefill_schedules::{Action, Span, StageMb, Timeline};

    use super::LaneSpan;

    /// Filler work in the two-rank timeline's bubbles: one slice on rank 0's [2,3) bubble,
    /// two on rank 1's [4,6) bubble.
    pub fn fillers() -> Vec<LaneSpan> {
        let f = |rank, start, end, label: &str| LaneSpan {
            rank,
            lane: "filler".into(),
            start,
            end,
            label: label.into(),
        };
        vec![
            f(0, 2.0, 2.75, "drafter step 0"),
            f(1, 4.0, 5.0, "verify <12> & co"),
            f(1, 5.0, 5.5, "drafter step 1"),
        ]
    }

    /// Rank 0: F0 [0,1) F1 [1,2) idle [2,3) I0 [3,4) W0 [4,5) (0F2;0B1) [5,8).
    /// Rank 1: idle [0,1) F0 [1,2) B0 [2,4) idle [4,6) B1 [6,8).
    pub fn two_rank_timeline() -> Timeline {
        let s = |rank, start, end, action| Span {
            rank,
            start,
            end,
            action,
        };
        let overlap = Action::overlap(
            StageMb {
                stage: 0,
                microbatch: 2,
            },
            StageMb {
                stage: 0,
                microbatch: 1,
            },
        );
        let spans = vec![
            s(0, 0.0, 1.0, Action::f(0, 0)),
            s(0, 1.0, 2.0, Action::f(0, 1)),
            s(0, 3.0, 4.0, Action::i(0, 0)),
            s(0, 4.0, 5.0, Action::w(0, 0)),
            s(0, 5.0, 8.0, overlap),
            s(1, 1.0, 2.0, Action::f(1, 0)),
            s(1, 2.0, 4.0, Action::b(1, 0)),
            s(1, 6.0, 8.0, Action::b(1, 1)),
        ];
        Timeline::from_spans(2, spans, &[2.0, 1.0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipefill_schedules::StageMb;

    #[test]
    fn labels_show_the_stage_only_when_asked() {
        assert_eq!(action_label(&Action::i(2, 5), false), "I5");
        assert_eq!(action_label(&Action::i(2, 5), true), "2I5");
        let o = Action::overlap(
            StageMb {
                stage: 0,
                microbatch: 7,
            },
            StageMb {
                stage: 7,
                microbatch: 3,
            },
        );
        assert_eq!(action_label(&o, false), "F7+B3");
        assert_eq!(action_label(&o, true), "0F7+7B3");
    }

    #[test]
    fn numbers_are_compact() {
        assert_eq!(fmt_num(3.0, 3), "3");
        assert_eq!(fmt_num(2.5, 3), "2.5");
        assert_eq!(fmt_num(1.0 / 3.0, 2), "0.33");
        assert_eq!(fmt_num(-0.0001, 2), "0");
        assert_eq!(fmt_num(120.0, 0), "120");
    }
}
