use std::time::Instant;

use pipefill_schedules::{Action, ActionKind};

use super::*;
use crate::comm::link::InProcessLink;
use crate::profile::ProfileError;

fn span(rank: usize, kind: ActionKind, mb: u32, start: f64, end: f64) -> Span {
    Span {
        rank,
        start,
        end,
        action: Action::new(kind, rank as u32, mb),
    }
}

#[test]
fn the_exchange_with_the_smallest_round_trip_wins_and_errs_by_at_most_half_of_it() {
    // Rank 0's clock is 5 s ahead. Exchange a: 0.1 s out, 0.3 s back (asymmetric);
    // exchange b: 0.01 s each way.
    let a = ClockSample {
        sent: 0.0,
        served_at: 5.1,
        answered_at: 5.2,
        received: 0.5,
    };
    let b = ClockSample {
        sent: 1.0,
        served_at: 6.01,
        answered_at: 6.02,
        received: 1.03,
    };
    assert!((a.round_trip() - 0.4).abs() < 1e-12);
    assert!((a.offset() - 5.0).abs() <= a.round_trip() / 2.0);
    let est = estimate_offset(&[a, b]).unwrap();
    assert!((est.round_trip - 0.02).abs() < 1e-12);
    assert!((est.offset - 5.0).abs() < 1e-12, "{est:?}");
    assert_eq!(estimate_offset(&[]), None);
}

#[test]
fn measuring_over_a_link_finds_the_offset_within_half_the_round_trip() {
    let links = InProcessLink::group(2);
    let epoch = Instant::now();
    let server = links[0].clone();
    let handle = std::thread::spawn(move || {
        // Rank 0's clock reads 1000 s more than rank 1's.
        let now = move || epoch.elapsed().as_secs_f64() + 1000.0;
        serve_clock(&server, 1, 3, 8, &now).unwrap();
    });
    let now = move || epoch.elapsed().as_secs_f64();
    let est = measure_clock(&links[1], 3, 8, &now).unwrap();
    handle.join().unwrap();
    // Causality bounds the error by half the round trip, whatever the scheduling.
    assert!(
        (est.offset - 1000.0).abs() <= est.round_trip / 2.0 + 1e-9,
        "{est:?}"
    );
}

/// Rank 0 runs F0 at [0, 1] and B0 at [3, 5] on its clock; rank 1 runs F0 at [1, 2] and B0
/// at [2, 3] of rank 0's clock, but its own clock reads 10 s less.
fn profiles() -> Vec<RankProfile> {
    let zero = ClockOffset {
        offset: 0.0,
        round_trip: 0.0,
    };
    vec![
        RankProfile {
            rank: 0,
            iterations: vec![vec![
                span(0, ActionKind::F, 0, 0.0, 1.0),
                span(0, ActionKind::B, 0, 3.0, 5.0),
            ]],
            lanes: vec![LaneRecord {
                lane: FILLER_LANE.into(),
                start: 1.0,
                end: 2.0,
                label: "drafter step 0".into(),
            }],
            peak_memory: 1.0,
            clock: zero,
        },
        RankProfile {
            rank: 1,
            iterations: vec![vec![
                span(1, ActionKind::F, 0, -9.0, -8.0),
                span(1, ActionKind::B, 0, -8.0, -7.0),
            ]],
            lanes: Vec::new(),
            peak_memory: 2.0,
            clock: ClockOffset {
                offset: 10.0,
                round_trip: 1e-4,
            },
        },
    ]
}

#[test]
fn merging_puts_every_rank_on_rank_0s_clock_and_recomputes_the_metrics() {
    let mut parts = profiles();
    // Any order of arrival.
    parts.reverse();
    let merged = merge(&parts, 2).unwrap();
    let truth = Timeline::from_spans(
        2,
        vec![
            span(0, ActionKind::F, 0, 0.0, 1.0),
            span(0, ActionKind::B, 0, 3.0, 5.0),
            span(1, ActionKind::F, 0, 1.0, 2.0),
            span(1, ActionKind::B, 0, 2.0, 3.0),
        ],
        &[1.0, 2.0],
    );
    assert_eq!(merged.iterations, vec![truth.clone()]);
    assert_eq!(merged.overall, truth);
    // makespan 5, busy 3 and 2: (2 + 3) / (2 × 5).
    assert!((merged.overall.bubble_ratio - 0.5).abs() < 1e-12);
    assert_eq!(merged.lanes.len(), 1);
    assert_eq!((merged.lanes[0].start, merged.lanes[0].end), (1.0, 2.0));
}

#[test]
fn missing_duplicate_or_inconsistent_profiles_are_refused() {
    let p = profiles();
    assert!(matches!(
        merge(&p[..1], 2),
        Err(ProfileError::MissingRank { rank: 1, ranks: 2 })
    ));
    let twice = vec![p[0].clone(), p[0].clone()];
    assert!(matches!(
        merge(&twice, 2),
        Err(ProfileError::BadRank { rank: 0, .. })
    ));
    let mut short = p.clone();
    short[1].iterations.push(Vec::new());
    assert!(matches!(
        merge(&short, 2),
        Err(ProfileError::Iterations {
            rank: 1,
            got: 2,
            expected: 1
        })
    ));
    let mut foreign = p;
    foreign[1].iterations[0][0].rank = 0;
    assert!(matches!(
        merge(&foreign, 2),
        Err(ProfileError::SpanRank {
            rank: 1,
            span_rank: 0
        })
    ));
}

#[test]
fn profiles_gathered_over_a_link_merge_into_the_run_files() {
    let links = InProcessLink::group(2);
    let parts = profiles();
    send_profile(&links[1], 4, &parts[1]).unwrap();
    let gathered = gather_profiles(&links[0], 4, parts[0].clone()).unwrap();
    assert_eq!(gathered, parts);

    let merged = merge(&gathered, 2).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let info = RunInfo {
        schedule: "1f1b".into(),
        clock: "wall".into(),
        stages: 2,
        microbatches: 1,
        steps: 1,
        units: "s".into(),
        iteration: 0,
        iteration_note: String::new(),
        cost_basis: "test".into(),
    };
    let predicted = merged.iterations[0].clone();
    let report = merged
        .write_files(dir.path(), info, 0, &predicted, false)
        .unwrap();
    assert_eq!(report.ranks_count, 2);
    for f in ["report.json", "report.txt", "trace.json", "timeline.svg"] {
        assert!(dir.path().join(f).is_file(), "{f} missing");
    }
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("trace.json")).unwrap()).unwrap();
    let text = trace.to_string();
    assert!(
        text.contains("drafter step 0"),
        "the filler lane is in the trace"
    );
    let svg = std::fs::read_to_string(dir.path().join("timeline.svg")).unwrap();
    assert!(svg.contains("merged from 2 processes"));
}
