//! `device = "cpu" | "cuda"` through the binary: where CUDA cannot be used (a build without
//! the `cuda` feature, no driver, no such GPU), `device = "cuda"` is one clear error naming
//! the field, never a panic, from `pipefill train` and from every rank of `pipefill launch`
//! (before any rank waits for the others); `transport = "nccl"` on the CPU is the
//! transport's own clear error. Launched CPU runs are covered, bitwise, by tests/launch*.rs.

use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use pipefill::tensor::device::Device;

mod common;
use common::{clean, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// A tiny two-stage job (it never gets to train in these tests, but must be valid).
const JOB: &[&str] = &[
    "stages=2",
    "filler=\"none\"",
    "model.d_model=16",
    "model.heads=2",
    "model.layers=2",
    "model.seq_len=32",
    "train.steps=1",
    "train.eval_tasks=0",
    "data.summary_tasks=20",
];

fn train_args(out: &Path, extra: &[&str]) -> Vec<String> {
    job_args(&["train"], out, extra)
}

/// `command` (its words) on [`JOB`] with `extra` settings, into `out`.
fn job_args(command: &[&str], out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = command.iter().map(|w| w.to_string()).collect();
    for s in JOB.iter().chain(extra) {
        args.push("--set".into());
        args.push(s.to_string());
    }
    args.push("--out-dir".into());
    args.push(out.display().to_string());
    args
}

/// The child's output, or a failed test (and a killed child) after `limit`: an error that
/// is reported only after a rendezvous timeout is not the clear error asked for.
fn finish(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!("still running after {limit:?}:\n{}", text(&out));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn run(args: &[String]) -> Output {
    let child = clean(EXE)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish(child, Duration::from_secs(60))
}

/// Whether CUDA ordinal `ordinal` is usable by this build here (then the "unusable" tests
/// have nothing to check, and say so).
fn cuda_usable(ordinal: usize) -> bool {
    let usable = (Device::Cuda { ordinal }).check_available().is_ok();
    if usable {
        eprintln!("cuda:{ordinal} is usable here: the no-CUDA error is not reachable");
    }
    usable
}

#[test]
fn train_on_cuda_without_cuda_is_one_error_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    if cuda_usable(0) {
        // With a GPU the single-process pipeline trains there, each rank on a GPU.
        let out = run(&train_args(dir.path(), &["device=\"cuda\""]));
        assert!(out.status.success(), "{}", text(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("on the GPUs"), "{}", text(&out));
        return;
    }
    let reason = (Device::Cuda { ordinal: 0 }).check_available().unwrap_err();
    // The job file's field, `--set` and the `--device` flag all reach the same check, for
    // the pipelined trainer and the reference trainer alike.
    for extra in [
        &["device=\"cuda\""][..],
        &["device=\"cuda\"", "schedule=\"none\""][..],
    ] {
        let out = run(&train_args(dir.path(), extra));
        assert!(!out.status.success(), "{extra:?}: {}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        let expected = format!("invalid `device`: \"cuda\" (cuda:0) cannot be used here: {reason}");
        assert!(stderr.contains(&expected), "{extra:?}: {}", text(&out));
        assert!(!stderr.contains("panicked"), "{}", text(&out));
        assert_eq!(
            stderr.lines().filter(|l| l.contains("device")).count(),
            1,
            "one error line: {}",
            text(&out)
        );
    }
    let mut args = train_args(dir.path(), &[]);
    args.extend(["--device".into(), "cuda".into()]);
    let out = run(&args);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("invalid `device`: \"cuda\" (cuda:0)"),
        "{}",
        text(&out)
    );
    // Nothing ran: no run directory was written.
    assert!(!dir.path().join("job.toml").exists());
}

#[test]
fn launched_ranks_on_cuda_without_cuda_fail_at_once_naming_the_field() {
    if cuda_usable(0) && cuda_usable(1) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["launch".to_string(), "-n".into(), "2".into(), "--".into()];
    args.extend(train_args(dir.path(), &["device=\"cuda\""]));
    let out = run(&args);
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{}", text(&out));
    // Each rank asks for the GPU of its own local rank; one that cannot have it names it.
    let mut named = 0;
    for rank in 0..2 {
        if cuda_usable(rank) {
            continue;
        }
        let reason = (Device::Cuda { ordinal: rank })
            .check_available()
            .unwrap_err();
        let expected = format!(
            "[rank {rank}] error: invalid `device`: \"cuda\" (cuda:{rank}) cannot be used here: {reason}"
        );
        assert!(stderr.contains(&expected), "{expected}\n{}", text(&out));
        named += 1;
    }
    assert!(named > 0);
    assert!(
        stderr.contains("of the job's ranks failed"),
        "{}",
        text(&out)
    );
}

#[test]
fn launched_cpu_ranks_refuse_nccl_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["launch".to_string(), "-n".into(), "2".into(), "--".into()];
    args.extend(train_args(
        dir.path(),
        &["device=\"cpu\"", "transport=\"nccl\""],
    ));
    let out = run(&args);
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{}", text(&out));
    for rank in 0..2 {
        let expected = format!(
            "[rank {rank}] error: rank {rank}: transport = \"nccl\" needs the ranks to compute on a CUDA GPU, but this run computes on cpu"
        );
        assert!(stderr.contains(&expected), "{expected}\n{}", text(&out));
    }
}

