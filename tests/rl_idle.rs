//! The rollout stages' idle work through a `FillerRouter` ([`RolloutRouter`]): routing the
//! verification passes and filling the long tail with drafter training changes no sample,
//! every verification goes through the router to the stage that holds its layers, the
//! drafter trains in the idle time on rows the rollout produced, and the figures add up;
//! and the RL loop's drafter, trained in idle time, keeps up with a moving policy.

mod common;

use common::rollouts::{config, gpt};
use std::sync::{Arc, Mutex};

use pipefill::config::JobConfig;
use pipefill::data::SplitMix64;
use pipefill::model::drafter::state::DrafterState;
use pipefill::model::drafter::{
    DraftBufferHandle, DraftRow, Drafter, DrafterConfig, DrafterTrainer, EvalStats,
};
use pipefill::model::infer::InferStage;
use pipefill::model::{Cut, Gpt, GptConfig, init};
use pipefill::rl::config::RlConfig;
use pipefill::rl::rollout::idle::{DRAFTER, DRAFTER_STEP, DrafterSlices, RolloutRouter, VERIFY};
use pipefill::rl::rollout::{
    MessageHook, Request, RolloutConfig, RolloutEngine, RolloutOutput, Speculation,
};
use pipefill::rl::speculative::RandomProposer;
use pipefill::rl::trainer_spec::PipelineRollouts;
use pipefill::tensor::CpuBackend;
use pipefill_actors::FillerRouter;
use pipefill_actors::router::CostEstimate;

const STAGES: usize = 4;

fn engine(gpt: &Gpt<CpuBackend>) -> RolloutEngine<CpuBackend> {
    RolloutEngine::new(InferStage::stages_of(gpt, &Cut::Even(STAGES)).unwrap()).unwrap()
}

/// Ragged prompts and caps: a long tail.
fn requests(n: usize) -> Vec<Request> {
    let mut rng = SplitMix64::new(9);
    (0..n)
        .map(|i| Request {
            prompt: (0..2 + i % 3).map(|_| 3 + rng.below(47) as u32).collect(),
            max_new: 3 + (i * 11) % 30,
        })
        .collect()
}

fn rollout(e: &mut RolloutEngine<CpuBackend>, spec: Speculation) -> RolloutOutput {
    let cfg = RolloutConfig {
        groups: STAGES,
        speculation: spec.clone(),
        record_rows: true,
        ..RolloutConfig::default()
    };
    let mut proposer = RandomProposer::new(50);
    let p = (spec != Speculation::Off).then_some(&mut proposer as &mut _);
    e.run(&requests(6), &cfg, p).unwrap()
}

fn trainer(buffer: DraftBufferHandle) -> Arc<Mutex<DrafterTrainer<CpuBackend>>> {
    let d = Drafter::new(
        &config(),
        &DrafterConfig::default(),
        CpuBackend::new(1).unwrap(),
    )
    .unwrap();
    Arc::new(Mutex::new(DrafterTrainer::new(d, buffer, 0, 1).unwrap()))
}

