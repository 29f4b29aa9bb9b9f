//! The DualPipeV generator against PyTorch's plan and DeepSeek's figures: the plan for 4
//! ranks and 10 micro-batches is PyTorch's `ScheduleDualPipeV` action for action; every
//! supported shape validates, lowers and simulates; the worst rank's steady idle is
//! DualPipe's published `(PP/2 − 1)(F&B + B − 3W)` where that formula's assumptions hold,
//! and below 1F1B's everywhere.
//!
//! The simulator runs an overlapped pair as `T_F + T_B` (it models no overlap gain), so
//! `F&B = T_F + T_I + T_W` here; with `PP = 2p` stages on `p` ranks the formula reads
//! `(p − 1)(T_F + 2T_I − T_W)` in chunk costs.

use pipefill_schedules::{
    ActionKind, CostModel, Placement, Plan, ScheduleError, ScheduleKind, ValidateOptions, build,
    generate, parse_csv, simulate, to_csv, validate,
};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/torch/dualpipev_4rank_10mb.csv"
);
const EPS: f64 = 1e-9;

fn dualpipe_v(p: usize, m: usize) -> Plan {
    generate(ScheduleKind::DualPipeV, p, m, 2).unwrap_or_else(|e| panic!("p={p} m={m}: {e}"))
}

/// DeepSeek's DualPipe(V) bubble `(PP/2 − 1)(F&B + B − 3W)` with `PP = 2p`, an overlapped
/// pair costing `F + B` and `B = I + W`.
fn published_bubble(p: usize, (f, i, w): (f64, f64, f64)) -> f64 {
    let b = i + w;
    (p as f64 - 1.0) * ((f + b) + b - 3.0 * w)
}

#[test]
fn four_ranks_ten_microbatches_is_pytorchs_plan() {
    let text = std::fs::read_to_string(FIXTURE).unwrap_or_else(|e| panic!("{FIXTURE}: {e}"));
    let torch = parse_csv(&text, FIXTURE).unwrap();
    let ours = dualpipe_v(4, 10);
    assert_eq!(ours.placement, Placement::VShape);
    assert_eq!(torch.placement, Placement::VShape);
    assert_eq!(ours.stage_rank, torch.stage_rank);
    assert_eq!((ours.stages, ours.microbatches), (8, 10));
    assert_eq!((torch.stages, torch.microbatches), (8, 10));
    assert_eq!(ours.num_ranks(), torch.num_ranks());
    // Rank by rank, step by step: an idle step (None) would have to match too.
    for (r, (mine, theirs)) in ours.ranks.iter().zip(&torch.ranks).enumerate() {
        let show = |c: Option<&Option<_>>| match c {
            Some(Some(a)) => format!("`{a}`"),
            Some(None) => "an idle step".into(),
            None => "the end of the list".into(),
        };
        if let Some(step) =
            (0..mine.len().max(theirs.len())).find(|&i| mine.get(i) != theirs.get(i))
        {
            panic!(
                "rank {r}, step {step}: generated {}, PyTorch {}",
                show(mine.get(step)),
                show(theirs.get(step))
            );
        }
    }
    assert_eq!(ours, torch);
    assert_eq!(to_csv(&ours), text, "written back byte for byte");
}

#[test]
fn every_supported_shape_is_valid_complete_and_simulates() {
    let cost = CostModel::uniform(1.0, 1.0, 1.0, 0.5);
    let mut checked = 0;
    for p in 1..=8 {
        for m in [2 * p, 2 * p + 1, 3 * p, 4 * p + 3] {
            let what = format!("p={p} m={m}");
            let plan = dualpipe_v(p, m);
            assert_eq!(plan.num_ranks(), p, "{what}");
            assert_eq!(plan.stages, 2 * p, "{what}");
            assert_eq!(plan.placement, Placement::VShape, "{what}");
            assert!(plan.is_compute_only(), "{what}");
            // One F and one backward (B, or I then W) per (stage, micro-batch).
            let mut count = vec![[0u32; 4]; plan.stages * m];
            for (_, _, a) in plan.iter() {
                for part in a.parts() {
                    let k = [ActionKind::F, ActionKind::I, ActionKind::W, ActionKind::B]
                        .iter()
                        .position(|&k| k == part.kind)
                        .unwrap();
                    count[part.stage as usize * m + part.microbatch as usize][k] += 1;
                }
            }
            for (cell, c) in count.iter().enumerate() {
                assert!(
                    c[0] == 1 && (c[1..] == [1, 1, 0] || c[1..] == [0, 0, 1]),
                    "{what}: stage {}, micro-batch {}: F/I/W/B counts {c:?}",
                    cell / m,
                    cell % m
                );
            }
            for (r, list) in plan.ranks.iter().enumerate() {
                assert!(
                    list.iter()
                        .flatten()
                        .any(|a| a.kind == ActionKind::OverlapFB),
                    "{what}: rank {r} has no overlapped pair"
                );
            }
            let checked_plan = validate(&plan, &ValidateOptions::default())
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            // DualPipeV's published activation per device: PP + 1 = 2p + 1 chunk stashes.
            assert!(
                checked_plan
                    .peak_memory
                    .iter()
                    .all(|&peak| peak <= (2 * p + 1) as f64),
                "{what}: peaks {:?}",
                checked_plan.peak_memory
            );
            let t = simulate(&plan, &cost).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(t.spans.len(), plan.num_actions(), "{what}");
            let lowered =
                build(ScheduleKind::DualPipeV, p, m, 2).unwrap_or_else(|e| panic!("{what}: {e}"));
            validate(&lowered, &ValidateOptions::default())
                .unwrap_or_else(|e| panic!("{what} lowered: {e}"));
            assert_eq!(lowered.compute_only(), plan, "{what}");
            let tl = simulate(&lowered, &cost).unwrap_or_else(|e| panic!("{what} lowered: {e}"));
            assert!((tl.makespan - t.makespan).abs() < EPS, "{what}");
            checked += 1;
        }
    }
    assert_eq!(checked, 32);
}

