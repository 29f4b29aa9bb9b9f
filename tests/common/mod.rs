//! Helpers shared by the integration tests. Here: for the tests that run the `pipefill`
//! binary as child processes (the launcher and CLI tests), a command that does not inherit
//! launcher variables, a child's output for assertion messages, and the bitwise comparison
//! of two runs' checkpoints. [`job`]: the tiny in-process training job and the checkpoint
//! bits the resume, data-parallel and oracle tests compare. [`scripted`]: rollouts fixed in
//! advance for the RL update tests. [`rollouts`]: the rollout-engine tests' target and requests.
// Each test binary compiles this module and uses only some of it.
#![allow(dead_code)]

pub mod hf;
pub mod job;
pub mod rollouts;
pub mod scripted;

use std::path::Path;
use std::process::{Command, Output};

use pipefill::model::checkpoint::Checkpoint;

/// A model small enough that a few steps take well under a second, as `--set` arguments.
pub const TINY_MODEL: [&str; 7] = [
    "model.layers=2",
    "model.d_model=16",
    "model.heads=2",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.eval_tasks=0",
    "data.summary_tasks=50",
];

/// [`TINY_MODEL`] as a 1F1B pipeline of two ranks without filler.
pub const TINY_PIPELINE: [&str; 10] = [
    "stages=2",
    "schedule=1f1b",
    "filler=none",
    TINY_MODEL[0],
    TINY_MODEL[1],
    TINY_MODEL[2],
    TINY_MODEL[3],
    TINY_MODEL[4],
    TINY_MODEL[5],
    TINY_MODEL[6],
];

/// The launched tests' model and batch: four layers (so four stages fit), 4 micro-batches
/// of 2, 3 steps, clipped on every step (the gradient norm crosses processes).
pub const LAUNCHED_MODEL: [&str; 9] = [
    "model.d_model=16",
    "model.heads=2",
    "model.layers=4",
    "model.seq_len=32",
    "train.micro_batches=4",
    "train.micro_batch_size=2",
    "train.steps=3",
    "train.clip=0.5",
    "data.summary_tasks=50",
];

/// `train` with each of `sets` as a `--set`, into `out`.
pub fn train_args<'a>(out: &Path, sets: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut args = vec!["train".to_string()];
    for s in sets {
        args.push("--set".into());
        args.push(s.to_string());
    }
    args.push("--out-dir".into());
    args.push(out.display().to_string());
    args
}

/// Variables a rank reads its identity from (pipefill's own, torchrun's, PMI's, Slurm's,
/// OpenMPI's) and the job token: a test run under a launcher must not pass them on, or its
/// children would take themselves for ranks of the test's own job.
const LAUNCHER_VARS: [&str; 7] = [
    "RANK",
    "WORLD_SIZE",
    "PMI_RANK",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "PIPEFILL_RANK",
    "PIPEFILL_TOKEN",
];

/// `program` with no launcher variables inherited from the test's environment.
pub fn clean(program: &str) -> Command {
    let mut cmd = Command::new(program);
    for var in LAUNCHER_VARS {
        cmd.env_remove(var);
    }
    cmd
}

/// `pipefill export RUN --format hf -o OUT EXTRA...`.
pub fn export_hf(run: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut cmd = clean(env!("CARGO_BIN_EXE_pipefill"));
    cmd.arg("export").arg(run).args(["--format", "hf", "-o"]);
    cmd.arg(out).args(extra).output().unwrap()
}

/// A finished child's stdout and stderr, for an assertion's message.
pub fn text(out: &Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A failed command's stderr: exactly one line, an `error: `, no panic; returned for
/// further checks.
pub fn one_line_error(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure: {}", text(out));
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "not one line: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    stderr
}

/// Asserts that `a` and `b` are the same step and hold the same tensors, bit for bit
/// (names, shapes and values; the optimizer's moments are tensors too).
pub fn assert_bitwise(a: &Checkpoint, b: &Checkpoint) {
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

/// Every line of `run`'s metrics.jsonl, parsed.
pub fn metrics_lines(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A field of every line of `run`'s metrics.jsonl (NaN where a line lacks it).
pub fn metrics_column(run: &Path, field: &str) -> Vec<f64> {
    metrics_lines(run)
        .iter()
        .map(|v| v[field].as_f64().unwrap_or(f64::NAN))
        .collect()
}

/// This process's thread count (`/proc/self/status`).
pub fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap()
}