#[test]
fn routed_verification_and_idle_drafter_training_change_no_sample() {
    let model = gpt();
    let plain = rollout(&mut engine(&model), Speculation::Off);

    // The drafter's buffer holds a previous rollout's rows, so it can train from the start.
    let buffer = DraftBufferHandle::new(&config(), &DrafterConfig::default());
    buffer.begin_step(0);
    for row in &plain.rows {
        buffer.lock().push(row.clone()).unwrap();
    }
    buffer.begin_step(1);
    let trainer = trainer(buffer.clone());
    let router = FillerRouter::default();
    let slices = DrafterSlices::new(Arc::clone(&trainer), &router);
    // A prior of 0 s: the first piece fits any idle time; measured costs take over after.
    let full = slices.full_rows();
    router.set_prior_line(DRAFTER, CostEstimate::prior_line(full as f64, 0.0, 0.0));
    router.set_prior(DRAFTER_STEP, 0.0);
    slices.begin(1000, &router);
    let hook = Arc::new(
        RolloutRouter::new(router.clone(), STAGES, true)
            .with_rows(buffer.clone(), 2)
            .with_drafter(slices.clone()),
    );
    let mut e = engine(&model).with_hook(Arc::clone(&hook) as Arc<dyn MessageHook>);
    let spec = rollout(&mut e, Speculation::Fixed { k: 3 });

    // Greedy speculative decoding with routed verification is plain decoding, token for token.
    assert_eq!(spec.sequences, plain.sequences);
    assert!(spec.stats.verifications > 0);

    let report = hook.report();
    let verify: Vec<_> = report.spans.iter().filter(|s| s.kind == VERIFY).collect();
    assert_eq!(verify.len(), report.verifications);
    // Every verification group step passes all stages, each through the router.
    assert!(report.verifications > 0 && report.verifications.is_multiple_of(STAGES));
    for stage in 0..STAGES {
        let here = verify.iter().filter(|s| s.stage == stage).count();
        assert_eq!(here * STAGES, report.verifications, "stage {stage}");
    }
    let stats = router.stats();
    assert_eq!(stats.queued, 0, "no verification left behind");
    assert_eq!(stats.kinds[VERIFY].slices as usize, report.verifications);

    // The long tail left stages idle and the drafter trained there.
    let drafted: Vec<_> = report.spans.iter().filter(|s| s.kind == DRAFTER).collect();
    assert_eq!(drafted.len(), report.drafter_slices + report.drafter_steps);
    assert!(report.drafter_slices >= 1, "{report:?}");
    assert!(drafted.iter().all(|s| s.error.is_none()), "{drafted:?}");
    let filled: f64 = drafted.iter().map(|s| s.end - s.start).sum();
    assert!((report.filled_total() - filled).abs() < 1e-9);
    assert_eq!(
        slices.rows_left(),
        1000 * full - report.drafter_rows,
        "the budget pays for what ran"
    );
    assert!(trainer.lock().unwrap().pending_slices() > 0 || trainer.lock().unwrap().version() > 0);

    // Finished sequences' rows reached the buffer during the rollout, the first 2 held out.
    assert_eq!(hook.held_out().len(), 2);
    assert_eq!(buffer.lock().current_len(), spec.rows.len() - 2);
}

#[test]
fn a_hook_without_routing_leaves_verification_to_the_stages() {
    let model = gpt();
    let plain = rollout(&mut engine(&model), Speculation::Off);
    let hook = Arc::new(RolloutRouter::new(FillerRouter::default(), STAGES, false));
    let mut e = engine(&model).with_hook(Arc::clone(&hook) as Arc<dyn MessageHook>);
    let spec = rollout(&mut e, Speculation::Fixed { k: 2 });
    assert_eq!(spec.sequences, plain.sequences);
    let report = hook.report();
    assert_eq!(report.verifications, 0);
    assert_eq!(report.drafter_slices, 0, "no drafter: nothing to fill with");
    assert_eq!(report.waited_s.len(), STAGES);
    assert!(report.waited_s.iter().all(|&w| w >= 0.0));
}

// --- The drafter following a moving policy during RL -------------------------------------

/// A synthetic target whose next-token distributions drift a little every step, as an RL
/// policy's do: hidden states `h_{t+1} = rms(A_s·h_t + E[x_{t+1}] + c_task)`, next-token
/// distributions `softmax(h·W)`, tokens sampled from them, `A_s = A_0 + s·Δ`. Each step
/// samples a few tasks only (as a step's prompts are a few tasks), so a step's rows are not
/// the whole distribution.
struct MovingTarget {
    d: usize,
    vocab: usize,
    embed: Vec<f32>,
    head: Vec<f32>,
    a0: Vec<f32>,
    delta: Vec<f32>,
    tasks: Vec<Vec<f32>>,
}

