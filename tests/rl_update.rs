//! The RL update through the pipeline equals the same GRPO update computed on one device:
//! rollouts with known rewards go through [`RlTrainer::run_step`] (prompts, rewards,
//! group advantages, sequences packed `rl.group` per micro-batch, pipelined step resumed
//! from the checkpoint), and the single-device side accumulates `forward_backward` of the
//! same packed step on the whole model and steps AdamW at the RL learning rate (bitwise),
//! and so does one micro-batch per sequence with scale `A_i / n` (to rounding). With a KL penalty
//! the single-device side is the GRPO objective's gradient token by token
//! ([`grpo_loss`] from the policy's and the reference's log-probs), so the per-token loss
//! hook of the pipelined head is checked against an independent computation.

mod common;

use common::scripted::scripted_batch;
use pipefill::config::JobConfig;
use pipefill::data::{MicroBatch, Task, Tokenizer, tokenizer};
use pipefill::model::checkpoint::Checkpoint;
use pipefill::model::layers::log_prob;
use pipefill::model::{AdamW, Cut, Gpt, Shape};
use pipefill::pipeline::feed::StepBatches;
use pipefill::rl::RlError;
use pipefill::rl::generator::{Rollout, RolloutBatch, RolloutGenerator, RolloutRequest};
use pipefill::rl::grpo::{GrpoLoss, SequenceLogProbs, group_advantages, grpo_loss};
use pipefill::rl::prompts::step_prompts;
use pipefill::rl::step_metrics::RlStepMetrics;
use pipefill::rl::trainer::RlTrainer;
use pipefill::rl::update::{update_batches, update_step};
use pipefill::rl::warm_up::warm_up;
use pipefill::tensor::{CpuBackend, IGNORE_TARGET};
use pipefill::train::reference::adamw_config;

/// Rollouts fixed in advance: the first of each group is the task's worked solution (reward
/// 1), the others a wrong answer (reward 0); a prompt in `uniform` has every completion
/// right (`true`) or wrong (`false`), a group of advantage 0.
struct Scripted {
    tasks: Vec<Task>,
    uniform: Vec<(usize, bool)>,
}

impl Scripted {
    fn new(tasks: Vec<Task>) -> Self {
        Scripted {
            tasks,
            uniform: Vec::new(),
        }
    }
}

impl RolloutGenerator<CpuBackend> for Scripted {
    fn generate(
        &mut self,
        _policy: &Gpt<CpuBackend>,
        request: RolloutRequest<'_>,
    ) -> Result<RolloutBatch, RlError> {
        scripted_batch(request.prompts, &self.tasks, request.group, &self.uniform)
    }

    fn speculative(&self) -> bool {
        false
    }
}

