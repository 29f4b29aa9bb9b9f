//! The rollout engine on a Llama-shaped model (rotary positions with Llama 3's scaling,
//! SwiGLU, 4 query heads on 2 key/value heads, q/k/v biases): plain decoding through
//! pipelined KV-cache stages equals greedy generation with the training model, and
//! speculative decoding (chains and trees, random, oracle and drafter proposals) is
//! token for token plain decoding.

mod common;

use common::rollouts::{greedy_reference, requests};
use pipefill::model::config::{Positions, RopeScaling};
use pipefill::model::drafter::{
    DraftBufferHandle, Drafter, DrafterConfig, DrafterTrainer, TreeShape,
};
use pipefill::model::infer::InferStage;
use pipefill::model::{Cut, Gpt, GptConfig, init};
use pipefill::rl::rollout::{RolloutConfig, RolloutEngine, RolloutOutput, Speculation};
use pipefill::rl::speculative::{OracleProposer, Proposer, RandomProposer};
use pipefill::tensor::{Activation, CpuBackend};

fn config() -> GptConfig {
    GptConfig {
        layers: 4,
        seq_len: 40,
        seed: 11,
        d_model: 32,
        heads: 4,
        kv_heads: Some(2),
        intermediate: Some(48),
        activation: Activation::Swiglu,
        positions: Positions::Rope,
        rope_theta: 500_000.0,
        rope_scaling: Some(RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        }),
        qkv_bias: true,
        ..GptConfig::default()
    }
}