impl MovingTarget {
    fn new(config: &GptConfig) -> Self {
        let (d, vocab) = (config.d_model, config.vocab);
        let normal = |name: &str, len: usize, std: f32| init::normal(77, name, len, std);
        MovingTarget {
            d,
            vocab,
            embed: normal("embed", vocab * d, 1.0),
            head: normal("head", d * vocab, 2.5 / (d as f32).sqrt()),
            a0: normal("a0", d * d, 0.8 / (d as f32).sqrt()),
            delta: normal("delta", d * d, 0.02 / (d as f32).sqrt()),
            tasks: (0..8)
                .map(|t| normal(&format!("task{t}"), d, 1.0))
                .collect(),
        }
    }

    /// `n` rows of `len` positions at step `step`, of tasks drawn from `tasks`.
    fn rows(&self, step: u64, tasks: &[usize], n: usize, len: usize, seed: u64) -> Vec<DraftRow> {
        let (d, v) = (self.d, self.vocab);
        let a: Vec<f32> = (self.a0.iter().zip(&self.delta))
            .map(|(a, x)| a + step as f32 * x)
            .collect();
        let mut rng = SplitMix64::derive(seed, step);
        let rms = |h: &mut [f32]| {
            let s = (h.iter().map(|x| x * x).sum::<f32>() / d as f32).sqrt();
            h.iter_mut().for_each(|x| *x /= s.max(1e-6));
        };
        let probs = |h: &[f32]| {
            let z: Vec<f32> = (0..v)
                .map(|j| (0..d).map(|i| h[i] * self.head[i * v + j]).sum())
                .collect();
            let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = z.iter().map(|x| (x - max).exp()).collect();
            let sum: f32 = e.iter().sum();
            e.iter().map(|x| x / sum).collect::<Vec<f32>>()
        };
        (0..n)
            .map(|_| {
                let task = &self.tasks[tasks[rng.below(tasks.len() as u64) as usize]];
                let mut h = task.clone();
                rms(&mut h);
                let mut row = DraftRow {
                    hidden: Vec::new(),
                    targets: Vec::new(),
                    step,
                };
                for _ in 0..len {
                    let p = probs(&h);
                    let u = rng.next_f64() as f32;
                    let mut acc = 0.0;
                    let x = p.iter().position(|&q| {
                        acc += q;
                        u < acc
                    });
                    let x = x.unwrap_or(v - 1);
                    row.hidden.extend_from_slice(&h);
                    row.targets.push(x as u32);
                    let mut next: Vec<f32> = (0..d)
                        .map(|i| {
                            let ah: f32 = (0..d).map(|j| a[i * d + j] * h[j]).sum();
                            ah + self.embed[x * d + i] + task[i]
                        })
                        .collect();
                    rms(&mut next);
                    h = next;
                }
                row
            })
            .collect()
    }
}

/// A drafter trained from scratch at `drafter.lr` on every task of the unmoved target (as
/// in a supervised run's bubbles), as a checkpoint's state.
fn trained_drafter(job: &JobConfig, target: &MovingTarget) -> DrafterState {
    let mut drafter = Drafter::new(&job.model, &job.drafter, CpuBackend::new(1).unwrap()).unwrap();
    drafter.refresh("embed.tok", &target.embed, 0).unwrap();
    drafter.refresh("head.w", &target.head, 0).unwrap();
    let buffer = DraftBufferHandle::new(&job.model, &job.drafter);
    buffer.begin_step(0);
    let all: Vec<usize> = (0..target.tasks.len()).collect();
    for row in target.rows(0, &all, 64, 40, 1) {
        buffer.lock().push(row).unwrap();
    }
    let mut trainer = DrafterTrainer::new(drafter, buffer, 0, 1).unwrap();
    for _ in 0..1500 {
        trainer.slice().unwrap();
    }
    // The frozen tables travel with the weights here: the rows come from a synthetic target
    // that no checkpoint holds, and `follow` (unlike a rollout) refreshes nothing from a
    // policy.
    let mut weights = trainer.weights().unwrap();
    weights
        .tensors
        .extend(trainer.drafter().frozen_tensors().unwrap());
    DrafterState {
        weights,
        optimizer: trainer.optimizer_state().unwrap(),
        samplers: vec![trainer.sampler()],
        buffer: Default::default(),
        held_out: Default::default(),
        round: None,
    }
}

