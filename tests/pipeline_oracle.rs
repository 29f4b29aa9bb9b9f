//! Pipelined training against the oracle: for every built-in schedule and for PyTorch's
//! ZB1P fixture, K = 3 optimizer steps through the actor runtime leave every parameter
//! equal to the single-device reference trainer's (same data, same micro-batching, same
//! clipping), and the runtime ran each rank's actions in the plan's order.
//!
//! Tolerance. Every F, I, W of a (stage, micro-batch) is the same call on the same values
//! as the reference's, and each stage accumulates its weight gradients micro-batch by
//! micro-batch; every built-in schedule (and the fixture) runs a stage's W in micro-batch
//! order, so the gradients are the same sums of the same floats. Without clipping the
//! parameters are therefore **bitwise** the reference's, and that is asserted
//! (`unclipped_runs_are_bitwise_the_reference`).
//!
//! With clipping, the runtime decides the clip factor (`pipefill_actors::decide`) as
//! `max / norm`, the reference's `clip_scale`, from squared norms summed in the same order,
//! so clipped runs are bitwise the reference's too: `MAX_ABS_DIFF` is 0 on every parameter
//! value. (An earlier runtime used `max / (norm + 1e-6)` and drifted by about 1e-7 after
//! 3 steps; this bound catches any such change.)

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use pipefill::config::{JobConfig, ScheduleChoice};
use pipefill::model::GptConfig;
use pipefill::model::config::Positions;
use pipefill::model::init::INIT_STD;
use pipefill::pipeline::PipelineError;
use pipefill::pipeline::{Clock, PipelineRun, PipelineTrainer, StepMode};
use pipefill::schedules::{ScheduleKind, build, read_plan};
use pipefill::tensor::Activation;
use pipefill::train::{StepMetrics, Trainer};

mod common;
use common::job::{TINY_CLIP, tiny_job};

const STEPS: u64 = 3;
const MAX_ABS_DIFF: f32 = 0.0;
/// Small enough that the gradient norm exceeds it on some steps (asserted below), so the
/// clipped path is compared too.
const CLIP: f32 = TINY_CLIP;

fn job(stages: usize) -> JobConfig {
    job_clipped_at(stages, CLIP)
}

/// The test job with `train.clip = clip` (0: no clipping): the tiny job, 8 layers deep and
/// 8 micro-batches wide, with no schedule of its own (each test names its plan).
fn job_clipped_at(stages: usize, clip: f32) -> JobConfig {
    let mut job = tiny_job(stages, STEPS);
    job.schedule = ScheduleChoice::None;
    job.model.layers = 8;
    job.train.micro_batches = 8;
    job.train.clip = clip;
    job
}

/// The reference trainer's metrics and final parameters (same for every stage count).
struct Oracle {
    steps: Vec<StepMetrics>,
    params: BTreeMap<String, Vec<f32>>,
}

/// The oracle of the job clipped at `clip` (the test's `CLIP`, or 0).
fn oracle(clip: f32) -> &'static Oracle {
    static CLIPPED: OnceLock<Oracle> = OnceLock::new();
    static UNCLIPPED: OnceLock<Oracle> = OnceLock::new();
    let cell = if clip == 0.0 { &UNCLIPPED } else { &CLIPPED };
    cell.get_or_init(|| reference(&job_clipped_at(1, clip)))
}

/// The job of [`job`] with a Llama-shaped model: rotary positions, a SwiGLU MLP, 4 query
/// heads sharing 2 key/value heads, q/k/v biases (Qwen2) and the LM head tied to the token
/// embedding (so the first and last stages sum the tied gradient across ranks, or on one
/// rank under ZB-V's V-shaped placement).
fn llama_job(stages: usize) -> JobConfig {
    let mut job = job(stages);
    job.model = GptConfig {
        heads: 4,
        kv_heads: Some(2),
        positions: Positions::Rope,
        activation: Activation::Swiglu,
        qkv_bias: true,
        tie_embeddings: true,
        ..job.model
    };
    job
}

/// The oracle of [`llama_job`].
fn llama_oracle() -> &'static Oracle {
    static LLAMA: OnceLock<Oracle> = OnceLock::new();
    LLAMA.get_or_init(|| reference(&llama_job(1)))
}

/// [`STEPS`] of the reference trainer on `job`'s model, data and training settings.
fn reference(job: &JobConfig) -> Oracle {
    let mut trainer = Trainer::reference(&job.model, &job.data, &job.train).unwrap();
    let steps: Vec<_> = (0..STEPS).map(|_| trainer.train_step().unwrap()).collect();
    let model = trainer.model();
    let params = model
        .param_names()
        .into_iter()
        .map(|n| {
            let v = model.param_values(&n).unwrap();
            (n, v)
        })
        .collect();
    Oracle { steps, params }
}

