//! Damaged plans never panic the validator or lowering: each gets a verdict, and whatever
//! the validator accepts, lowering turns into a plan the validator accepts again.

use pipefill_schedules::{
    Action, ActionKind, ScheduleKind, ValidateOptions, generate, lower, parse_csv, to_csv, validate,
};

/// A small deterministic generator (no dependency needed for a test).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}

#[test]
fn damaged_plans_get_a_verdict_not_a_panic() {
    let mut rng = Lcg(7);
    let opts = ValidateOptions::default();
    let kinds = [
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbV,
    ];
    let (mut accepted, mut rejected) = (0, 0);
    for round in 0..400 {
        let kind = kinds[round % kinds.len()];
        let ranks = 2 + rng.next(3);
        let microbatches = ranks * (1 + rng.next(3));
        let base =
            generate(kind, ranks, microbatches, kind.default_chunks()).expect("a supported shape");
        let mut plan = if round % 2 == 0 {
            base
        } else {
            lower(&base).unwrap()
        };
        for _ in 0..1 + rng.next(2) {
            let r = rng.next(plan.num_ranks());
            let len = plan.ranks[r].len();
            let (i, j) = (rng.next(len), rng.next(len));
            match rng.next(6) {
                0 => plan.ranks[r].swap(i, j),
                1 => {
                    plan.ranks[r].remove(i);
                }
                2 => {
                    let a = plan.ranks[r][i];
                    plan.ranks[r].insert(j, a);
                }
                3 => {
                    if let Some(a) = plan.ranks[r][i].as_mut() {
                        a.stage = (a.stage + 1 + rng.next(3) as u32) % (plan.stages as u32 + 1);
                    }
                }
                4 => {
                    if let Some(a) = plan.ranks[r][i].as_mut() {
                        a.microbatch += rng.next(2) as u32;
                    }
                }
                _ => {
                    let kinds = [ActionKind::SendF, ActionKind::RecvB, ActionKind::W];
                    let a = Action::new(kinds[rng.next(3)], rng.next(plan.stages) as u32, 0);
                    plan.ranks[r].insert(i, Some(a));
                }
            }
        }
        match validate(&plan, &opts) {
            Ok(_) => {
                accepted += 1;
                let lowered = lower(&plan).expect("a valid plan lowers");
                validate(&lowered, &opts).expect("a lowered valid plan is valid");
            }
            Err(e) => {
                rejected += 1;
                assert!(!e.to_string().is_empty());
                assert!(
                    lower(&plan).is_err(),
                    "lower accepted what validate rejects: {e}"
                );
            }
        }
        // The CSV form holds any plan's lists; reading it back gives the same lists.
        if let Ok(back) = parse_csv(&to_csv(&plan), "damaged.csv") {
            assert_eq!(back.ranks, plan.ranks);
        }
    }
    assert!(
        rejected > 100,
        "only {rejected} of 400 damaged plans rejected"
    );
    assert!(
        accepted > 0,
        "no damage was harmless (e.g. swapping idle steps)"
    );
}