/// A short RL run on `cuda` (two warm-up steps, 2 × 2 sequences of up to 8 tokens).
const RL_ON_CUDA: &[&str] = &[
    "device=\"cuda\"",
    "rl.warmup_steps=2",
    "rl.prompts=2",
    "rl.group=2",
    "rl.max_new_tokens=8",
    "rl.drafter_slices=2",
];

/// `pipefill rl` on `cuda`: with a usable GPU the in-process run trains there (policy,
/// rollouts, drafter and the update's ranks); without one, one error naming `device` before
/// anything ran.
#[test]
fn rl_on_cuda_runs_on_the_gpu_or_names_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("rl");
    let out = run(&job_args(&["rl", "--steps", "2"], &out_dir, RL_ON_CUDA));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{}", text(&out));
    if cuda_usable(0) {
        assert!(out.status.success(), "{}", text(&out));
        let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.lines().count(), 2, "{metrics}");
        assert!(out_dir.join("checkpoint").is_dir());
        return;
    }
    assert!(!out.status.success(), "{}", text(&out));
    let reason = (Device::Cuda { ordinal: 0 }).check_available().unwrap_err();
    let expected = format!("invalid `device`: \"cuda\" (cuda:0) cannot be used here: {reason}");
    assert!(stderr.contains(&expected), "{}", text(&out));
    // Refused before anything ran: no warm-up, no run directory.
    assert!(!out_dir.exists());
}

/// A launched `pipefill rl` on `cuda`: each rank computes on its local rank's GPU (the
/// policy and rollouts on rank 0's); a rank whose GPU cannot be used says so, naming
/// `device`, before anything ran.
#[test]
fn launched_rl_on_cuda_runs_on_the_gpus_or_names_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("rl");
    let launch = ["launch", "-n", "2", "--", "rl", "--steps", "2"];
    let out = run(&job_args(&launch, &out_dir, RL_ON_CUDA));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{}", text(&out));
    if cuda_usable(0) && cuda_usable(1) {
        assert!(out.status.success(), "{}", text(&out));
        let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.lines().count(), 2, "{metrics}");
        return;
    }
    assert!(!out.status.success(), "{}", text(&out));
    for rank in 0..2 {
        let device = Device::Cuda { ordinal: rank };
        let Err(reason) = device.check_available() else {
            continue;
        };
        let expected = format!(
            "[rank {rank}] error: invalid `device`: \"cuda\" (cuda:{rank}) cannot be used here: {reason}"
        );
        assert!(stderr.contains(&expected), "{expected}\n{}", text(&out));
    }
    assert!(!out_dir.join("metrics.jsonl").exists());
}

/// The library's in-process pipeline reaches the same check: a job on `cuda` where CUDA
/// cannot be used is one error naming `device` before any rank is built (with a GPU it
/// trains there; scripts/gpu-check.sh compares it with the CPU).
#[test]
fn the_in_process_pipeline_on_cuda_without_cuda_names_the_field() {
    use pipefill::config::{DeviceKind, JobConfig};
    use pipefill::pipeline::PipelineTrainer;
    if cuda_usable(0) {
        return;
    }
    let mut job =
        JobConfig::embedded(&JOB.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    job.device = DeviceKind::Cuda;
    let e = PipelineTrainer::from_job(&job)
        .unwrap()
        .run(1, |_| {})
        .expect_err("refused")
        .to_string();
    assert!(e.contains("invalid `device`: \"cuda\" (cuda:0)"), "{e}");
}

/// `PIPEFILL_BLAS` naming a library that cannot be used (none there, or one that is not
/// MKL) is one clear error naming the setting and the library, before anything runs; it is
/// never a silent fallback to other products.
#[test]
fn a_blas_that_cannot_be_used_is_one_error_naming_it() {
    for (lib, why) in [
        ("/nonexistent/libmkl_rt.so.3", "cannot be loaded"),
        ("libc.so.6", "has no cblas_sgemm"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = clean(EXE)
            .env("PIPEFILL_BLAS", lib)
            .args(train_args(dir.path(), &[]))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{lib}: {}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("PIPEFILL_BLAS={lib}: {why}")),
            "{lib}: {}",
            text(&out)
        );
        assert!(!stderr.contains("panicked"), "{}", text(&out));
        assert!(
            !dir.path().join("job.toml").exists(),
            "{lib}: a run was started"
        );
    }
}