/// Runs `trainer` for [`STEPS`] and checks it against the oracle of its job: bitwise
/// with or without clipping ([`MAX_ABS_DIFF`] is 0).
fn check_against_oracle(name: &str, trainer: &PipelineTrainer) -> PipelineRun {
    let clip = trainer.job().train.clip;
    assert!(clip == 0.0 || clip == CLIP, "the oracles know CLIP and 0");
    let oracle = if trainer.job().model == llama_job(1).model {
        assert_eq!(clip, CLIP, "the Llama oracle is clipped");
        llama_oracle()
    } else {
        assert_eq!(
            trainer.job().model,
            job(1).model,
            "a model the oracles know"
        );
        oracle(clip)
    };
    let bound = if clip == 0.0 { 0.0 } else { MAX_ABS_DIFF };
    let mut seen = Vec::new();
    let run = trainer.run(STEPS, |m| seen.push(m.step)).unwrap();
    assert_eq!(
        seen,
        (0..STEPS).collect::<Vec<_>>(),
        "{name}: on_step calls"
    );
    assert!(
        clip == 0.0 || oracle.steps.iter().any(|m| m.grad_norm > CLIP),
        "the oracle never clipped: lower CLIP so the clipped path is tested"
    );
    for (p, r) in run.steps.iter().zip(&oracle.steps) {
        assert_eq!(p.step, r.step);
        assert_eq!(p.tokens, r.tokens, "{name}: step {} tokens", p.step);
        assert_eq!(p.lr, r.lr, "{name}: step {} lr", p.step);
        assert!(
            (p.loss - r.loss).abs() <= 1e-6,
            "{name}: step {} loss {} vs reference {}",
            p.step,
            p.loss,
            r.loss
        );
        assert!(
            (p.grad_norm - r.grad_norm).abs() <= 1e-6 * r.grad_norm.max(1.0),
            "{name}: step {} grad norm {} vs reference {}",
            p.step,
            p.grad_norm,
            r.grad_norm
        );
    }
    let names: Vec<&str> = run.param_names();
    let want: Vec<&str> = oracle.params.keys().map(String::as_str).collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, want, "{name}: parameter names");
    let mut worst = (0.0f32, "");
    for n in names {
        let got = run.param_values(n).unwrap();
        let exp = &oracle.params[n];
        assert_eq!(got.len(), exp.len(), "{name}: {n} length");
        for (a, b) in got.iter().zip(exp) {
            let d = (a - b).abs();
            assert!(d.is_finite(), "{name}: {n} is not finite");
            if d > worst.0 {
                worst = (d, n);
            }
        }
    }
    let norms: Vec<String> = run
        .steps
        .iter()
        .map(|m| format!("{:.3}", m.grad_norm))
        .collect();
    println!(
        "{name:<28} max |Δparam| = {:.3e} ({}), grad norms [{}] (clip {clip})",
        worst.0,
        if worst.0 == 0.0 { "bitwise" } else { worst.1 },
        norms.join(", ")
    );
    assert!(
        worst.0 <= bound,
        "{name}: parameter {} differs from the reference by {:.3e} > {bound:.0e}",
        worst.1,
        worst.0
    );
    check_action_order(name, &run, trainer.job().schedule.is_auto());
    run
}

/// In virtual mode every rank's records follow its plan list exactly, iteration by
/// iteration (idle steps excepted), with the same positions. An auto-scheduled run changes
/// plans as costs are measured, and `run.plan` is its last one: only its last iteration
/// is compared.
fn check_action_order(name: &str, run: &PipelineRun, replans: bool) {
    assert_eq!(run.report.iterations.len() as u64, STEPS);
    let skip = if replans { STEPS as usize - 1 } else { 0 };
    for it in run.report.iterations.iter().skip(skip) {
        for (rank, list) in run.plan.ranks.iter().enumerate() {
            let want: Vec<_> = list
                .iter()
                .enumerate()
                .filter_map(|(i, a)| a.map(|a| (i, a)))
                .collect();
            let got: Vec<_> = it.rank_records(rank).map(|r| (r.index, r.action)).collect();
            assert_eq!(
                got, want,
                "{name}: iteration {} rank {rank} ran its actions out of plan order",
                it.iteration
            );
        }
    }
}