fn job() -> JobConfig {
    let sets: Vec<String> = [
        "model.d_model=16",
        "model.heads=2",
        "model.layers=4",
        "model.seq_len=48",
        "stages=2",
        "schedule=\"1f1b\"",
        "data.families=[\"parity\"]",
        "data.max_size=2",
        "train.micro_batch_size=2",
        "rl.prompts=2",
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

#[test]
fn the_pipelined_grpo_update_equals_the_single_device_update() {
    let job = job();
    let start = warm_up(&job, |_| {}).unwrap();
    assert_eq!(start.meta.step, 2);
    let tasks = step_prompts(&job, 0).unwrap();
    let mut engine = Scripted::new(tasks.clone());
    let mut rl = RlTrainer::new(&job, start.clone()).unwrap();
    let m = rl.run_step(&mut engine, |_| {}).unwrap();
    assert!((m.reward - 1.0 / 3.0).abs() < 1e-9, "{m:?}");
    assert_eq!(m.informative_groups, 2);
    assert_eq!(
        (m.skipped_groups, m.update_micro_batches),
        (0, 2),
        "nothing to skip"
    );
    assert_eq!(m.lr, 1e-2, "the first RL step runs at the peak rate");
    assert_eq!(rl.checkpoint().unwrap().meta.step, 3);

    // The same update on one device.
    let (mut gpt, mut opt) = load(&job, &start);
    let batch = engine.generate(&gpt, request(&encoded(&tasks))).unwrap();
    let advantages = group_advantages(&[1.0, 0.0, 0.0, 1.0, 0.0, 0.0], 3).unwrap();
    // The packed step on one device: the pipeline computes exactly this, stage by stage.
    let packed = update_step(&job.rl, &batch.rollouts, &advantages, None, 2)
        .unwrap()
        .step;
    assert_eq!(packed.batches.len(), 2, "rl.prompts micro-batches");
    assert!(
        packed.batches.iter().all(|mb| mb.rows == 3),
        "rl.group rows each"
    );
    single_device_step(&job, &mut gpt, &mut opt, &packed);
    // One micro-batch per sequence with scale A_i / n: the GRPO update as plain training.
    let (mut plain, mut plain_opt) = load(&job, &start);
    let per_sequence = update_batches(&batch.rollouts, &advantages).unwrap();
    assert_eq!(per_sequence.batches.len(), 6);
    single_device_step(&job, &mut plain, &mut plain_opt, &per_sequence);

    let policy = rl.policy();
    let (before, _) = load(&job, &start);
    let (mut moved, mut packing_error) = (0.0f32, 0.0f32);
    for name in gpt.param_names() {
        let (want, got) = (
            gpt.param_values(&name).unwrap(),
            policy.param_values(&name).unwrap(),
        );
        let before = before.param_values(&name).unwrap();
        moved = moved.max(
            want.iter()
                .zip(&before)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max),
        );
        assert_eq!(got, want, "{name}: the pipelined update differs");
        let plain = plain.param_values(&name).unwrap();
        packing_error = want
            .iter()
            .zip(&plain)
            .map(|(a, b)| (a - b).abs())
            .fold(packing_error, f32::max);
    }
    assert!(moved > 1e-4, "the update moved the parameters: {moved}");
    eprintln!("packed vs one sequence per micro-batch: max |Δparam| {packing_error:e}");
    assert!(
        packing_error <= PACKING_TOL,
        "packed vs one sequence per micro-batch: max |Δparam| {packing_error}"
    );
}

/// Packed vs one-sequence-per-micro-batch updates: the same gradient summed in another
/// order (and each row's weight applied per token), so equal to rounding; 0 here would
/// only mean the case is degenerate, so the bound is far below the step (`moved` > 1e-4).
const PACKING_TOL: f32 = 1e-6;

/// Accumulates `step`'s micro-batches on `gpt` (with its token loss on the head, if any)
/// and takes AdamW's step at the RL learning rate of [`job`].
fn single_device_step(
    job: &JobConfig,
    gpt: &mut Gpt<CpuBackend>,
    opt: &mut AdamW<CpuBackend>,
    step: &StepBatches,
) {
    let last = gpt.chunks_mut().len() - 1;
    gpt.chunks_mut()[last]
        .set_token_loss(step.token_loss.clone())
        .unwrap();
    gpt.zero_grads().unwrap();
    for (i, (mb, &scale)) in step.batches.iter().zip(&step.scales).enumerate() {
        let shape = Shape {
            batch: mb.rows,
            seq: mb.seq_len,
        };
        gpt.forward_backward(i, shape, &mb.inputs, &mb.targets, scale)
            .unwrap();
    }
    gpt.chunks_mut()[last].set_token_loss(None).unwrap();
    opt.step_chunks(gpt.chunks_mut(), job.rl.lr).unwrap();
}

/// The policy the next rollout samples from is the checkpoint the next update resumes:
/// updated in place step after step, it stays equal to the pipeline's final parameters.
#[test]
fn the_policy_follows_the_checkpoint_from_step_to_step() {
    let job = job();
    let start = warm_up(&job, |_| {}).unwrap();
    let mut rl = RlTrainer::new(&job, start.clone()).unwrap();
    for step in 0..2 {
        let mut engine = Scripted::new(step_prompts(&job, step).unwrap());
        let m = rl.run_step(&mut engine, |_| {}).unwrap();
        assert!(
            m.informative_groups > 0,
            "step {step} has a gradient: {m:?}"
        );
        let checkpoint = rl.checkpoint().unwrap();
        let mut moved = false;
        for name in rl.policy().param_names() {
            let saved = &checkpoint.tensor(&name).unwrap().data;
            let start = &start.tensor(&name).unwrap().data;
            assert_eq!(
                &rl.policy().param_values(&name).unwrap(),
                saved,
                "step {step}: {name}"
            );
            moved |= saved != start;
        }
        assert!(moved, "step {step}: the updates moved the parameters");
    }
}

/// [`job`] with 4 prompts of 3 completions, for the tests of skipped groups.
fn skip_job() -> JobConfig {
    let mut job = job();
    job.rl.prompts = 4;
    job
}

/// Largest `|a − b|` over every parameter of two models of the same job.
fn max_diff(a: &Gpt<CpuBackend>, b: &Gpt<CpuBackend>) -> f32 {
    let mut worst = 0.0f32;
    for name in a.param_names() {
        let (x, y) = (
            a.param_values(&name).unwrap(),
            b.param_values(&name).unwrap(),
        );
        worst = x
            .iter()
            .zip(&y)
            .map(|(p, q)| (p - q).abs())
            .fold(worst, f32::max);
    }
    worst
}

/// What the tests here ask of an engine directly: 3 completions of each of `prompts`, at
/// most 24 tokens each, at step 0.
fn request(prompts: &[Vec<u32>]) -> RolloutRequest<'_> {
    RolloutRequest {
        prompts,
        group: 3,
        max_new: 24,
        eos: tokenizer::EOS,
        step: 0,
    }
}

