//! `pipefill train` with `checkpoint_every` writes sharded checkpoints during a pipelined run,
//! and `--resume` continues from one bit for bit: 2 steps + resume + 2 steps ends with the
//! same final checkpoint as 4 steps. `--resume RUN_DIR` takes the newest complete
//! checkpoint, never one without its manifest; a corrupted shard is refused in one line.

use std::path::Path;
use std::process::Output;

use pipefill::model::checkpoint::Checkpoint;
use pipefill::model::checkpoint::sharded::{MANIFEST_FILE, step_dir};

mod common;
use common::job::{TensorBits, sorted_bits};
use common::{TINY_PIPELINE, clean, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// `pipefill train --steps 4` of the tiny pipeline, checkpointing every second step, into `out`, with no launcher variables inherited.
fn train(extra: &[&str], out: &Path) -> Output {
    let mut cmd = clean(EXE);
    cmd.args(["train", "--steps", "4"]).args(extra);
    for s in TINY_PIPELINE.iter().chain(&["checkpoint_every=2"]) {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out-dir").arg(out).output().unwrap()
}

/// The tensors of the whole checkpoint in `dir`.
fn bits(dir: &Path) -> TensorBits {
    sorted_bits(&Checkpoint::load(dir).unwrap())
}

#[test]
fn two_steps_resume_two_steps_equals_four_through_the_cli() {
    let whole = tempfile::tempdir().unwrap();
    let out = train(&[], whole.path());
    assert!(out.status.success(), "{}", text(&out));
    for step in [2, 4] {
        let dir = step_dir(whole.path(), step);
        assert!(dir.join(MANIFEST_FILE).is_file(), "{}", dir.display());
        assert!(dir.join("rank-00000.safetensors").is_file());
        assert!(dir.join("rank-00001.safetensors").is_file());
    }

    let resumed = tempfile::tempdir().unwrap();
    let middle = step_dir(whole.path(), 2);
    let out = train(&["--resume", middle.to_str().unwrap()], resumed.path());
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("at step 2"));
    assert!(
        bits(&resumed.path().join("checkpoint")) == bits(&whole.path().join("checkpoint")),
        "resumed final checkpoint differs from the uninterrupted run's"
    );
}

#[test]
fn resume_from_a_run_directory_skips_unfinished_and_refuses_corrupted_checkpoints() {
    let run = tempfile::tempdir().unwrap();
    let out = train(&[], run.path());
    assert!(out.status.success(), "{}", text(&out));
    // As if the run died while writing its step-4 checkpoint, before the final one.
    std::fs::remove_file(step_dir(run.path(), 4).join(MANIFEST_FILE)).unwrap();
    std::fs::remove_dir_all(run.path().join("checkpoint")).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let resume = ["--resume", run.path().to_str().unwrap()];
    let out = train(&resume, elsewhere.path());
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("at step 2"),
        "{}",
        text(&out)
    );

    let shard = step_dir(run.path(), 2).join("rank-00001.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xFF;
    std::fs::write(&shard, bytes).unwrap();
    let out = train(&resume, tempfile::tempdir().unwrap().path());
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert_eq!(stderr.lines().count(), 1, "not one line: {stderr}");
    assert!(
        stderr.contains("corrupted") && stderr.contains("rank-00001.safetensors"),
        "{stderr}"
    );
}