fn builtin(kind: ScheduleKind) {
    let job = job(4);
    let trainer = PipelineTrainer::builtin(&job, kind, None)
        .unwrap()
        .clock(Clock::virtual_free());
    assert_eq!(trainer.plan().num_ranks(), 4);
    check_against_oracle(kind.name(), &trainer);
}

#[test]
fn gpipe_matches_the_reference() {
    builtin(ScheduleKind::GPipe);
}

#[test]
fn one_f_one_b_matches_the_reference() {
    builtin(ScheduleKind::OneFOneB);
}

#[test]
fn interleaved_1f1b_matches_the_reference() {
    builtin(ScheduleKind::Interleaved1F1B);
}

#[test]
fn looped_bfs_matches_the_reference() {
    builtin(ScheduleKind::LoopedBfs);
}

#[test]
fn zb_h1_matches_the_reference() {
    builtin(ScheduleKind::ZbH1);
}

#[test]
fn zb_h2_matches_the_reference() {
    builtin(ScheduleKind::ZbH2);
}

#[test]
fn zb_v_matches_the_reference() {
    builtin(ScheduleKind::ZbV);
}

/// `schedule = "auto"`: ZB-H1 while costs are unmeasured, then plans built from the measured
/// costs; whichever plan a step runs, the parameters are the reference's.
#[test]
fn auto_schedule_matches_the_reference() {
    let job = JobConfig {
        schedule: ScheduleChoice::Auto,
        ..job(4)
    };
    let trainer = PipelineTrainer::from_job(&job)
        .unwrap()
        .clock(Clock::virtual_free());
    let run = check_against_oracle("auto", &trainer);
    pipefill::schedules::validate(&run.plan, &Default::default())
        .expect("the last auto plan is valid");
}

/// A Llama-shaped model (RoPE, SwiGLU, grouped-query attention, q/k/v biases) pipelined
/// under every built-in schedule is bitwise the reference trainer's, clipped steps included.
#[test]
fn llama_shaped_models_match_the_reference_under_every_schedule() {
    let job = llama_job(4);
    let names: Vec<String> = llama_oracle().params.keys().cloned().collect();
    for want in ["blocks.0.attn.bq", "blocks.7.attn.bv", "blocks.3.mlp.w3"] {
        assert!(names.iter().any(|n| n == want), "no {want} in {names:?}");
    }
    assert!(
        !names.iter().any(|n| n == "embed.pos"),
        "rope has no position table"
    );
    let oracle = llama_oracle();
    let (tok, head) = (&oracle.params["embed.tok"], &oracle.params["head.w"]);
    assert_tied("reference", tok, head, &job.model);
    for kind in ScheduleKind::ALL {
        let trainer = PipelineTrainer::builtin(&job, kind, None)
            .unwrap()
            .clock(Clock::virtual_free());
        let run = check_against_oracle(&format!("{kind} llama"), &trainer);
        let (tok, head) = (run.param_values("embed.tok"), run.param_values("head.w"));
        assert_tied(kind.name(), tok.unwrap(), head.unwrap(), &job.model);
    }
}

/// The tied copies stayed bitwise equal after steps that moved them (they differ from the
/// untrained draw).
fn assert_tied(name: &str, tok: &[f32], head: &[f32], model: &GptConfig) {
    let (v, d) = (model.vocab, model.d_model);
    assert_eq!(tok, head, "{name}: head.w is not embed.tok");
    let init = pipefill::model::init::normal(model.seed, "embed.tok", v * d, INIT_STD);
    assert_ne!(tok, init.as_slice(), "{name}: embed.tok never moved");
}

#[test]
fn unclipped_runs_are_bitwise_the_reference() {
    let job = job_clipped_at(4, 0.0);
    for kind in ScheduleKind::ALL {
        let trainer = PipelineTrainer::builtin(&job, kind, None).unwrap();
        check_against_oracle(&format!("{kind} unclipped"), &trainer);
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/torch/zb1p_2rank_2stagep_compute.csv"
    );
    let plan = read_plan(Path::new(path)).unwrap();
    let trainer = PipelineTrainer::new(&job_clipped_at(2, 0.0), plan).unwrap();
    check_against_oracle("torch zb1p unclipped", &trainer);
}

#[test]
fn speculative_steps_roll_back_to_the_reference() {
    // Post-validation with speculation: a rank steps on the statistics it has, runs its
    // first-stage forwards of the next step on those weights, and rolls back when the
    // exact decision (here: clip or not, and by how much) differs.
    let mut rollbacks = 0;
    for kind in [
        ScheduleKind::ZbH1,
        ScheduleKind::ZbV,
        ScheduleKind::Interleaved1F1B,
    ] {
        let trainer = PipelineTrainer::builtin(&job(4), kind, None)
            .unwrap()
            .speculative_steps(true);
        let run = check_against_oracle(&format!("{kind} speculative"), &trainer);
        rollbacks += run.report.rollbacks();
    }
    assert!(rollbacks > 0, "no speculative step was ever rolled back");
}

