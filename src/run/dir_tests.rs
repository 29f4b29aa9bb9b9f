use std::fs;
use std::io::Write;
use std::path::Path;

use super::{Existing, JOB_FILE, METRICS_FILE, Resume, RunDir, fresh_default, utc_stamp};
use crate::model::checkpoint::sharded::{Layout, step_dir};
use crate::model::checkpoint::test_model::{self, checkpoint};
use crate::run::RunError;

/// A finished run's files in `dir`: job.toml, three metrics lines, a checkpoint.
fn finished_run(dir: &Path) {
    checkpoint(3).save(&dir.join("checkpoint")).unwrap();
    fs::write(dir.join(JOB_FILE), "stages = 4\n").unwrap();
    let lines: String = (0..3)
        .map(|s| format!("{{\"step\":{s},\"loss\":1.0}}\n"))
        .collect();
    fs::write(dir.join(METRICS_FILE), lines).unwrap();
}

#[test]
fn a_missing_or_empty_directory_is_claimed() {
    let root = tempfile::tempdir().unwrap();
    let missing = root.path().join("new");
    let dir = RunDir::claim(Some(&missing), "", Resume::Fresh, Existing::Refuse).unwrap();
    assert_eq!(dir.path(), missing);
    assert!(!missing.exists(), "claiming writes nothing");
    fs::create_dir(&missing).unwrap();
    RunDir::claim(Some(&missing), "", Resume::Fresh, Existing::Refuse).unwrap();
}

#[test]
fn an_empty_out_dir_is_refused() {
    let err = RunDir::claim(Some(Path::new("")), "", Resume::Fresh, Existing::Refuse).unwrap_err();
    assert!(matches!(err, RunError::EmptyOutDir), "{err}");
    assert!(err.to_string().contains("out_dir is empty"), "{err}");
}

#[test]
fn a_finished_run_is_refused_and_left_as_it_was() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("r");
    finished_run(&run);
    let before = fs::read(run.join(METRICS_FILE)).unwrap();
    let err = RunDir::claim(Some(&run), "", Resume::Fresh, Existing::Refuse).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("already holds a run") && msg.contains("--overwrite"),
        "{msg}"
    );
    assert!(msg.contains("--resume"), "{msg}");
    let err = RunDir::claim(Some(&run), "", Resume::Unsupported, Existing::Refuse).unwrap_err();
    assert!(!err.to_string().contains("--resume"), "{err}");
    assert_eq!(fs::read(run.join(METRICS_FILE)).unwrap(), before);
    // A checkpoint of another run does not make this one a continuation.
    let other = root.path().join("other");
    finished_run(&other);
    let err = RunDir::claim(
        Some(&run),
        "",
        Resume::From(&other.join("checkpoint")),
        Existing::Refuse,
    )
    .unwrap_err();
    assert!(matches!(err, RunError::NotEmpty { .. }), "{err}");
}

#[test]
fn a_directory_of_other_files_is_named_in_the_error() {
    let root = tempfile::tempdir().unwrap();
    for name in ["a.txt", "b.txt", "c.txt", "d.txt"] {
        fs::write(root.path().join(name), "x").unwrap();
    }
    let err = RunDir::claim(Some(root.path()), "", Resume::Fresh, Existing::Refuse).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("a.txt, b.txt, c.txt and 1 more"), "{msg}");
}

#[test]
fn overwrite_replaces_the_run_files_only() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("r");
    finished_run(&run);
    fs::write(run.join("notes.md"), "mine").unwrap();
    let dir = RunDir::claim(Some(&run), "", Resume::Fresh, Existing::Overwrite).unwrap();
    assert!(run.join("checkpoint").exists(), "claiming removes nothing");
    let mut metrics = dir.create("stages = 2\n", 0).unwrap();
    writeln!(metrics, "{{\"step\":0}}").unwrap();
    metrics.flush().unwrap();
    assert!(!run.join("checkpoint").exists());
    assert_eq!(fs::read_to_string(run.join("notes.md")).unwrap(), "mine");
    assert_eq!(
        fs::read_to_string(run.join(JOB_FILE)).unwrap(),
        "stages = 2\n"
    );
    assert_eq!(
        fs::read_to_string(run.join(METRICS_FILE)).unwrap(),
        "{\"step\":0}\n"
    );
}

/// A complete sharded checkpoint of `step` in run directory `run`.
fn save_step(run: &Path, step: u64) -> std::path::PathBuf {
    let layout = Layout {
        dp: 1,
        stage_rank: vec![0],
    };
    let dir = step_dir(run, step);
    test_model::save(&dir, step, &layout, "h");
    dir
}

/// Every path under `dir`, relative, sorted.
fn tree(dir: &Path) -> Vec<String> {
    let mut paths = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            paths.push(path.strip_prefix(dir).unwrap().display().to_string());
            if path.is_dir() {
                stack.push(path);
            }
        }
    }
    paths.sort();
    paths
}

