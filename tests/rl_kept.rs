//! The RL update's pipeline kept alive across RL steps ([`RlTrainer::keep_update_ranks`],
//! [`PipelineTrainer::run_kept`]) lands bit for bit where rebuilding it from a checkpoint
//! every step does: parameters, AdamW moments and step counts, over steps whose
//! micro-batch counts (and so plans) differ, under schedules with one and two stages per
//! rank; and a training run continued from kept ranks equals the uninterrupted run.

mod common;

use common::assert_bitwise;
use common::job::tiny_job;
use common::scripted::scripted_batch;
use pipefill::config::{Filler, JobConfig};
use pipefill::model::Gpt;
use pipefill::model::checkpoint::ADAM_V_PREFIX;
use pipefill::pipeline::PipelineError;
use pipefill::pipeline::{KeptRun, PipelineTrainer};
use pipefill::rl::RlError;
use pipefill::rl::generator::{RolloutBatch, RolloutGenerator, RolloutRequest};
use pipefill::rl::prompts::step_prompts;
use pipefill::rl::trainer::RlTrainer;
use pipefill::rl::warm_up::warm_up;
use pipefill::tensor::CpuBackend;

/// Per step, which prompts' groups are uniform (every completion right or wrong, so
/// advantage 0 and left out of the update); the other groups have one right completion.
/// Step 0 keeps every group, step 1 half, step 2 none (one micro-batch), step 3 all.
struct Varying {
    job: JobConfig,
}

const UNIFORM: [&[(usize, bool)]; 4] = [
    &[],
    &[(0, true), (2, false)],
    &[(0, true), (1, false), (2, true), (3, false)],
    &[],
];

impl RolloutGenerator<CpuBackend> for Varying {
    fn generate(
        &mut self,
        _policy: &Gpt<CpuBackend>,
        request: RolloutRequest<'_>,
    ) -> Result<RolloutBatch, RlError> {
        let step = request.step;
        let tasks = step_prompts(&self.job, step)?;
        scripted_batch(
            request.prompts,
            &tasks,
            request.group,
            UNIFORM[step as usize % UNIFORM.len()],
        )
    }

    fn speculative(&self) -> bool {
        false
    }
}