#[test]
fn barrier_steps_match_the_reference() {
    let trainer = PipelineTrainer::builtin(&job(4), ScheduleKind::ZbH2, None)
        .unwrap()
        .step_mode(StepMode::Barrier);
    check_against_oracle("zb-h2 barrier", &trainer);
}

#[test]
fn wall_clock_runs_match_the_reference() {
    // The clock only times the actions; what they compute is the same.
    let trainer = PipelineTrainer::builtin(&job(4), ScheduleKind::ZbH1, None)
        .unwrap()
        .clock(Clock::Wall);
    let run = check_against_oracle("zb-h1 wall clock", &trainer);
    assert!(run.timelines().all(|t| t.makespan > 0.0));
}

#[test]
fn torch_zb1p_fixture_matches_the_reference() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/torch/zb1p_2rank_2stagep_compute.csv"
    );
    let plan = read_plan(Path::new(path)).unwrap();
    assert_eq!(
        (plan.num_ranks(), plan.stages, plan.microbatches),
        (2, 4, 8)
    );
    let trainer = PipelineTrainer::new(&job(2), plan).unwrap();
    check_against_oracle("torch zb1p", &trainer);
}

#[test]
fn a_resumed_run_continues_where_the_checkpoint_left_off() {
    // 2 steps, checkpoint, 1 more step == 3 steps of the reference.
    let job = job(4);
    let trainer = PipelineTrainer::builtin(&job, ScheduleKind::OneFOneB, None).unwrap();
    let first = trainer.run(2, |_| {}).unwrap();
    assert_eq!(first.next_step(), 2);
    let checkpoint = first.checkpoint().unwrap();
    let rest = trainer.clone().resume(&checkpoint).run(1, |_| {}).unwrap();
    assert_eq!(rest.steps[0].step, 2);
    for (n, exp) in &oracle(CLIP).params {
        let got = rest.param_values(n).unwrap();
        let d = got
            .iter()
            .zip(exp)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(d <= MAX_ABS_DIFF, "{n}: resumed run differs by {d:.3e}");
    }
}

#[test]
fn a_failing_stage_stops_the_run_with_an_error_naming_it() {
    // A vocabulary smaller than the tokenizer's: stage 0's embedding meets a token id it
    // does not have. The run must end with an error naming the rank and the action, not
    // hang with the other ranks waiting for stage 0's output.
    let mut job = job(4);
    job.model.vocab = 4;
    let trainer = PipelineTrainer::builtin(&job, ScheduleKind::OneFOneB, None).unwrap();
    let mut steps = 0;
    let err = trainer.run(STEPS, |_| steps += 1).unwrap_err();
    assert_eq!(steps, 0);
    let text = err.to_string();
    assert!(
        matches!(err, PipelineError::Runtime(_)) && text.contains("rank 0") && text.contains("0F0"),
        "{text}"
    );
}

#[test]
fn plans_that_do_not_fit_the_job_are_refused() {
    let job = job(4);
    // The plan's micro-batches must be the job's.
    let plan = build(ScheduleKind::OneFOneB, 4, 4, 1).unwrap();
    let err = PipelineTrainer::new(&job, plan).unwrap_err();
    assert!(
        matches!(
            err,
            PipelineError::Config {
                field: "train.micro_batches",
                ..
            }
        ),
        "{err}"
    );
    // Every stage needs at least one block.
    let mut shallow = job.clone();
    shallow.model.layers = 4;
    let err = PipelineTrainer::builtin(&shallow, ScheduleKind::ZbV, None).unwrap_err();
    assert!(err.to_string().contains("model.layers"), "{err}");
    // "none" is the reference trainer's job, and an unknown name is a file that is not there.
    let err = PipelineTrainer::from_job(&job).unwrap_err();
    assert!(err.to_string().contains("schedule"), "{err}");
    let mut missing = job.clone();
    missing.schedule = "no-such-schedule.csv".parse().unwrap();
    assert!(PipelineTrainer::from_job(&missing).is_err());
    let mut named = job.clone();
    named.schedule = "zb-h1".parse().unwrap();
    let trainer = PipelineTrainer::from_job(&named).unwrap();
    assert_eq!(trainer.plan().num_ranks(), 4);
}
