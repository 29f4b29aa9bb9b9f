//! PyTorch pipelining's own schedule files, read, checked, lowered, written back and timed.
//!
//! The fixtures (tests/fixtures/torch/, copied from the team's shared/fixtures/torch/) were written by the PyTorch project: ZB1P on
//! 2 ranks (4 stages, looped, 8 micro-batches, split backward, idle cells) and DualPipeV on
//! 4 ranks (8 stages, V-shaped, 10 micro-batches, OVERLAP_F_B composites). Reading them
//! and writing them back byte for byte is the interchange contract; validating and
//! simulating them checks the validator and simulator against schedules nobody here wrote.

use std::path::PathBuf;

use pipefill::schedules::{
    ActionKind, CostModel, Placement, Plan, ScheduleKind, ValidateOptions, generate, lower,
    peak_memory, read_plan, simulate, to_csv, validate,
};

const ZB1P: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/torch/zb1p_2rank_2stagep_compute.csv"
);
const DUALPIPEV: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/torch/dualpipev_4rank_10mb.csv"
);

fn load(path: &str) -> (Plan, String) {
    let path = PathBuf::from(path);
    let plan = read_plan(&path).unwrap_or_else(|e| panic!("{e}"));
    let bytes = std::fs::read_to_string(&path).unwrap();
    (plan, bytes)
}

#[test]
fn zb1p_loads_with_its_shape() {
    let (plan, _) = load(ZB1P);
    assert_eq!(plan.num_ranks(), 2);
    assert_eq!(plan.stages, 4);
    assert_eq!(plan.microbatches, 8);
    assert_eq!(plan.placement, Placement::Looped);
    assert_eq!(plan.stage_rank, vec![0, 1, 0, 1]);
    assert!(plan.splits_backward());
    // The file's idle cells survive as idle steps: rank 0's 4th cell, rank 1's 1st.
    assert_eq!(plan.ranks[0][3], None);
    assert_eq!(plan.ranks[1][0], None);
}

#[test]
fn dualpipev_loads_with_its_shape() {
    let (plan, _) = load(DUALPIPEV);
    assert_eq!(plan.num_ranks(), 4);
    assert_eq!(plan.stages, 8);
    assert_eq!(plan.microbatches, 10);
    assert_eq!(plan.placement, Placement::VShape);
    assert_eq!(plan.stage_rank, vec![0, 1, 2, 3, 3, 2, 1, 0]);
    let overlaps = plan
        .iter()
        .filter(|(_, _, a)| a.kind == ActionKind::OverlapFB)
        .count();
    assert!(
        overlaps > 0,
        "the fixture's OVERLAP_F_B composites were lost"
    );
}

#[test]
fn fixtures_round_trip_byte_identically() {
    for path in [ZB1P, DUALPIPEV] {
        let (plan, bytes) = load(path);
        assert_eq!(to_csv(&plan), bytes, "{path} changed on the way back");
    }
}

#[test]
fn fixtures_validate_lower_and_validate_again() {
    let opts = ValidateOptions::default();
    for path in [ZB1P, DUALPIPEV] {
        let (plan, _) = load(path);
        let v = validate(&plan, &opts).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(v.peak_memory, peak_memory(&plan, &opts.cost));
        assert!(v.peak_memory.iter().all(|&m| m > 0.0));

        let lowered = lower(&plan).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(!lowered.is_compute_only());
        validate(&lowered, &opts).unwrap_or_else(|e| panic!("{path} lowered: {e}"));
        // Lowering adds SEND/RECV only: the compute order of every rank is unchanged.
        assert_eq!(lowered.compute_only(), plan.compute_only());
        // Same-rank hand-overs (DualPipeV's turn at stages 3 → 4) get no SEND/RECV.
        for (_, _, a) in lowered.iter().filter(|(_, _, a)| a.kind.is_comm()) {
            let peer = match a.kind {
                ActionKind::SendF | ActionKind::RecvB => a.stage + 1,
                _ => a.stage - 1,
            };
            assert_ne!(
                lowered.rank_of(peer),
                lowered.rank_of(a.stage),
                "{path}: {a}"
            );
        }
        assert_eq!(lower(&lowered).unwrap(), lowered, "lowering is idempotent");
    }
}

#[test]
fn a_memory_limit_below_the_peak_names_a_rank() {
    let (plan, _) = load(ZB1P);
    let cost = CostModel::default();
    let peak = peak_memory(&plan, &cost);
    let worst = peak.iter().cloned().fold(0.0, f64::max);
    let opts = ValidateOptions {
        cost,
        memory_limit: Some(worst - 0.25),
    };
    let msg = validate(&plan, &opts).unwrap_err().to_string();
    assert!(msg.starts_with("rank "), "{msg}");
    assert!(msg.contains("over the limit"), "{msg}");
}

/// Both fixtures simulate, compute-only and lowered alike, and beat 1F1B's steady bubble
/// ratio for the same ranks and micro-batches. With equal T_F = T_I = T_W and no link
/// latency, 1F1B idles (p − 1)(T_F + T_I + T_W) per rank out of a span of
/// (m + p − 1)(T_F + T_I + T_W): 1/9 for p = 2, m = 8 and 3/13 for p = 4, m = 10. ZB1P
/// fills that with W and a second chunk; DualPipeV with its two-way V.
#[test]
fn fixtures_simulate_with_less_bubble_than_1f1b() {
    let cost = CostModel::uniform(1.0, 1.0, 1.0, 0.0);
    for (path, ranks, microbatches) in [(ZB1P, 2, 8), (DUALPIPEV, 4, 10)] {
        let (plan, _) = load(path);
        let t = simulate(&plan, &cost).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(t.makespan > 0.0, "{path}");
        // Lowering adds no wait: the lowered plan times exactly like the compute-only one,
        // with free links and with slow ones.
        let lowered = lower(&plan).unwrap();
        for comm in [0.0, 0.5] {
            let c = CostModel::uniform(1.0, 1.0, 1.0, comm);
            let a = simulate(&plan, &c).unwrap();
            let b = simulate(&lowered, &c).unwrap_or_else(|e| panic!("{path} lowered: {e}"));
            assert!(
                (a.makespan - b.makespan).abs() < 1e-9,
                "{path}: lowering changed the makespan with comm {comm} ({} vs {})",
                b.makespan,
                a.makespan
            );
        }

        let base = generate(ScheduleKind::OneFOneB, ranks, microbatches, 1).unwrap();
        let tb = simulate(&base, &cost).unwrap();
        let closed_form = (ranks - 1) as f64 / (microbatches + ranks - 1) as f64;
        assert!((tb.steady_bubble_ratio - closed_form).abs() < 1e-9);
        println!(
            "{}: makespan {}, steady bubble {:.4}, bubble {:.4}; 1F1B p={ranks} m={microbatches}: \
             steady bubble {:.4}",
            path.rsplit('/').next().unwrap_or(path),
            t.makespan,
            t.steady_bubble_ratio,
            t.bubble_ratio,
            tb.steady_bubble_ratio
        );
        assert!(
            t.steady_bubble_ratio < tb.steady_bubble_ratio,
            "{path}: steady bubble {} is not below 1F1B's {}",
            t.steady_bubble_ratio,
            tb.steady_bubble_ratio
        );
    }
}
