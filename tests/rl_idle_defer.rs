//! `rl.advanced.drafter_work` through [`PipelineRollouts::generate`]: with `"idle"` (what the
//! gaps did not take is deferred) no drafter
//! work runs after a rollout (each step's `drafter_work` says so, and its budget balances
//! against what the gaps trained, what was carried and what was dropped); with
//! `"idle-then-after"` the budget's rest and the held-out evaluation run there, as before.

use pipefill::config::JobConfig;
use pipefill::data::tokenizer::{BOS, EOS};
use pipefill::model::{Cut, Gpt};
use pipefill::rl::generator::{RolloutGenerator, RolloutRequest};
use pipefill::rl::rollout::idle::{DrafterAccount, DrafterWork, EvalWork};
use pipefill::rl::trainer_spec::PipelineRollouts;
use pipefill::tensor::CpuBackend;

const SLICES: usize = 3;
const STEPS: u64 = 3;

/// A tiny job speculating at every live-batch size (no plain arm), and its policy.
fn job(leftover: &str) -> (JobConfig, Gpt<CpuBackend>) {
    let sets: Vec<String> = [
        "model.d_model=16",
        "model.heads=2",
        "model.layers=4",
        "model.seq_len=40",
        "stages=2",
        "rl.spec_threshold=64",
        "rl.advanced.plain_arm=false",
        &format!("rl.drafter_slices={SLICES}"),
        &format!(
            "rl.advanced.drafter_work=\"{}\"",
            match leftover {
                "defer" => "idle",
                _ => "idle-then-after",
            }
        ),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let job = JobConfig::embedded(&sets).unwrap();
    let policy = Gpt::new(&job.model, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
    (job, policy)
}

/// Each step's account of `STEPS` rollouts of 4 prompts × 3 completions.
fn accounts(leftover: &str) -> Vec<(DrafterAccount, f64)> {
    let (job, policy) = job(leftover);
    let mut engine = PipelineRollouts::new(&job).unwrap();
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| [BOS].into_iter().chain((0..2 + i).map(|t| 5 + t)).collect())
        .collect();
    (0..STEPS)
        .map(|step| {
            let request = RolloutRequest {
                prompts: &prompts,
                group: 3,
                max_new: 12,
                eos: EOS,
                step,
            };
            let batch = engine.generate(&policy, request).unwrap();
            assert!(batch.acceptance_length.is_some(), "step {step} speculated");
            (
                batch.drafter_work.expect("an idle router"),
                batch.drafter_seconds,
            )
        })
        .collect()
}

#[test]
fn deferred_drafter_work_never_runs_after_the_rollout() {
    let steps = accounts("defer");
    let budget = steps[0].0.budget_rows;
    assert!(budget > 0);
    let mut carried = 0;
    for (step, (a, seconds)) in steps.iter().enumerate() {
        assert_eq!(a.leftover, "defer");
        assert_eq!(a.after, DrafterWork::default(), "step {step}: {a:?}");
        assert_eq!(a.carried_in_rows, carried, "step {step}");
        assert_eq!(a.budget_rows, budget + carried, "step {step}");
        // Every row of the budget was trained in a gap, carried or dropped.
        assert_eq!(
            a.idle.rows + a.carried_out_rows + a.dropped_rows,
            a.budget_rows,
            "step {step}: {a:?}"
        );
        assert!(a.carried_out_rows <= budget, "step {step}: capped");
        carried = a.carried_out_rows;
        // The priors are measured before the first rollout only, and counted.
        assert_eq!(a.startup_seconds > 0.0, step == 0, "step {step}");
        assert!(*seconds >= a.startup_seconds);
        // Held-out rows: evaluated in the gaps, else (no α yet, or none for a step) here.
        let evaluated = a.eval_idle.rows + a.eval_after.rows + a.eval_skipped_rows;
        assert!((1..=4).contains(&evaluated), "step {step}: {a:?}");
    }
    // The first step has no α to keep: if its gaps evaluated nothing, it was done after.
    let first = &steps[0].0;
    assert!(
        first.eval_idle.rows + first.eval_after.rows > 0,
        "{first:?}"
    );
}

#[test]
fn after_runs_the_rest_of_the_budget_and_the_evaluation_after_the_rollout() {
    for (step, (a, _)) in accounts("after").iter().enumerate() {
        assert_eq!(a.leftover, "after");
        assert_eq!(a.carried_in_rows, 0);
        assert_eq!((a.carried_out_rows, a.dropped_rows), (0, 0));
        assert_eq!(
            a.idle.rows + a.after.rows,
            a.budget_rows,
            "step {step}: {a:?}"
        );
        assert_eq!(a.idle.steps + a.after.steps, SLICES, "step {step}: {a:?}");
        assert_eq!(a.eval_idle, EvalWork::default());
        assert_eq!(a.eval_after.pieces, 1);
        assert_eq!(a.startup_seconds, 0.0);
    }
}
