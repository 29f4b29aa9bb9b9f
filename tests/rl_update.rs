//! The RL update through the pipeline equals the same GRPO update computed on one device:
//! rollouts with known rewards go through [`RlTrainer::run_step`] (prompts, rewards,
//! group advantages, one micro-batch per sequence, pipelined step resumed from the
//! checkpoint), and the single-device side accumulates `forward_backward` with the same
//! scales on the whole model and steps AdamW at the RL learning rate.

use pipefill::config::JobConfig;
use pipefill::data::{Task, Tokenizer, tokenizer};
use pipefill::model::{AdamW, Cut, Gpt, Shape};
use pipefill::rl::grpo::group_advantages;
use pipefill::rl::trainer::{
    RlError, RlTrainer, Rollout, RolloutBatch, RolloutEngine, step_prompts, update_batches, warm_up,
};
use pipefill::tensor::CpuBackend;
use pipefill::train::reference::adamw_config;

/// Rollouts fixed in advance: the first of each group is the task's worked solution (reward
/// 1), the others a wrong answer (reward 0).
struct Scripted {
    tasks: Vec<Task>,
}

impl RolloutEngine for Scripted {
    fn generate(
        &mut self,
        _policy: &Gpt<CpuBackend>,
        prompts: &[Vec<u32>],
        group: usize,
        _max_new: usize,
        _step: u64,
    ) -> Result<RolloutBatch, RlError> {
        let tok = Tokenizer::new();
        let mut rollouts = Vec::new();
        for (prompt, task) in prompts.iter().zip(&self.tasks) {
            for g in 0..group {
                let text = if g == 0 {
                    task.solution.clone()
                } else {
                    format!("0:0\n#{}2", task.answer)
                };
                let mut generated = tok.encode(&text)?;
                generated.push(tokenizer::EOS);
                rollouts.push(Rollout {
                    prompt: prompt.clone(),
                    generated,
                });
            }
        }
        Ok(RolloutBatch {
            live_batch: vec![rollouts.len(), 0],
            rollouts,
            ..RolloutBatch::default()
        })
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
    let mut engine = Scripted {
        tasks: tasks.clone(),
    };
    let mut rl = RlTrainer::new(&job, start.clone()).unwrap();
    let m = rl.run_step(&mut engine, |_| {}).unwrap();
    assert!((m.reward - 1.0 / 3.0).abs() < 1e-9, "{m:?}");
    assert_eq!(m.informative_groups, 2);
    assert_eq!(m.lr, 1e-2, "the first RL step runs at the peak rate");
    assert_eq!(rl.checkpoint().meta.step, 3);

    // The same update on one device.
    let be = CpuBackend::new(1).unwrap();
    let mut gpt = Gpt::new(&job.model, be, &Cut::Even(1)).unwrap();
    let mut opt = AdamW::new(adamw_config(&job.train));
    start.restore(&mut gpt, &mut opt, job.train.seed).unwrap();
    let prompts: Vec<Vec<u32>> = tasks
        .iter()
        .map(|t| {
            let mut ids = vec![tokenizer::BOS];
            ids.extend(Tokenizer::new().encode(&t.prompt).unwrap());
            ids
        })
        .collect();
    let batch = engine.generate(&gpt, &prompts, 3, 24, 0).unwrap();
    let advantages = group_advantages(&[1.0, 0.0, 0.0, 1.0, 0.0, 0.0], 3).unwrap();
    let step = update_batches(&batch.rollouts, &advantages).unwrap();
    gpt.zero_grads().unwrap();
    for (i, (mb, &scale)) in step.batches.iter().zip(&step.scales).enumerate() {
        let shape = Shape {
            batch: mb.rows,
            seq: mb.seq_len,
        };
        gpt.forward_backward(i, shape, &mb.inputs, &mb.targets, scale)
            .unwrap();
    }
    opt.step_chunks(gpt.chunks_mut(), 1e-2).unwrap();

    let policy = rl.policy();
    let mut before = Gpt::new(&job.model, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
    let mut o = AdamW::new(adamw_config(&job.train));
    start.restore(&mut before, &mut o, job.train.seed).unwrap();
    let mut moved = 0.0f32;
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
    }
    assert!(moved > 1e-4, "the update moved the parameters: {moved}");
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
