//! The run directory through the binary (issue 19, item 1 and the metrics half of item 7):
//! a finished run is never overwritten by `train`, `train --schedule none`, `rl` or a
//! launched job unless `--overwrite` is given; an empty `out_dir` is refused; a resume
//! that cannot continue changes no file; and a run continued with `--resume` has each
//! step's metrics line once.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;

use serde_json::Value;

mod common;
use common::{TINY_PIPELINE, clean, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// `pipefill <args> --set TINY_PIPELINE... --set extra...`.
fn pipefill(args: &[&str], extra: &[&str]) -> Output {
    let mut cmd = clean(EXE);
    cmd.args(args);
    for s in TINY_PIPELINE.iter().chain(extra) {
        cmd.args(["--set", s]);
    }
    cmd.output().unwrap()
}

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let name = path.strip_prefix(dir).unwrap().display().to_string();
                files.insert(name, std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

/// A failed command whose stderr is one line containing every one of `needles`.
fn assert_refused(out: &Output, needles: &[&str]) {
    assert!(!out.status.success(), "expected a refusal: {}", text(out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "not one error line: {}", text(out));
    for n in needles {
        assert!(errors[0].contains(n), "{n:?} not in {:?}", errors[0]);
    }
}

/// The `step` of every line of `run`'s metrics.jsonl.
fn metric_steps(run: &Path) -> Vec<u64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

/// A finished 3-step run in `run`.
fn finished_run(run: &Path) {
    let out = pipefill(
        &["train", "--steps", "3", "--out-dir", run.to_str().unwrap()],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn a_finished_run_is_refused_by_every_command_and_left_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    finished_run(&run);
    let before = snapshot(&run);
    let r = run.to_str().unwrap();
    let resume_hint = format!("--resume {r}");
    for (args, extra) in [
        (vec!["train", "--steps", "2", "--out-dir", r], vec![]),
        (
            vec!["train", "--steps", "2"],
            vec![format!("out_dir={:?}", r)],
        ),
        (
            vec![
                "train",
                "--steps",
                "2",
                "--schedule",
                "none",
                "--out-dir",
                r,
            ],
            vec![],
        ),
    ] {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let out = pipefill(&args, &extra);
        assert_refused(&out, &["already holds a run", "--overwrite", &resume_hint]);
    }
    let out = pipefill(
        &["rl", "--steps", "1", "--out-dir", r],
        &["rl.max_new_tokens=8"],
    );
    assert_refused(&out, &["already holds a run", "--overwrite"]);
    let out = pipefill(
        &[
            "launch",
            "-n",
            "2",
            "--",
            "train",
            "--steps",
            "2",
            "--out-dir",
            r,
        ],
        &[],
    );
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already holds a run"),
        "{}",
        text(&out)
    );
    assert!(snapshot(&run) == before, "a refused run changed a file");
}

#[test]
fn an_empty_out_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = clean(EXE);
    cmd.current_dir(dir.path())
        .args(["train", "--steps", "1", "--set", "out_dir=\"\""]);
    let out = cmd.output().unwrap();
    assert_refused(&out, &["out_dir is empty"]);
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "wrote into the current directory"
    );
}

#[test]
fn overwrite_replaces_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    finished_run(&run);
    std::fs::write(run.join("notes.md"), "mine").unwrap();
    let out = pipefill(
        &[
            "train",
            "--steps",
            "2",
            "--overwrite",
            "--out-dir",
            run.to_str().unwrap(),
        ],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(metric_steps(&run), [0, 1]);
    assert_eq!(
        std::fs::read_to_string(run.join("notes.md")).unwrap(),
        "mine"
    );
}

#[test]
fn a_resume_that_cannot_continue_changes_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    // Trained with the drafter in its bubbles on 2 ranks; resumed on 4, whose drafter
    // state cannot take the checkpoint's 2 samplers.
    let out = pipefill(
        &["train", "--steps", "2", "--out-dir", run.to_str().unwrap()],
        &["filler=\"drafter\"", "model.layers=4"],
    );
    assert!(out.status.success(), "{}", text(&out));
    let before = snapshot(&run);
    let checkpoint = run.join("checkpoint");
    let out = pipefill(
        &[
            "train",
            "--steps",
            "4",
            "--resume",
            checkpoint.to_str().unwrap(),
            "--out-dir",
            run.to_str().unwrap(),
        ],
        &["filler=\"drafter\"", "stages=4", "model.layers=4"],
    );
    assert!(!out.status.success(), "{}", text(&out));
    assert!(snapshot(&run) == before, "a failed resume changed a file");
}

/// A launched resume whose rank 1 shard is corrupted: rank 0 owns the run directory and
/// wrote job.toml and cut metrics.jsonl before rank 1 found the bad shard; now every shard
/// is checked first and the run directory stays as it was.
#[test]
fn a_launched_resume_from_a_corrupted_shard_changes_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let r = run.to_str().unwrap();
    let out = pipefill(
        &[
            "launch",
            "-n",
            "2",
            "--",
            "train",
            "--steps",
            "3",
            "--out-dir",
            r,
        ],
        &["checkpoint_every=1"],
    );
    assert!(out.status.success(), "{}", text(&out));
    let shard = run.join("checkpoints/step-00000002/rank-00001.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() - 5;
    bytes[at] ^= 0x01;
    std::fs::write(&shard, &bytes).unwrap();
    let before = snapshot(&run);
    let step2 = run.join("checkpoints/step-00000002");
    let out = pipefill(
        &[
            "launch",
            "-n",
            "2",
            "--",
            "train",
            "--steps",
            "5",
            "--resume",
            step2.to_str().unwrap(),
            "--out-dir",
            r,
        ],
        &["checkpoint_every=1"],
    );
    assert!(!out.status.success(), "{}", text(&out));
    let all = text(&out);
    assert!(
        all.contains("corrupted") && all.contains("rank-00001.safetensors"),
        "{all}"
    );
    assert!(
        snapshot(&run) == before,
        "a failed launched resume changed a file"
    );
}

#[test]
fn a_continued_run_has_each_steps_metrics_once() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let r = run.to_str().unwrap();
    // Periodic checkpoints at steps 2 and 4; the run goes on to 5 and is continued from 2.
    let out = pipefill(
        &["train", "--steps", "5", "--out-dir", r],
        &["checkpoint_every=2"],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(metric_steps(&run), [0, 1, 2, 3, 4]);
    let middle = run.join("checkpoints/step-00000002");
    let out = pipefill(
        &[
            "train",
            "--steps",
            "6",
            "--resume",
            middle.to_str().unwrap(),
            "--out-dir",
            r,
        ],
        &["checkpoint_every=2"],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(metric_steps(&run), [0, 1, 2, 3, 4, 5]);
    // The reference trainer continues its own run the same way.
    let reference = dir.path().join("reference");
    let rf = reference.to_str().unwrap();
    let none = ["--schedule", "none"];
    let out = pipefill(
        &[&["train", "--steps", "2", "--out-dir", rf][..], &none].concat(),
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    let checkpoint = reference.join("checkpoint");
    let args = [
        &[
            "train",
            "--steps",
            "3",
            "--resume",
            checkpoint.to_str().unwrap(),
            "--out-dir",
            rf,
        ][..],
        &none,
    ]
    .concat();
    let out = pipefill(&args, &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(metric_steps(&reference), [0, 1, 2]);
}
