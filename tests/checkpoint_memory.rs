//! What periodic checkpoints cost in memory (issue 34, item 9): a checkpoint write holds
//! the ranks' state once (streamed to its files, no serialized or cloned copy) and one
//! checkpoint is written at a time, so a run that saves a checkpoint every step peaks
//! within [`CHECKPOINT_PARAM_BYTES`] per parameter of the same run without checkpoints,
//! and within the estimate it printed. (Before: ~50 bytes per parameter more, over the
//! estimate: 3.1 GB against 2.4 GiB at d_model 512.)

use std::process::Stdio;

use pipefill::config::JobConfig;
use pipefill::config::memory::{Bytes, CHECKPOINT_PARAM_BYTES, MemoryEstimate, Workload};

mod common;
use common::clean;

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// Slack for the allocator and the profile kept per step.
const SLACK: u64 = 32 << 20;

/// `pipefill train` of a 6.3M-parameter model for two steps, checkpointing every
/// `every` steps: its peak RSS (`wait4`'s rusage), parameters and printed estimate.
#[expect(
    clippy::zombie_processes,
    reason = "the child is reaped by wait4, which std's Child cannot do with its rusage"
)]
fn peak(every: u32) -> (u64, u64, String) {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = clean(EXE);
    cmd.args(["train", "--steps", "2", "--out-dir"])
        .arg(dir.path().join("run"));
    for set in [
        "model.d_model=256".to_string(),
        "filler=\"none\"".into(),
        "train.eval_tasks=0".into(),
        format!("checkpoint_every={every}"),
    ] {
        cmd.args(["--set", &set]);
    }
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut stdout = child.stdout.unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut text).unwrap();
        text
    });
    let mut status = 0;
    // SAFETY: `usage` is a plain C struct that wait4 fills; the child is ours and waited
    // for here only.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let waited = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(waited, pid, "wait4 failed");
    let out = reader.join().unwrap();
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{out}"
    );
    let params = out
        .lines()
        .find_map(|l| l.strip_prefix("model: ")?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no model line: {out}"));
    let estimate = out
        .lines()
        .find(|l| l.starts_with("memory: "))
        .unwrap_or_else(|| panic!("no memory line: {out}"))
        .to_string();
    // Linux reports kilobytes.
    (usage.ru_maxrss as u64 * 1024, params, estimate)
}

#[test]
fn checkpointing_every_step_costs_at_most_the_checkpoint_buffers_it_is_estimated_with() {
    let (without, params, _) = peak(0);
    let (with, _, estimate) = peak(1);
    let job = JobConfig::embedded(&[
        "model.d_model=256".into(),
        "filler=\"none\"".into(),
        "train.eval_tasks=0".into(),
        "checkpoint_every=1".into(),
    ])
    .unwrap();
    let estimated = MemoryEstimate::of(&job, Workload::Train).unwrap().total;
    assert!(
        with <= estimated,
        "peak {} over the estimate {}",
        Bytes(with),
        Bytes(estimated)
    );
    let bound = without + params * CHECKPOINT_PARAM_BYTES + SLACK;
    assert!(
        with <= bound,
        "peak {} with a checkpoint every step, {} without: more than {} bytes per parameter \
         of {params}",
        Bytes(with),
        Bytes(without),
        CHECKPOINT_PARAM_BYTES
    );
    eprintln!(
        "peak RSS {} with a checkpoint every step, {} without ({params} parameters); {estimate}",
        Bytes(with),
        Bytes(without)
    );
}