/// `prompts` (BOS + each task's prompt) of `tasks`.
fn encoded(tasks: &[Task]) -> Vec<Vec<u32>> {
    tasks
        .iter()
        .map(|t| {
            let mut ids = vec![tokenizer::BOS];
            ids.extend(Tokenizer::new().encode(&t.prompt).unwrap());
            ids
        })
        .collect()
}

/// What a step's update left out: (informative groups, skipped groups, skipped
/// sequences, micro-batches run).
fn skip_counts(m: &RlStepMetrics) -> (usize, usize, usize, usize) {
    (
        m.informative_groups,
        m.skipped_groups,
        m.skipped_sequences,
        m.update_micro_batches,
    )
}

/// Two of four groups have equal rewards (one all wrong, one all right): the update leaves
/// their 6 sequences out and runs 2 micro-batches instead of 4, and lands where the whole
/// step does (one micro-batch per sequence, scale `A_i / n` over all 12): the skipped
/// sequences had exactly no gradient. Normalised by the 6 kept sequences instead, the
/// update lands elsewhere, far outside the tolerance.
#[test]
fn groups_without_a_gradient_are_skipped_and_the_update_is_the_whole_steps() {
    let job = skip_job();
    let start = warm_up(&job, |_| {}).unwrap();
    let tasks = step_prompts(&job, 0).unwrap();
    let mut engine = Scripted {
        tasks: tasks.clone(),
        uniform: vec![(1, false), (3, true)],
    };
    let mut rl = RlTrainer::new(&job, start.clone()).unwrap();
    let m = rl.run_step(&mut engine, |_| {}).unwrap();
    assert_eq!(skip_counts(&m), (2, 2, 6, 2), "{m:?}");

    let (gpt, _) = load(&job, &start);
    let batch = engine.generate(&gpt, request(&encoded(&tasks))).unwrap();
    let rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
    let advantages = group_advantages(&rewards, 3).unwrap();
    // The pipeline ran exactly the skipping packed step (bitwise, as without skipping).
    let packed = update_step(&job.rl, &batch.rollouts, &advantages, None, 2)
        .unwrap()
        .step;
    let (mut same, mut same_opt) = load(&job, &start);
    single_device_step(&job, &mut same, &mut same_opt, &packed);
    assert_eq!(max_diff(rl.policy(), &same), 0.0, "pipelined vs one device");

    let (mut whole, mut whole_opt) = load(&job, &start);
    let all = update_batches(&batch.rollouts, &advantages).unwrap();
    single_device_step(&job, &mut whole, &mut whole_opt, &all);
    let kept: Vec<usize> = (0..12).filter(|&i| advantages[i] != 0.0).collect();
    let rollouts: Vec<Rollout> = kept.iter().map(|&i| batch.rollouts[i].clone()).collect();
    let mut by_kept = update_batches(&rollouts, &vec![0.0; kept.len()]).unwrap();
    by_kept.scales = kept.iter().map(|&i| advantages[i] / 6.0).collect();
    let (mut wrong, mut wrong_opt) = load(&job, &start);
    single_device_step(&job, &mut wrong, &mut wrong_opt, &by_kept);

    let (err, off) = (max_diff(rl.policy(), &whole), max_diff(&wrong, &whole));
    eprintln!("skipping vs the whole step: max |Δparam| {err:e}; normalised by the kept: {off:e}");
    assert!(err <= PACKING_TOL, "skipping moved the update by {err}");
    assert!(off > 20.0 * PACKING_TOL, "n = kept moves it by {off} only");
    assert!(
        max_diff(&whole, &gpt) > 1e-4,
        "the update moved the parameters"
    );
}