/// A tiny RL job: 4 prompts of 3 completions over 2 ranks of `schedule`.
fn rl_job(schedule: &str) -> JobConfig {
    let sets: Vec<String> = [
        "model.d_model=16",
        "model.heads=2",
        "model.layers=4",
        "model.seq_len=48",
        "stages=2",
        &format!("schedule=\"{schedule}\""),
        "data.families=[\"parity\"]",
        "data.max_size=2",
        "train.micro_batch_size=2",
        "rl.prompts=4",
        "rl.group=3",
        "rl.max_new_tokens=24",
        "rl.warmup_steps=2",
        "rl.lr=1e-2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    JobConfig::embedded(&sets).unwrap()
}

/// Bit patterns of every parameter of `gpt`, in model order.
fn param_bits(gpt: &Gpt<CpuBackend>) -> Vec<(String, Vec<u32>)> {
    common::job::named_bits(gpt.param_names(), |n| gpt.param_values(n).unwrap())
}

#[test]
fn kept_update_ranks_equal_rebuilding_the_pipeline_every_step_bitwise() {
    // Interleaved 1F1B runs a multiple of the ranks' count of micro-batches only.
    for (schedule, counts) in [("1f1b", [4, 2, 1]), ("interleaved-1f1b", [4, 2, 2])] {
        let job = rl_job(schedule);
        let start = warm_up(&job, |_| {}).unwrap();
        let mut kept = RlTrainer::new(&job, start.clone()).unwrap();
        let mut rebuilt = RlTrainer::new(&job, start.clone())
            .unwrap()
            .keep_update_ranks(false);
        let mut micro_batches = Vec::new();
        for step in 0..UNIFORM.len() {
            let mut engine = Varying { job: job.clone() };
            let a = kept.run_step(&mut engine, |_| {}).unwrap();
            let b = rebuilt.run_step(&mut engine, |_| {}).unwrap();
            let figures = |m: &pipefill::rl::step_metrics::RlStepMetrics| {
                (
                    m.update_micro_batches,
                    m.skipped_groups,
                    m.surrogate_loss.to_bits(),
                    m.grad_norm.to_bits(),
                    m.lr.to_bits(),
                )
            };
            assert_eq!(figures(&a), figures(&b), "{schedule} step {step}");
            micro_batches.push(a.update_micro_batches);
            assert!(
                param_bits(kept.policy()) == param_bits(rebuilt.policy()),
                "{schedule} step {step}: the policies differ"
            );
            // Reading the kept state out leaves the ranks as they are.
            assert_bitwise(&kept.checkpoint().unwrap(), &rebuilt.checkpoint().unwrap());
        }
        assert_eq!(
            micro_batches[..3],
            counts,
            "{schedule}: the plans differ per step"
        );
        let (a, b) = (kept.checkpoint().unwrap(), rebuilt.checkpoint().unwrap());
        assert_eq!(a.meta.step, start.meta.step + UNIFORM.len() as u64);
        assert_eq!(a.meta.optimizer_step, b.meta.optimizer_step);
        assert!(
            a.tensors.iter().any(|t| t.name.starts_with(ADAM_V_PREFIX)),
            "moments saved"
        );
        assert_bitwise(&a, &b);
        assert!(
            a.tensors
                .iter()
                .zip(&start.tensors)
                .any(|(x, y)| x.data != y.data)
        );
    }
}

/// Kept ranks continue a training run exactly: one kept step then two more equals three
/// steps in one run, and the kept state's checkpoint is the exported one's.
#[test]
fn a_run_continued_from_kept_ranks_equals_the_uninterrupted_run() {
    let job = tiny_job(2, 3);
    let trainer = PipelineTrainer::from_job(&job).unwrap();
    let whole = trainer.run(3, |_| {}).unwrap();
    let first = trainer.run_kept(None, 1).unwrap();
    assert_eq!(first.steps.len(), 1);
    assert_eq!(first.ranks.next_step(), 1);
    let rest = trainer.run_kept(Some(first.ranks), 2).unwrap();
    assert_eq!(
        rest.steps.iter().map(|m| m.step).collect::<Vec<_>>(),
        [1, 2]
    );
    for (m, w) in rest.steps.iter().zip(&whole.steps[1..]) {
        assert_eq!(
            (m.loss.to_bits(), m.grad_norm.to_bits()),
            (w.loss.to_bits(), w.grad_norm.to_bits())
        );
    }
    assert_bitwise(
        &rest.ranks.checkpoint().unwrap(),
        &whole.checkpoint().unwrap(),
    );
    let mut model = whole.model().unwrap();
    let before = param_bits(&model);
    let mut other = PipelineTrainer::from_job(&tiny_job(2, 1))
        .unwrap()
        .run(1, |_| {})
        .unwrap()
        .model()
        .unwrap();
    rest.ranks.copy_params_into(&mut other).unwrap();
    assert!(param_bits(&other) == before, "copied into another model");
    rest.ranks.copy_params_into(&mut model).unwrap();
    assert!(param_bits(&model) == before);
}

#[test]
fn a_kept_run_refuses_what_it_cannot_keep() {
    let job = tiny_job(2, 1);
    let trainer = PipelineTrainer::from_job(&job).unwrap();
    let err = |r: Result<KeptRun, PipelineError>| r.unwrap_err().to_string();
    let drafter = trainer.clone().filler(Filler::Drafter);
    assert!(err(drafter.run_kept(None, 1)).contains("filler"));
    assert!(err(trainer.run_kept(None, 0)).contains("at least 1"));
    let ranks = trainer.run_kept(None, 1).unwrap().ranks;
    // Two stages per rank instead of one: the kept ranks do not fit that plan.
    let mut interleaved = job.clone();
    interleaved.schedule = "interleaved-1f1b".parse().unwrap();
    let other = PipelineTrainer::from_job(&interleaved).unwrap();
    assert!(!ranks.fits(&other));
    assert!(err(other.run_kept(Some(ranks), 1)).contains("places other stages"));
    let ranks = trainer.run_kept(None, 1).unwrap().ranks;
    let mut wider = job.clone();
    wider.model.d_model = 32;
    let wider = PipelineTrainer::from_job(&wider).unwrap();
    assert!(err(wider.run_kept(Some(ranks), 1)).contains("model"));
}
