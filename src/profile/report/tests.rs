use super::*;
use crate::profile::ProfileError;
use crate::profile::test_support::two_rank_timeline;
use pipefill_schedules::{Action, Span};

fn info(units: &str) -> RunInfo {
    RunInfo {
        schedule: "1f1b".into(),
        clock: "virtual".into(),
        stages: 2,
        microbatches: 2,
        steps: 5,
        units: units.into(),
        iteration: 3,
        iteration_note: "test".into(),
        cost_basis: "test costs".into(),
    }
}

/// A predicted timeline: rank 0 busy [0,4), rank 1 busy [1,3). Makespan 4.
fn predicted() -> Timeline {
    let s = |rank, start, end, action| Span {
        rank,
        start,
        end,
        action,
    };
    Timeline::from_spans(
        2,
        vec![
            s(0, 0.0, 1.0, Action::f(0, 0)),
            s(0, 1.0, 4.0, Action::b(0, 0)),
            s(1, 1.0, 3.0, Action::f(1, 0)),
        ],
        &[],
    )
}

#[test]
fn figures_come_from_the_timelines() {
    let m = two_rank_timeline();
    let r = BubbleReport::new(info("units"), &m, &predicted()).unwrap();
    assert_eq!(r.makespan, 8.0);
    assert_eq!(r.ranks_count, 2);
    // Rank 0 busy 7 of 8, rank 1 busy 5 of 8 (see test_support).
    assert_eq!(r.ranks[0].busy, 7.0);
    assert_eq!(r.ranks[0].bubble, 1.0);
    assert_eq!(r.ranks[1].bubble, 3.0);
    assert_eq!(r.ranks[1].bubble_ratio, 3.0 / 8.0);
    assert_eq!(r.bubble_ratio, 4.0 / 16.0);
    assert_eq!(r.steady_bubble_ratio, m.steady_bubble_ratio);
    assert_eq!(r.predicted_makespan, 4.0);
    assert_eq!(r.ranks[1].predicted_busy, 2.0);
    assert_eq!(r.ranks[1].predicted_bubble_ratio, 0.5);
    assert_eq!(r.predicted_bubble_ratio, 2.0 / 8.0);
}

#[test]
fn text_table_lists_every_rank_measured_and_predicted() {
    let r = BubbleReport::new(info("units"), &two_rank_timeline(), &predicted()).unwrap();
    let text = r.to_text();
    assert!(text.starts_with(
        "bubble report: schedule 1f1b, 2 stages on 2 ranks, 2 micro-batches, 5 steps, virtual clock\n"
    ));
    assert!(
        text.contains("timeline: step 3 (test); times in units\n"),
        "{text}"
    );
    assert!(
        text.contains("predicted: the schedule simulator on the same plan under the test costs\n"),
        "{text}"
    );
    let row = |rank: usize| {
        text.lines()
            .find(|l| l.starts_with(&format!("{rank} ")))
            .unwrap_or_else(|| panic!("no row for rank {rank}:\n{text}"))
            .split_whitespace()
            .collect::<Vec<_>>()
    };
    assert_eq!(
        row(0),
        ["0", "7.000", "1.000", "12.5%", "4.000", "0.000", "0.0%"]
    );
    assert_eq!(
        row(1),
        ["1", "5.000", "3.000", "37.5%", "2.000", "2.000", "50.0%"]
    );
    let figures = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no line {name}:\n{text}"))[name.len()..]
            .split_whitespace()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(figures("makespan (units)"), ["8.000", "4.000"]);
    assert_eq!(figures("bubble ratio"), ["25.0%", "25.0%"]);
    assert_eq!(figures("steady bubble ratio"), ["25.0%", "25.0%"]);
}

#[test]
fn seconds_are_shown_in_milliseconds() {
    let mut m = two_rank_timeline();
    for s in &mut m.spans {
        s.start /= 1000.0;
        s.end /= 1000.0;
    }
    let m = Timeline::from_spans(2, m.spans, &[]);
    let r = BubbleReport::new(info("s"), &m, &m).unwrap();
    let text = r.to_text();
    assert!(text.contains("times in ms"), "{text}");
    let line = text
        .lines()
        .find(|l| l.starts_with("makespan (ms)"))
        .unwrap();
    assert_eq!(
        line.split_whitespace().collect::<Vec<_>>()[2..],
        ["8.000", "8.000"]
    );
}

