//! GRPO over processes through the binary: `pipefill launch -n 2 -- rl` (rank 0 the rollout
//! engine, the update pipelined over both processes, weights synced to rank 0 every step)
//! ends with exactly the policy and optimizer moments of the in-process `pipefill rl` of
//! the same job: the rollouts are the same samples (same policy, same sampling seeds) and
//! the pipelined update is bitwise the in-process one. A tiny model on the parity task,
//! warmed up until some rollouts are right, so both steps have a gradient.

use std::path::Path;
use std::process::Output;

use pipefill::model::checkpoint::Checkpoint;

mod common;
use common::{clean, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

const TINY: &[&str] = &[
    "model.d_model=16",
    "model.heads=2",
    "model.layers=4",
    "model.seq_len=40",
    "stages=2",
    "filler=\"none\"",
    "data.families=[\"parity\"]",
    "data.max_size=2",
    "data.summary_tasks=50",
    "train.micro_batch_size=4",
    "train.lr=1e-2",
    "train.eval_tasks=2",
    "rl.prompts=8",
    "rl.group=4",
    "rl.max_new_tokens=4",
    "rl.warmup_steps=60",
    "rl.steps=2",
];

/// `pipefill PREFIX... rl` of [`TINY`] and `extra` into `out`, with no launcher variables
/// inherited from the test's environment.
fn pipefill(prefix: &[&str], extra: &[&str], out: &Path) -> Output {
    let mut cmd = clean(EXE);
    cmd.args(prefix).arg("rl");
    for s in TINY.iter().chain(extra) {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out-dir").arg(out).output().unwrap()
}

/// A field of every line of `dir`'s metrics.jsonl.
fn column(dir: &Path, field: &str) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v[field].as_f64().unwrap()
        })
        .collect()
}

#[test]
fn launched_rl_over_two_processes_equals_the_in_process_run_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let (single, multi) = (dir.path().join("single"), dir.path().join("multi"));
    let out = pipefill(&[], &[], &single);
    assert!(out.status.success(), "{}", text(&out));
    let out = pipefill(&["launch", "-n", "2", "--"], &[], &multi);
    assert!(out.status.success(), "{}", text(&out));

    // The same rollouts were scored, and they carried a gradient (else only weight decay
    // would move the parameters).
    let rewards = column(&multi, "reward");
    assert_eq!(rewards, column(&single, "reward"));
    assert!(
        column(&multi, "grad_norm").iter().all(|&g| g > 0.0),
        "a step without a gradient: {}",
        text(&out)
    );

    let a = Checkpoint::load(&single.join("checkpoint")).unwrap();
    let b = Checkpoint::load(&multi.join("checkpoint")).unwrap();
    assert_eq!(a.meta.step, 60 + 2);
    assert_eq!(a.meta.step, b.meta.step);
    assert_eq!(a.meta.optimizer_step, b.meta.optimizer_step);
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        assert_eq!(x.name, y.name);
        assert_eq!(x.shape, y.shape);
        let differ = x
            .data
            .iter()
            .zip(&y.data)
            .filter(|(p, q)| p.to_bits() != q.to_bits())
            .count();
        assert_eq!(differ, 0, "{}: {differ} values differ", x.name);
    }
}

#[test]
fn launched_rl_refuses_replicas_kl_and_a_world_unlike_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let out = pipefill(
        &["launch", "-n", "2", "--"],
        &["dp=2", "stages=1"],
        dir.path(),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("dp = 1), not dp = 2"), "{err}");

    let out = pipefill(
        &["launch", "-n", "2", "--"],
        &["rl.kl_coef=0.1"],
        dir.path(),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rl.kl_coef = 0.1"), "{err}");

    let out = pipefill(&["launch", "-n", "3", "--"], &[], dir.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("launched with 3 processes"), "{err}");
}