#[test]
fn outside_the_constraints_is_unsupported_with_the_rule() {
    for (p, m, v, rule) in [
        (4, 7, 2, "m ≥ 2p = 8"),
        (2, 3, 2, "m ≥ 2p = 4"),
        (4, 8, 1, "exactly 2 stage(s) per rank"),
        (4, 8, 3, "exactly 2 stage(s) per rank"),
        (0, 8, 2, "p = 0"),
        (4, 0, 2, "m = 0"),
    ] {
        match generate(ScheduleKind::DualPipeV, p, m, v) {
            Err(ScheduleError::Unsupported { schedule, reason }) => {
                assert_eq!(schedule, "dualpipe-v");
                assert!(reason.contains(rule), "p={p} m={m} v={v}: {reason}");
            }
            other => panic!("p={p} m={m} v={v}: {other:?}"),
        }
    }
}

#[test]
fn steady_bubble_is_dualpipes_published_figure_and_beats_1f1b() {
    // (T_F, T_I, T_W) in chunk costs. The published formula holds exactly when
    // T_F = T_I ≥ T_W (the W's then fill what the overlapped pairs leave).
    let exact = [
        (1.0, 1.0, 1.0),
        (1.0, 1.0, 0.5),
        (1.0, 1.0, 0.25),
        (2.0, 2.0, 1.0),
    ];
    // Outside those assumptions: printed, bounded by 1F1B.
    let other = [
        (2.0, 1.0, 1.0),
        (1.0, 2.0, 1.0),
        (1.0, 1.5, 0.5),
        (1.0, 1.0, 2.0),
    ];
    println!(
        "T_F T_I T_W   p   m  worst-rank idle  published  1F1B idle  steady ratio  1F1B ratio"
    );
    for (costs, assert_exact) in [(&exact, true), (&other, false)] {
        for &cost @ (f, i, w) in costs {
            let model = CostModel::uniform(f, i, w, 0.0);
            // 1F1B on the same ranks: one stage per rank, i.e. two chunks' costs.
            let stage_model = CostModel::uniform(2.0 * f, 2.0 * i, 2.0 * w, 0.0);
            for p in 2..=8 {
                for m in [2 * p, 3 * p + 1, 4 * p] {
                    let t = simulate(&dualpipe_v(p, m), &model).unwrap();
                    let one_f = generate(ScheduleKind::OneFOneB, p, m, 1).unwrap();
                    let base = simulate(&one_f, &stage_model).unwrap();
                    let (idle, published) = (t.worst_idle(), published_bubble(p, cost));
                    println!(
                        "{f:>3} {i:>3} {w:>3} {p:>3} {m:>3} {idle:>16} {published:>10} {:>10} \
                         {:>12.4} {:>11.4}",
                        base.worst_idle(),
                        t.steady_bubble_ratio,
                        base.steady_bubble_ratio
                    );
                    let what = format!("(T_F, T_I, T_W)={cost:?} p={p} m={m}");
                    if assert_exact {
                        assert!(
                            (idle - published).abs() < EPS,
                            "{what}: worst-rank idle {idle}, published {published}"
                        );
                    }
                    // Same model, same ranks, same work: less idle and a smaller ratio.
                    assert!(
                        (t.ranks.iter().map(|r| r.busy).sum::<f64>()
                            - base.ranks.iter().map(|r| r.busy).sum::<f64>())
                        .abs()
                            < EPS,
                        "{what}"
                    );
                    assert!(idle < base.worst_idle(), "{what}");
                    assert!(
                        t.steady_bubble_ratio < base.steady_bubble_ratio,
                        "{what}: {} vs 1F1B {}",
                        t.steady_bubble_ratio,
                        base.steady_bubble_ratio
                    );
                    // Equal per-action costs (the same cost model for both) too.
                    let equal = simulate(&one_f, &model).unwrap();
                    assert!(
                        t.steady_bubble_ratio < equal.steady_bubble_ratio,
                        "{what}: {} vs 1F1B at equal costs {}",
                        t.steady_bubble_ratio,
                        equal.steady_bubble_ratio
                    );
                }
            }
        }
    }
}