#[test]
fn the_whole_run_line_appears_only_when_given() {
    let r = BubbleReport::new(info("units"), &two_rank_timeline(), &predicted()).unwrap();
    assert!(!r.to_text().contains("whole run"));
    assert!(!r.to_json().contains("whole_run"));
    let r = r.with_whole_run(&predicted(), 5);
    let text = r.to_text();
    assert!(
        text.contains(
            "whole run, 5 steps measured: makespan 4.000 units, bubble ratio 25.0%, steady 25.0%\n"
        ),
        "{text}"
    );
}

#[test]
fn json_round_trips_to_the_same_text() {
    let r = BubbleReport::new(info("s"), &two_rank_timeline(), &predicted())
        .unwrap()
        .with_whole_run(&two_rank_timeline(), 5);
    let json = r.to_json();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    for key in [
        "bubble_ratio",
        "steady_bubble_ratio",
        "predicted_bubble_ratio",
        "predicted_steady_bubble_ratio",
        "makespan",
        "schedule",
        "clock",
        "stages",
        "microbatches",
        "steps",
        "units",
    ] {
        assert!(v.get(key).is_some(), "report.json lacks {key}: {json}");
    }
    let rank = &v["ranks"][1];
    for key in ["busy", "bubble", "bubble_ratio", "predicted_bubble_ratio"] {
        assert!(rank.get(key).is_some(), "ranks[1] lacks {key}");
    }
    let back = BubbleReport::from_json(&json, Path::new("report.json")).unwrap();
    assert_eq!(back, r);
    assert_eq!(back.to_text(), r.to_text());
}

#[test]
fn reading_a_missing_or_damaged_report_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let err = BubbleReport::read(&missing).unwrap_err();
    assert!(err.to_string().contains("no such run directory"), "{err}");
    let err = BubbleReport::read(dir.path()).unwrap_err();
    assert!(err.to_string().contains("report.json"), "{err}");
    std::fs::write(dir.path().join(REPORT_JSON), "{\"schedule\": 3}").unwrap();
    let err = BubbleReport::read(dir.path()).unwrap_err();
    assert!(
        err.to_string().contains("is not a valid bubble report"),
        "{err}"
    );
    let r = BubbleReport::new(info("s"), &predicted(), &predicted()).unwrap();
    r.write(dir.path()).unwrap();
    assert_eq!(BubbleReport::read(dir.path()).unwrap(), r);
    let txt = std::fs::read_to_string(dir.path().join(REPORT_TXT)).unwrap();
    assert_eq!(txt, r.to_text());
}

#[test]
fn mismatched_timelines_are_an_error() {
    let one = Timeline::from_spans(1, vec![], &[]);
    let err = BubbleReport::new(info("s"), &one, &predicted()).unwrap_err();
    assert!(matches!(
        err,
        ProfileError::RankMismatch {
            measured: 1,
            predicted: 2
        }
    ));
}

#[test]
fn steady_iteration_is_the_median_after_warm_up() {
    assert_eq!(steady_iteration(&[], 0), None);
    assert_eq!(steady_iteration(&[5.0], 7).unwrap().0, 0);
    // Step 0 is slowest and excluded; of 1..=4 (3, 1, 2, 4) the lower median is 2.0 at step 3.
    let (i, note) = steady_iteration(&[9.0, 3.0, 1.0, 2.0, 4.0], 0).unwrap();
    assert_eq!(i, 3);
    assert_eq!(note, "median makespan of steps 1–4; step 0 warms up");
    // A resumed run names its own steps.
    let (i, note) = steady_iteration(&[9.0, 3.0], 10).unwrap();
    assert_eq!(i, 1);
    assert_eq!(note, "the only step after step 10, which warms up");
}

#[test]
fn fixed_numbers_have_no_negative_zero() {
    assert_eq!(fmt_fixed(-0.0001, 3), "0.000");
    assert_eq!(fmt_fixed(-1.5, 1), "-1.5");
    assert_eq!(fmt_fixed(2.0, 3), "2.000");
}