#[test]
fn overwrite_keeps_the_users_files_inside_the_checkpoint_directories() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("r");
    finished_run(&run);
    save_step(&run, 2);
    fs::write(run.join("checkpoint/notes.md"), "mine").unwrap();
    fs::create_dir_all(run.join("checkpoints/best")).unwrap();
    fs::write(run.join("checkpoints/best/model.bin"), "mine").unwrap();
    fs::write(run.join("checkpoints/README"), "mine").unwrap();
    let dir = RunDir::claim(Some(&run), "", Resume::Fresh, Existing::Overwrite).unwrap();
    dir.create("stages = 2\n", 0).unwrap();
    assert_eq!(
        tree(&run),
        [
            "checkpoint",
            "checkpoint/notes.md",
            "checkpoints",
            "checkpoints/README",
            "checkpoints/best",
            "checkpoints/best/model.bin",
            JOB_FILE,
            METRICS_FILE,
        ]
    );
}

#[test]
fn overwrite_of_a_directory_that_holds_no_run_removes_none_of_its_files() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("r");
    // A user's directory whose folders carry the names of a run's.
    for file in [
        "checkpoint/model.safetensors",
        "checkpoint/checkpoint.json",
        "checkpoints/step-1/rank-00000.safetensors",
        "checkpoints/step-1/manifest.json",
    ] {
        fs::create_dir_all(run.join(file).parent().unwrap()).unwrap();
        fs::write(run.join(file), "mine").unwrap();
    }
    let before = tree(&run);
    let dir = RunDir::claim(Some(&run), "", Resume::Fresh, Existing::Overwrite).unwrap();
    dir.create("stages = 2\n", 0).unwrap();
    let mut expected = before;
    expected.extend([JOB_FILE.to_string(), METRICS_FILE.to_string()]);
    expected.sort();
    assert_eq!(tree(&run), expected);
}

#[test]
fn a_continued_run_removes_what_killed_checkpoint_writes_left() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("r");
    finished_run(&run);
    let two = save_step(&run, 2);
    fs::write(two.join(".manifest.json.tmp.999999999"), "{").unwrap();
    // Killed while writing step 3: a temporary shard and no manifest; step 4's directory
    // made and nothing in it.
    let three = step_dir(&run, 3);
    fs::create_dir_all(&three).unwrap();
    fs::write(three.join(".rank-00000.safetensors.tmp.999999999"), "x").unwrap();
    fs::create_dir_all(step_dir(&run, 4)).unwrap();
    fs::write(run.join("checkpoint/.model.safetensors.tmp.999999999"), "x").unwrap();
    let dir = RunDir::claim(Some(&run), "", Resume::From(&run), Existing::Refuse).unwrap();
    assert!(dir.continues());
    dir.create("stages = 2\n", 2).unwrap();
    assert_eq!(
        tree(&run),
        [
            "checkpoint",
            "checkpoint/checkpoint.json",
            "checkpoint/model.safetensors",
            "checkpoints",
            "checkpoints/step-00000002",
            "checkpoints/step-00000002/manifest.json",
            "checkpoints/step-00000002/rank-00000.safetensors",
            JOB_FILE,
            METRICS_FILE,
        ]
    );
}

#[test]
fn a_continued_run_keeps_the_steps_before_its_checkpoint_once() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("r");
    finished_run(&run);
    // Resumed from a checkpoint at step 2: step 2's line is written again by the new run.
    let dir = RunDir::claim(
        Some(&run),
        "",
        Resume::From(&run.join("checkpoint")),
        Existing::Refuse,
    )
    .unwrap();
    assert!(dir.continues());
    let mut metrics = dir.create("stages = 4\n", 2).unwrap();
    writeln!(metrics, "{{\"step\":2,\"loss\":0.5}}").unwrap();
    metrics.flush().unwrap();
    let text = fs::read_to_string(run.join(METRICS_FILE)).unwrap();
    let steps: Vec<u64> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, [0, 1, 2], "{text}");
    assert!(!run.join(format!("{METRICS_FILE}.partial")).exists());
}

#[test]
fn a_continued_run_with_a_broken_metrics_line_names_it() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("r");
    finished_run(&run);
    fs::write(run.join(METRICS_FILE), "{\"step\":0}\nnot json\n").unwrap();
    let dir = RunDir::claim(Some(&run), "", Resume::From(&run), Existing::Refuse).unwrap();
    let err = dir.create("", 1).unwrap_err().to_string();
    assert!(err.contains("line 2"), "{err}");
}

#[test]
fn fresh_default_names_never_collide() {
    let root = tempfile::tempdir().unwrap();
    let first = fresh_default(root.path(), "rl-", 0);
    assert_eq!(first, root.path().join("rl-19700101-000000"));
    fs::create_dir(&first).unwrap();
    let second = fresh_default(root.path(), "rl-", 0);
    assert_eq!(second, root.path().join("rl-19700101-000000-2"));
}

#[test]
fn utc_stamps() {
    assert_eq!(utc_stamp(0), "19700101-000000");
    assert_eq!(utc_stamp(951_782_400 + 3_661), "20000229-010101");
    assert_eq!(utc_stamp(1_767_225_599), "20251231-235959");
}
