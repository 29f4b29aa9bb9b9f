//! Sharded checkpoints of multi-process runs through the binary: `pipefill launch -n 4` with
//! `checkpoint_every = 5` writes one shard per rank and a manifest every 5 steps and at the
//! end; 10 steps + `--resume` + 10 steps equals 20 steps bit for bit (parameters and
//! optimizer moments), and so does resuming from the step-5 checkpoint; a checkpoint without
//! its manifest, a truncated shard and another layout's checkpoint are refused with errors
//! naming the file or the figure. A tiny model keeps each job to a few seconds.

use std::path::Path;
use std::process::Output;

use pipefill::model::checkpoint::Checkpoint;
use pipefill::model::checkpoint::sharded::{
    Layout, MANIFEST_FILE, Manifest, load_sharded, shard_file, step_dir,
};

mod common;
use common::job::{TensorBits, sorted_bits};
use common::{clean, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// Four ranks of ZB-H1 with clipping on, checkpointing every 5 steps and keeping them all
/// (the 20-step run's four are each checked).
const JOB: &[&str] = &[
    "schedule=\"zb-h1\"",
    "stages=4",
    "filler=\"none\"",
    "checkpoint_every=5",
    "checkpoint_keep=0",
    "model.d_model=16",
    "model.heads=2",
    "model.layers=4",
    "model.seq_len=32",
    "train.micro_batches=4",
    "train.micro_batch_size=2",
    "train.clip=0.5",
    "train.eval_tasks=0",
    "data.summary_tasks=50",
];

/// `pipefill launch -n <n> -- train` of the job with `extra` settings into `out`.
fn launch(n: usize, out: &Path, extra: &[&str], resume: Option<&Path>) -> Output {
    let mut cmd = clean(EXE);
    cmd.args(["launch", "-n", &n.to_string(), "--", "train"]);
    for s in JOB.iter().chain(extra) {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out-dir").arg(out);
    if let Some(r) = resume {
        cmd.arg("--resume").arg(r);
    }
    cmd.output().unwrap()
}

fn run_ok(out: &Path, extra: &[&str], resume: Option<&Path>) {
    let o = launch(4, out, extra, resume);
    assert!(o.status.success(), "{}", text(&o));
}

/// Every tensor's bits by name, with the step and optimizer step.
fn bits(c: &Checkpoint) -> (u64, u64, TensorBits) {
    (c.meta.step, c.meta.optimizer_step, sorted_bits(c))
}

/// The sharded checkpoint of `step` in run directory `run`, read whole.
fn sharded(run: &Path, step: u64) -> Checkpoint {
    let dir = step_dir(run, step);
    let m = Manifest::read(&dir).unwrap();
    let layout = Layout {
        dp: 1,
        stage_rank: vec![0, 1, 2, 3],
    };
    load_sharded(&dir, &layout, &m.config_hash).unwrap()
}

#[test]
fn ten_steps_resumed_for_ten_more_equal_twenty_bitwise_from_either_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full");
    run_ok(&full, &["train.steps=20"], None);
    let reference = Checkpoint::load(&full.join("checkpoint")).unwrap();
    for step in [5, 10, 15, 20] {
        let m = Manifest::read(&step_dir(&full, step)).unwrap();
        assert_eq!((m.world, m.shards.len(), m.replicas_saved), (4, 4, Some(1)));
    }
    // The shards of the last checkpoint hold exactly the gathered final state.
    assert_eq!(bits(&sharded(&full, 20)), bits(&reference));

    let first = dir.path().join("first");
    run_ok(&first, &["train.steps=10"], None);
    assert_eq!(bits(&sharded(&first, 10)), bits(&sharded(&full, 10)));
    // Resumed from the run directory: its newest checkpoint, step 10.
    let second = dir.path().join("second");
    run_ok(&second, &["train.steps=20"], Some(&first));
    let resumed = Checkpoint::load(&second.join("checkpoint")).unwrap();
    assert_eq!(bits(&resumed), bits(&reference));
    assert_eq!(bits(&sharded(&second, 15)), bits(&sharded(&full, 15)));

    // Resumed from the step-5 checkpoint for 5 steps: step 10 of the full run.
    let third = dir.path().join("third");
    run_ok(&third, &["train.steps=10"], Some(&step_dir(&first, 5)));
    let from_five = Checkpoint::load(&third.join("checkpoint")).unwrap();
    assert_eq!(bits(&from_five), bits(&sharded(&full, 10)));
}

#[test]
fn unfinished_truncated_or_foreign_checkpoints_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    run_ok(&run, &["train.steps=4", "checkpoint_every=2"], None);
    let (two, four) = (step_dir(&run, 2), step_dir(&run, 4));

    // The step-4 checkpoint lost its manifest: named directly it is refused; the run
    // directory resumes from a complete one instead (its final whole checkpoint here).
    std::fs::remove_file(four.join(MANIFEST_FILE)).unwrap();
    let o = launch(4, &dir.path().join("a"), &["train.steps=6"], Some(&four));
    let err = text(&o);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains(MANIFEST_FILE) && err.contains("incomplete"),
        "{err}"
    );

    // A truncated shard: refused by every rank, naming the file.
    let shard = two.join(shard_file(2));
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let o = launch(4, &dir.path().join("b"), &["train.steps=6"], Some(&two));
    let err = text(&o);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains(&shard_file(2)) && err.contains("truncated"),
        "{err}"
    );
    std::fs::write(&shard, &bytes).unwrap();

    // Another world (2 ranks of 2 stages) or other job settings.
    let o = launch(
        2,
        &dir.path().join("c"),
        &["train.steps=6", "stages=2"],
        Some(&two),
    );
    let err = text(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("written by 4 ranks"), "{err}");
    let o = launch(
        4,
        &dir.path().join("d"),
        &["train.steps=6", "train.lr=0.5"],
        Some(&two),
    );
    let err = text(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("fingerprint"), "{err}");
}