/// The model, its weights redrawn at a larger scale and its q/k/v biases at random (they
/// are initialised to zero): at the initial scale every completion is the end token at
/// once, a long tail of nothing.
fn gpt() -> Gpt<CpuBackend> {
    let mut gpt = Gpt::new(&config(), CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
    let params: Vec<(String, usize, bool)> = gpt
        .params()
        .iter()
        .filter(|p| !p.name.contains("norm"))
        .map(|p| (p.name.clone(), p.numel(), p.shape.len() == 1))
        .collect();
    assert_eq!(params.iter().filter(|p| p.2).count(), 12, "q/k/v biases");
    for (name, n, bias) in params {
        let std = if bias { 0.5 } else { 0.3 };
        gpt.set_param(&name, &init::normal(7, &name, n, std))
            .unwrap();
    }
    gpt
}

fn engine(gpt: &Gpt<CpuBackend>) -> RolloutEngine<CpuBackend> {
    RolloutEngine::new(InferStage::stages_of(gpt, &Cut::Layers(vec![1, 2, 1])).unwrap()).unwrap()
}

fn run(
    e: &mut RolloutEngine<CpuBackend>,
    spec: Speculation,
    groups: usize,
    p: Option<&mut dyn Proposer>,
) -> RolloutOutput {
    let cfg = RolloutConfig {
        groups,
        speculation: spec,
        record_rows: true,
        ..RolloutConfig::default()
    };
    e.run(&requests(10), &cfg, p).unwrap()
}

const SHAPE: TreeShape = TreeShape {
    depth: 3,
    branch: 3,
    width: 2,
    nodes: 8,
};

#[test]
fn plain_rollout_equals_greedy_generation_of_the_training_model() {
    let mut model = gpt();
    let out = run(&mut engine(&model), Speculation::Off, 3, None);
    for (i, r) in requests(10).iter().enumerate() {
        assert_eq!(
            out.sequences[i],
            greedy_reference(&mut model, r),
            "request {i}"
        );
    }
}

#[test]
fn speculation_is_token_for_token_plain_decoding() {
    let model = gpt();
    let mut e = engine(&model);
    let plain = run(&mut e, Speculation::Off, 2, None);
    let generated: usize = (0..10).map(|i| plain.completion(i).len()).sum();
    assert!(
        generated > 60,
        "a long tail to speculate on: {generated} tokens"
    );
    let mut random = RandomProposer::new(50);
    let fixed = run(&mut e, Speculation::Fixed { k: 3 }, 2, Some(&mut random));
    assert_eq!(fixed.sequences, plain.sequences, "random drafts");
    assert!(fixed.stats.verifications > 0);
    let mut oracle = OracleProposer::new(50, &plain.sequences);
    let exact = run(&mut e, Speculation::Fixed { k: 4 }, 3, Some(&mut oracle));
    assert_eq!(exact.sequences, plain.sequences, "oracle drafts");
    assert!(
        exact.stats.acceptance_length() > 3.0,
        "an oracle's drafts are accepted: {}",
        exact.stats.acceptance_length()
    );
    let mut random = RandomProposer::new(50);
    let tree = run(&mut e, Speculation::Tree(SHAPE), 2, Some(&mut random));
    assert_eq!(tree.sequences, plain.sequences, "random trees");

    // The drafter: one block of the target's family (rope, GQA, SwiGLU, biases), untrained
    // and then trained on the plain rollout's own rows.
    let dc = DrafterConfig {
        window: 8,
        batch_rows: 4,
        max_positions: 32,
        ..DrafterConfig::default()
    };
    let mut drafter = Drafter::new(&config(), &dc, CpuBackend::new(1).unwrap()).unwrap();
    drafter.refresh_from_gpt(&model, 0).unwrap();
    let untrained = run(&mut e, Speculation::Fixed { k: 3 }, 2, Some(&mut drafter));
    assert_eq!(untrained.sequences, plain.sequences, "untrained drafter");
    let buffer = DraftBufferHandle::new(&config(), &dc);
    buffer.begin_step(0);
    for row in plain.rows.iter().cloned() {
        buffer.lock().push(row).unwrap();
    }
    let mut trainer = DrafterTrainer::new(drafter, buffer, 0, 1).unwrap();
    for _ in 0..60 {
        trainer.slice().unwrap();
    }
    let d = trainer.drafter_mut();
    let chain = run(&mut e, Speculation::Fixed { k: 3 }, 2, Some(&mut *d));
    assert_eq!(chain.sequences, plain.sequences, "trained drafter");
    let tree = run(&mut e, Speculation::Tree(SHAPE), 2, Some(&mut *d));
    assert_eq!(tree.sequences, plain.sequences, "trained drafter's trees");
    assert!(
        chain.stats.acceptance_length() > untrained.stats.acceptance_length(),
        "training on the rollouts raises acceptance: {} vs {}",
        chain.stats.acceptance_length(),
        untrained.stats.acceptance_length()
    );
}

/// `pipefill rl` on a Llama-shaped `[model]` through the binary: a supervised warm-up, two
/// RL steps whose rollouts speculate (acceptance recorded in the metrics).
#[test]
fn pipefill_rl_runs_on_a_llama_shaped_model() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_pipefill"));
    cmd.args(["rl", "--steps", "2"]);
    for s in [
        "model.d_model=16",
        "model.heads=2",
        "model.kv_heads=1",
        "model.layers=4",
        "model.seq_len=40",
        "model.positions=\"rope\"",
        "model.activation=\"swiglu\"",
        "model.intermediate=24",
        "model.qkv_bias=true",
        "stages=2",
        "data.max_size=3",
        "data.summary_tasks=50",
        "train.micro_batch_size=2",
        "train.eval_tasks=2",
        "rl.prompts=2",
        "rl.group=3",
        "rl.max_new_tokens=12",
        "rl.warmup_steps=3",
        "rl.spec_threshold=5",
    ] {
        cmd.args(["--set", s]);
    }
    let done = cmd.arg("--out-dir").arg(&out).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&done.stdout),
        String::from_utf8_lossy(&done.stderr)
    );
    assert!(done.status.success(), "{text}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{metrics}");
    assert!(
        lines.iter().any(|m| m["speculation"] == true),
        "the rollouts speculated: {metrics}"
    );
    assert!(out.join("checkpoint").is_dir());
}