/// The RL loop's drafter, warm-started from a trained one, keeps up with a policy that
/// drifts slowly and shows it only a few tasks per step: on the next step's rows (every
/// task) its acceptance chance and agreement stay above the untouched drafter's. At
/// `drafter.lr` (the rate it learned from scratch at, which the RL loop used before
/// `rl.drafter_lr`) each step's slices chase that step's few rows and it falls below the
/// untouched drafter, as `pipefill rl` measured (examples/rl-longtail.toml).
#[test]
fn a_warm_started_drafter_keeps_up_with_a_moving_policy() {
    let job = JobConfig {
        model: GptConfig {
            layers: 2,
            d_model: 64,
            heads: 4,
            seq_len: 48,
            ..GptConfig::default()
        },
        rl: RlConfig {
            drafter_slices: 4,
            ..RlConfig::default()
        },
        ..JobConfig::default()
    };
    let target = MovingTarget::new(&job.model);
    let state = trained_drafter(&job, &target);
    let engine = |job: &JobConfig| {
        PipelineRollouts::new(job)
            .unwrap()
            .with_drafter(&state)
            .unwrap()
    };
    let (mut following, mut frozen) = (engine(&job), engine(&job));
    assert_eq!(following.drafter_lr(), job.rl.drafter_lr);
    // What it did before `rl.drafter_lr`: on at the rate it learned from scratch at.
    let mut eager = engine(&JobConfig {
        rl: RlConfig {
            drafter_lr: job.drafter.lr,
            ..job.rl.clone()
        },
        ..job.clone()
    });

    let all: Vec<usize> = (0..target.tasks.len()).collect();
    let (mut ours, mut theirs, mut hasty) = (Vec::new(), Vec::new(), Vec::new());
    for step in 1..=12u64 {
        // 8 sequences of 2 tasks, as 2 prompts × group 4.
        let tasks = [(2 * step as usize) % 8, (2 * step as usize + 5) % 8];
        let rows = target.rows(step, &tasks, 8, 40, 2);
        following.follow(&rows, step).unwrap();
        eager.follow(&rows, step).unwrap();
        let next = target.rows(step + 1, &all, 32, 40, 3);
        ours.push(following.evaluate_drafter(&next).unwrap());
        theirs.push(frozen.evaluate_drafter(&next).unwrap());
        hasty.push(eager.evaluate_drafter(&next).unwrap());
    }
    let mean =
        |s: &[EvalStats], f: fn(&EvalStats) -> f64| s.iter().map(f).sum::<f64>() / s.len() as f64;
    let (o, f) = (mean(&ours, |e| e.overlap), mean(&theirs, |e| e.overlap));
    let (oa, fa) = (mean(&ours, |e| e.agreement), mean(&theirs, |e| e.agreement));
    let (e, ea) = (mean(&hasty, |e| e.overlap), mean(&hasty, |e| e.agreement));
    eprintln!(
        "overlap: following {o:.4}, frozen {f:.4}, at drafter.lr {e:.4}; agreement {oa:.4}, \
         {fa:.4}, {ea:.4}"
    );
    assert!(o > f, "overlap: following {o:.4}, frozen {f:.4}");
    assert!(oa > fa, "agreement: following {oa:.4}, frozen {fa:.4}");
    assert!(
        e < f - 0.01,
        "at drafter.lr the drafter fell behind: {e:.4} vs {f:.4}"
    );
}