/// A step where every group has equal rewards has no gradient; it runs one micro-batch of a
/// zero-loss sequence and still takes AdamW's step (its moments and weight decay move the
/// parameters) exactly as the whole step of zero gradients does: bitwise.
#[test]
fn a_step_without_any_gradient_still_steps_the_optimizer_exactly() {
    let job = skip_job();
    let start = warm_up(&job, |_| {}).unwrap();
    let tasks = step_prompts(&job, 0).unwrap();
    let mut engine = Scripted {
        tasks: tasks.clone(),
        uniform: vec![(0, false), (1, true), (2, false), (3, false)],
    };
    let mut rl = RlTrainer::new(&job, start.clone()).unwrap();
    let m = rl.run_step(&mut engine, |_| {}).unwrap();
    assert_eq!(skip_counts(&m), (0, 3, 11, 1), "{m:?}");
    assert_eq!(m.grad_norm, 0.0);

    let (gpt, _) = load(&job, &start);
    let batch = engine.generate(&gpt, request(&encoded(&tasks))).unwrap();
    let (mut whole, mut whole_opt) = load(&job, &start);
    let all = update_batches(&batch.rollouts, &[0.0; 12]).unwrap();
    single_device_step(&job, &mut whole, &mut whole_opt, &all);
    assert_eq!(
        max_diff(rl.policy(), &whole),
        0.0,
        "not the whole step's update"
    );
    assert!(max_diff(&whole, &gpt) > 0.0, "AdamW's step moved nothing");
}

#[test]
fn a_batch_of_the_wrong_size_is_refused() {
    let r = Rollout {
        prompt: vec![tokenizer::BOS],
        generated: vec![5, tokenizer::EOS],
    };
    let err = update_batches(&[r.clone(), r.clone()], &[1.0]).unwrap_err();
    assert!(
        err.to_string().contains("1 advantages for 2 sequences"),
        "{err}"
    );
    let empty = Rollout {
        prompt: vec![tokenizer::BOS],
        generated: vec![],
    };
    let err = update_batches(&[empty], &[0.0]).unwrap_err();
    assert!(
        err.to_string()
            .contains("sequence 0 has 1 prompt and 0 generated"),
        "{err}"
    );
    // Prompt targets are ignored, completion targets kept; inputs drop the last token.
    let step = update_batches(&[r], &[2.0]).unwrap();
    let mb = &step.batches[0];
    assert_eq!(mb.inputs, [tokenizer::BOS, 5]);
    assert_eq!(mb.targets, [5, tokenizer::EOS]);
    assert_eq!(step.scales, [2.0]);
}

