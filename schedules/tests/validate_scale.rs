//! The validator and lowering are O(actions): a p = 128, v = 2, m = 4096 plan (millions of
//! actions once lowered) is checked in well under a second in release builds.
//!
//! The bound asserted here is loose (the test machine is shared); the figure is printed.

use std::time::Instant;

use pipefill_schedules::{ScheduleKind, ValidateOptions, generate, lower, validate};

#[test]
fn validates_millions_of_actions_quickly() {
    let plan = generate(ScheduleKind::Interleaved1F1B, 128, 4096, 2).unwrap();
    let t = Instant::now();
    let lowered = lower(&plan).unwrap();
    let lower_s = t.elapsed().as_secs_f64();
    let opts = ValidateOptions::default();
    let t = Instant::now();
    validate(&plan, &opts).unwrap();
    let compute_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let v = validate(&lowered, &opts).unwrap();
    let lowered_s = t.elapsed().as_secs_f64();
    println!(
        "interleaved-1f1b p=128 v=2 m=4096: {} compute actions, {} lowered; \
         lower {lower_s:.3} s, validate compute-only {compute_s:.3} s, lowered {lowered_s:.3} s",
        plan.num_actions(),
        lowered.num_actions()
    );
    assert_eq!(v.peak_memory.len(), 128);
    assert!(lowered.num_actions() > 3_000_000);
    assert!(lowered_s < 5.0, "validating took {lowered_s:.3} s");
}
