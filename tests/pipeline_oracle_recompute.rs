//! Activation recomputation against the oracle: pipelined training with `train.recompute`
//! `selective`, `full` or one mode per rank leaves every parameter, loss and gradient norm
//! **bitwise** the reference trainer's without recomputation, under schedules with fused
//! backwards (1F1B), split ones whose W's wait (ZB-H1, ZB-H2) and two stages per rank
//! (interleaved 1F1B, ZB-V), and for a Llama-shaped model. A recomputed forward is the same
//! calls on the same values as the first one, so anything but bitwise is a bug.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use pipefill::config::{JobConfig, ScheduleChoice};
use pipefill::model::config::Positions;
use pipefill::model::{GptConfig, Recompute, RecomputeSetting};
use pipefill::pipeline::{Clock, PipelineTrainer};
use pipefill::schedules::ScheduleKind;
use pipefill::tensor::Activation;
use pipefill::train::{StepMetrics, Trainer};

mod common;
use common::job::tiny_job;

const STEPS: u64 = 3;

/// The oracle test's job: the tiny job 8 layers deep, 8 micro-batches, clipped.
fn job(recompute: RecomputeSetting) -> JobConfig {
    let mut job = tiny_job(4, STEPS);
    job.schedule = ScheduleChoice::None;
    job.model.layers = 8;
    job.train.micro_batches = 8;
    job.train.recompute = recompute;
    job
}

fn llama(mut job: JobConfig) -> JobConfig {
    job.model = GptConfig {
        kv_heads: Some(1),
        positions: Positions::Rope,
        activation: Activation::Swiglu,
        qkv_bias: true,
        tie_embeddings: true,
        ..job.model
    };
    job
}

fn every(mode: Recompute) -> RecomputeSetting {
    RecomputeSetting::Every(mode)
}

struct Outcome {
    steps: Vec<StepMetrics>,
    params: BTreeMap<String, Vec<u32>>,
}

/// The reference trainer's [`STEPS`] on `job` (its `train.recompute` applies).
fn reference(job: &JobConfig) -> Outcome {
    let mut trainer = Trainer::reference(&job.model, &job.data, &job.train).unwrap();
    let steps = (0..STEPS).map(|_| trainer.train_step().unwrap()).collect();
    let model = trainer.model();
    let params = model
        .param_names()
        .into_iter()
        .map(|n| {
            let bits = model.param_values(&n).unwrap();
            (n, bits.iter().map(|v| v.to_bits()).collect())
        })
        .collect();
    Outcome { steps, params }
}

/// The reference trainer without recomputation: what every run here must equal.
fn oracle(llama_shaped: bool) -> &'static Outcome {
    static PLAIN: OnceLock<Outcome> = OnceLock::new();
    static LLAMA: OnceLock<Outcome> = OnceLock::new();
    let base = job(RecomputeSetting::default());
    match llama_shaped {
        false => PLAIN.get_or_init(|| reference(&base)),
        true => LLAMA.get_or_init(|| reference(&llama(base))),
    }
}

/// Parameters bitwise; the step's loss and gradient norm within `tolerance` (a pipeline
/// sums the micro-batches' losses and the ranks' squared norms in its own order, as in
/// tests/pipeline_oracle.rs).
fn assert_same(name: &str, got: &Outcome, want: &Outcome, tolerance: f32) {
    for (g, w) in got.steps.iter().zip(&want.steps) {
        let close = |a: f32, b: f32| (a - b).abs() <= tolerance * b.abs().max(1.0);
        assert!(close(g.loss, w.loss), "{name}: step {} loss", g.step);
        assert!(
            close(g.grad_norm, w.grad_norm),
            "{name}: step {} grad norm",
            g.step
        );
    }
    assert_eq!(got.steps.len(), want.steps.len(), "{name}: steps");
    assert_eq!(
        got.params.keys().collect::<Vec<_>>(),
        want.params.keys().collect::<Vec<_>>(),
        "{name}: parameter names"
    );
    for (n, bits) in &got.params {
        assert!(
            bits == &want.params[n],
            "{name}: {n} differs from the reference"
        );
    }
}

/// `kind` pipelined over 4 ranks on `job`, against the oracle.
fn pipelined(name: &str, job: &JobConfig, kind: ScheduleKind) {
    let trainer = PipelineTrainer::builtin(job, kind, None)
        .unwrap()
        .clock(Clock::virtual_free());
    let run = trainer.run(STEPS, |_| {}).unwrap();
    let params = run
        .param_names()
        .into_iter()
        .map(|n| {
            let bits = run.param_values(n).unwrap().iter().map(|v| v.to_bits());
            (n.to_string(), bits.collect())
        })
        .collect();
    let got = Outcome {
        steps: run.steps.clone(),
        params,
    };
    let llama_shaped = job.model.positions == Positions::Rope;
    assert_same(&format!("{kind} {name}"), &got, oracle(llama_shaped), 1e-6);
}

const SCHEDULES: [ScheduleKind; 5] = [
    ScheduleKind::OneFOneB,
    ScheduleKind::ZbH1,
    ScheduleKind::ZbH2,
    ScheduleKind::Interleaved1F1B,
    ScheduleKind::ZbV,
];

#[test]
fn the_reference_trainer_recomputing_is_bitwise_the_one_that_does_not() {
    for mode in [Recompute::Selective, Recompute::Full] {
        let got = reference(&job(every(mode)));
        assert_same(&format!("reference {mode}"), &got, oracle(false), 0.0);
    }
}

#[test]
fn selective_recomputation_is_bitwise_the_reference() {
    for kind in SCHEDULES {
        pipelined("selective", &job(every(Recompute::Selective)), kind);
    }
}

#[test]
fn full_recomputation_is_bitwise_the_reference() {
    for kind in SCHEDULES {
        pipelined("full", &job(every(Recompute::Full)), kind);
    }
}

#[test]
fn per_rank_recomputation_is_bitwise_the_reference() {
    use Recompute::*;
    let per_rank = RecomputeSetting::PerRank(vec![Full, Selective, None, Full]);
    for kind in [ScheduleKind::ZbH1, ScheduleKind::ZbV] {
        pipelined("per rank", &job(per_rank.clone()), kind);
    }
}

#[test]
fn a_llama_shaped_model_recomputing_is_bitwise_the_reference() {
    for mode in [Recompute::Selective, Recompute::Full] {
        for kind in [ScheduleKind::ZbH1, ScheduleKind::ZbV] {
            pipelined(&format!("llama {mode}"), &llama(job(every(mode))), kind);
        }
    }
}