/// The model and optimizer of `checkpoint` on one device.
fn load(job: &JobConfig, checkpoint: &Checkpoint) -> (Gpt<CpuBackend>, AdamW<CpuBackend>) {
    let mut gpt = Gpt::new(&job.model, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
    let mut opt = AdamW::new(adamw_config(&job.train));
    checkpoint
        .restore(&mut gpt, &mut opt, job.train.seed)
        .unwrap();
    (gpt, opt)
}

/// `(position, target)` of each counted target of `mb`.
fn counted(mb: &MicroBatch) -> Vec<(usize, u32)> {
    (mb.targets.iter().copied().enumerate())
        .filter(|&(_, t)| t != IGNORE_TARGET)
        .collect()
}

fn log_probs(gpt: &mut Gpt<CpuBackend>, mb: &MicroBatch) -> Vec<f32> {
    let v = gpt.config().vocab;
    let shape = Shape {
        batch: mb.rows,
        seq: mb.seq_len,
    };
    let logits = gpt.logits(shape, &mb.inputs).unwrap();
    counted(mb)
        .into_iter()
        .map(|(p, t)| log_prob(&logits[p * v..(p + 1) * v], t as usize))
        .collect()
}

/// Tolerance of the KL comparison: the single-device gradient sums token by token, the
/// pipelined head per sequence, so the parameters agree to rounding, not bitwise.
const KL_TOL: f32 = 1e-5;

#[test]
fn the_pipelined_update_with_kl_equals_the_single_device_grpo_update() {
    let mut job = job();
    job.rl.kl_coef = 0.5;
    // The reference is one warm-up step behind the policy, so the KL term has a gradient.
    let mut one = job.clone();
    one.rl.warmup_steps = Some(1);
    let reference = warm_up(&one, |_| {}).unwrap();
    let start = warm_up(&job, |_| {}).unwrap();
    let tasks = step_prompts(&job, 0).unwrap();
    let mut engine = Scripted::new(tasks.clone());
    let mut rl = RlTrainer::new(&job, start.clone())
        .unwrap()
        .with_reference(&reference)
        .unwrap();
    let m = rl.run_step(&mut engine, |_| {}).unwrap();
    let kl = m.kl.expect("the step measures its KL");
    assert!(kl > 0.0 && kl.is_finite(), "{kl}");

    // The same GRPO step on one device, token by token.
    let (mut gpt, mut opt) = load(&job, &start);
    let (mut frozen, _) = load(&job, &reference);
    let batch = engine.generate(&gpt, request(&encoded(&tasks))).unwrap();
    let advantages = group_advantages(&[1.0, 0.0, 0.0, 1.0, 0.0, 0.0], 3).unwrap();
    let step = update_batches(&batch.rollouts, &advantages).unwrap();
    let seqs: Vec<SequenceLogProbs> = step
        .batches
        .iter()
        .map(|mb| {
            let logp = log_probs(&mut gpt, mb);
            SequenceLogProbs {
                logp_old: logp.clone(),
                logp,
                logp_ref: Some(log_probs(&mut frozen, mb)),
            }
        })
        .collect();
    let cfg = GrpoLoss {
        clip: job.rl.clip,
        kl_coef: job.rl.kl_coef,
    };
    let (_, dlogp) = grpo_loss(cfg, &seqs, &advantages).unwrap();
    gpt.zero_grads().unwrap();
    let mut k = 0;
    for (s, mb) in step.batches.iter().enumerate() {
        let shape = Shape {
            batch: mb.rows,
            seq: mb.seq_len,
        };
        // A micro-batch of one target t has loss −log p_t: scale −∂L/∂log p_t.
        for (j, (p, t)) in counted(mb).into_iter().enumerate() {
            let mut only = vec![IGNORE_TARGET; mb.targets.len()];
            only[p] = t;
            gpt.forward_backward(k, shape, &mb.inputs, &only, -dlogp[s][j])
                .unwrap();
            k += 1;
        }
    }
    opt.step_chunks(gpt.chunks_mut(), 1e-2).unwrap();

    // Without KL the same step lands elsewhere: the comparison can tell the term apart.
    let mut plain_job = job.clone();
    plain_job.rl.kl_coef = 0.0;
    let mut plain = RlTrainer::new(&plain_job, start.clone()).unwrap();
    plain.run_step(&mut engine, |_| {}).unwrap();
    let (mut worst, mut kl_moved) = (0.0f32, 0.0f32);
    for name in gpt.param_names() {
        let want = gpt.param_values(&name).unwrap();
        let got = rl.policy().param_values(&name).unwrap();
        let without = plain.policy().param_values(&name).unwrap();
        for ((w, g), o) in want.iter().zip(&got).zip(&without) {
            worst = worst.max((w - g).abs() / (1.0 + w.abs()));
            kl_moved = kl_moved.max((w - o).abs() / (1.0 + w.abs()));
        }
    }
    assert!(
        worst <= KL_TOL,
        "the pipelined KL update differs by {worst}"
    );
    assert!(
        kl_moved > 20.0 * KL_TOL,
        "the KL term moved the update by {kl_moved} only"
    );
}

#[test]
fn a_negative_kl_coefficient_is_refused() {
    let mut job = job();
    let start = warm_up(&job, |_| {}).unwrap();
    job.rl.kl_coef = -0.5;
    let err = RlTrainer::new(&job, start).err().expect("refused");
    assert!(err.to_string().contains("rl.kl_coef"), "{err}");
}
