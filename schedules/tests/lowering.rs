//! Lowering every built-in schedule: the result validates, cannot hang, and — because each
//! RECV sits as late as its link's order allows — times exactly like the compute-only plan,
//! whatever the cost model.

use pipefill_schedules::{
    ActionKind, CostModel, ScheduleKind, StageCost, ValidateOptions, generate, lower, simulate,
    validate,
};

fn cost_models() -> Vec<CostModel> {
    let mut uneven = CostModel::uniform(1.0, 1.3, 0.6, 0.25);
    uneven.rank_speed = vec![1.0, 0.7, 1.4, 1.0, 0.9, 1.1, 1.2, 0.8];
    let mut per_stage = CostModel::uniform(1.0, 1.0, 1.0, 0.5);
    per_stage.stage = (0..16)
        .map(|s| StageCost {
            f: 1.0 + (s % 3) as f64 * 0.4,
            i: 1.5,
            w: 0.5 + (s % 2) as f64,
        })
        .collect();
    vec![CostModel::uniform(1.0, 1.0, 1.0, 0.0), uneven, per_stage]
}

#[test]
fn every_generator_lowers_to_a_valid_plan_with_the_same_timing() {
    let opts = ValidateOptions::default();
    let mut checked = Vec::new();
    for kind in ScheduleKind::ALL {
        for (ranks, microbatches) in [(2, 4), (4, 8), (4, 12), (8, 16)] {
            let chunks = kind.default_chunks();
            let plan = match generate(kind, ranks, microbatches, chunks) {
                Ok(p) => p,
                Err(_) => continue, // a shape the family does not support
            };
            let what = format!("{} p={ranks} m={microbatches}", kind.name());
            checked.push(kind);
            validate(&plan, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
            let lowered = lower(&plan).unwrap_or_else(|e| panic!("{what}: {e}"));
            validate(&lowered, &opts).unwrap_or_else(|e| panic!("{what} lowered: {e}"));
            assert_eq!(lowered.compute_only(), plan.compute_only(), "{what}");
            let sends = lowered
                .iter()
                .filter(|(_, _, a)| matches!(a.kind, ActionKind::SendF | ActionKind::SendB))
                .count();
            let cross_links = (0..plan.stages as u32 - 1)
                .filter(|&s| plan.rank_of(s) != plan.rank_of(s + 1))
                .count();
            assert_eq!(sends, 2 * cross_links * microbatches, "{what}");
            for cost in cost_models() {
                let a = simulate(&plan, &cost).unwrap_or_else(|e| panic!("{what}: {e}"));
                let b = simulate(&lowered, &cost).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(
                    (a.makespan - b.makespan).abs() < 1e-9 * a.makespan.max(1.0),
                    "{what}: lowering changed the makespan from {} to {} (comm {})",
                    a.makespan,
                    b.makespan,
                    cost.comm
                );
            }
        }
    }
    for kind in ScheduleKind::ALL {
        assert!(
            checked.contains(&kind),
            "no shape of {} was generated",
            kind.name()
        );
    }
    assert!(checked.len() >= 20, "only {} plans checked", checked.len());
}
