//! `schedule = "auto"` in a multi-process job (the static variant): every rank builds the
//! same auto plan, for the modelled costs, and the launched run ends with exactly the
//! parameters and optimizer moments of the in-process auto run (which re-plans from its
//! measured costs): every auto plan keeps each stage's micro-batch order, so both sum their
//! gradients in the reference trainer's order.

use std::path::Path;
use std::process::Output;

use pipefill::model::checkpoint::Checkpoint;

mod common;
use common::{clean, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

const JOB: &[&str] = &[
    "schedule=\"auto\"",
    "stages=4",
    "filler=\"none\"",
    "model.d_model=16",
    "model.heads=2",
    "model.layers=4",
    "model.seq_len=32",
    "train.micro_batches=8",
    "train.micro_batch_size=2",
    "train.steps=3",
    "train.clip=0.5",
    "train.eval_tasks=2",
    "data.summary_tasks=50",
];

/// `pipefill PREFIX... train` of [`JOB`] into `out`, with no launcher variables inherited
/// from the test's environment.
fn train(prefix: &[&str], out: &Path) -> Output {
    let mut cmd = clean(EXE);
    cmd.args(prefix).arg("train");
    for s in JOB {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out-dir").arg(out).output().unwrap()
}

#[test]
fn launched_auto_schedule_equals_the_in_process_auto_run_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let (single, multi) = (dir.path().join("single"), dir.path().join("multi"));
    let out = train(&[], &single);
    assert!(out.status.success(), "{}", text(&out));
    let out = train(&["launch", "-n", "4", "--"], &multi);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("auto plan"), "{}", text(&out));

    let a = Checkpoint::load(&single.join("checkpoint")).unwrap();
    let b = Checkpoint::load(&multi.join("checkpoint")).unwrap();
    assert_eq!(a.meta.step, 3);
    assert_eq!(a.meta.step, b.meta.step);
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        assert_eq!(x.name, y.name);
        let differ = x
            .data
            .iter()
            .zip(&y.data)
            .filter(|(p, q)| p.to_bits() != q.to_bits())
            .count();
        assert_eq!(differ, 0, "{}: {differ} values differ", x.name);
    }
    let report = std::fs::read_to_string(multi.join("report.txt")).unwrap();
    assert!(report.contains("schedule auto"), "{report}");
}
