//! A checkpoint that cannot be written (issue 34, item 4): the run stops at once, in one
//! line naming the file and the last complete checkpoint, and leaves no empty or
//! incomplete `step-N` directory behind. Two faults: a file where a step's directory must
//! go (everywhere), and a full disk (a small tmpfs; skipped, saying why, where this
//! process may not mount one).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;
use common::{TINY_PIPELINE, clean, one_line_error, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// The tiny pipeline, checkpointing every step and keeping every checkpoint.
fn job() -> impl Iterator<Item = &'static str> {
    TINY_PIPELINE
        .into_iter()
        .chain(["checkpoint_every=1", "checkpoint_keep=0"])
}

/// `pipefill train --steps <steps> --out-dir <run> <args> --set job()...`.
fn train(run: &Path, steps: u32, args: &[&str]) -> Output {
    let mut cmd = clean(EXE);
    cmd.args(["train", "--steps", &steps.to_string(), "--out-dir"]);
    cmd.arg(run).args(args);
    for s in job() {
        cmd.args(["--set", s]);
    }
    cmd.output().unwrap()
}

/// The `step-N` directories of `run`, sorted.
fn step_dirs(run: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(run.join("checkpoints"))
        .map(|entries| entries.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    dirs.retain(|d| d.is_dir());
    dirs.sort();
    dirs
}

fn metrics_lines(run: &Path) -> usize {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

#[test]
fn a_checkpoint_that_cannot_be_written_stops_the_run_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    // A file of the user's where the checkpoint of step 3 must go.
    let blocked = run.join("checkpoints").join("step-00000003");
    std::fs::create_dir_all(blocked.parent().unwrap()).unwrap();
    std::fs::write(&blocked, "mine").unwrap();
    let out = train(&run, 12, &["--overwrite"]);
    let err = one_line_error(&out);
    let last = run.join("checkpoints").join("step-00000002");
    assert!(
        err.contains("cannot write the checkpoint of step 3")
            && err.contains(&blocked.display().to_string())
            && err.contains(&format!(
                "its last complete checkpoint is {}",
                last.display()
            )),
        "{err}"
    );
    // Stopped within a step of the failure: no checkpoint after it was started, and the
    // metrics end there.
    assert_eq!(
        step_dirs(&run),
        [run.join("checkpoints/step-00000001"), last]
    );
    let lines = metrics_lines(&run);
    assert!((3..=4).contains(&lines), "{lines} metrics lines");
    assert_eq!(std::fs::read_to_string(&blocked).unwrap(), "mine");
}

/// Launched, the same: the ranks' shard writers fail at step 3, every rank stops within a
/// step, each naming the file and the last complete checkpoint; the user's file stays.
#[test]
fn a_launched_run_stops_at_the_checkpoint_that_cannot_be_written() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let blocked = run.join("checkpoints").join("step-00000003");
    std::fs::create_dir_all(blocked.parent().unwrap()).unwrap();
    std::fs::write(&blocked, "mine").unwrap();
    let mut cmd = clean(EXE);
    cmd.args([
        "launch",
        "-n",
        "2",
        "--",
        "train",
        "--steps",
        "12",
        "--overwrite",
    ]);
    cmd.arg("--out-dir").arg(&run);
    for s in job() {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = run.join("checkpoints").join("step-00000002");
    // The rank that reports first names what was complete when it looked: rank 0 writes
    // each manifest, so rank 1 may fail before step 2's is written and name step 1.
    let named = |step: &Path| {
        stderr.contains(&format!(
            "its last complete checkpoint is {}",
            step.display()
        ))
    };
    assert!(
        stderr.contains("cannot write the checkpoint of step 3")
            && (named(&last) || named(&run.join("checkpoints").join("step-00000001"))),
        "{stderr}"
    );
    assert_eq!(
        step_dirs(&run),
        [run.join("checkpoints/step-00000001"), last]
    );
    assert_eq!(std::fs::read_to_string(&blocked).unwrap(), "mine");
}

/// A tmpfs of `bytes` mounted at a fresh directory, unmounted when dropped.
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    /// The mount, or why there is none.
    fn mount(bytes: u64) -> Result<Tmpfs, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        match out.status.success() {
            true => Ok(Tmpfs(dir)),
            false => Err(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0.path()).output();
    }
}

#[test]
fn a_full_disk_stops_the_run_at_the_first_write_that_fails() {
    let disk = match Tmpfs::mount(768 << 10) {
        Ok(disk) => disk,
        Err(why) => {
            eprintln!("skipped: cannot mount a tmpfs here ({why})");
            return;
        }
    };
    let run = disk.0.path().join("run");
    let started = Instant::now();
    let out = train(&run, 200, &[]);
    let err = one_line_error(&out);
    assert!(started.elapsed() < Duration::from_secs(30), "{err}");
    assert!(
        err.contains("No space left on device") && err.contains("the run stopped"),
        "{err}"
    );
    // Every step directory left is a complete checkpoint, the last one the error names.
    let dirs = step_dirs(&run);
    assert!(!dirs.is_empty(), "{err}");
    for d in &dirs {
        assert!(
            d.join("manifest.json").is_file(),
            "{} is incomplete",
            d.display()
        );
    }
    let last = dirs.last().unwrap();
    if err.contains("cannot write the checkpoint") {
        assert!(
            err.contains(&format!(
                "its last complete checkpoint is {}",
                last.display()
            )),
            "{err}"
        );
    }
    // The run went no further than a step past its last complete checkpoint.
    let saved = dirs.len();
    let lines = metrics_lines(&run);
    assert!(
        lines <= saved + 2,
        "{lines} metrics lines, {saved} checkpoints"
    );
    // And it resumes from there once there is room.
    let resume = run.to_str().unwrap().to_string();
    for d in &dirs[..saved - 1] {
        std::fs::remove_dir_all(d).unwrap();
    }
    let out = train(&run, saved as u32 + 1, &["--resume", &resume]);
    assert!(out.status.success(), "{}", text(&out));
}

/// Item 11: what a run killed while writing a checkpoint leaves (temporary files, step
/// directories without a manifest, empty ones) is removed when the run is resumed in its
/// directory, which continues from its last complete checkpoint.
#[test]
fn a_resumed_run_removes_the_leftovers_of_killed_writes() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = train(&run, 3, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let step = |n: u32| run.join("checkpoints").join(format!("step-{n:08}"));
    // Killed while writing step 4: one shard and the other's temporary file, no manifest;
    // step 5's directory made and left empty; a temporary sidecar in checkpoint/.
    std::fs::create_dir_all(step(4)).unwrap();
    std::fs::copy(
        step(3).join("rank-00000.safetensors"),
        step(4).join("rank-00000.safetensors"),
    )
    .unwrap();
    std::fs::write(step(4).join(".rank-00001.safetensors.tmp.999999999"), "x").unwrap();
    std::fs::create_dir_all(step(5)).unwrap();
    std::fs::write(run.join("checkpoint/.checkpoint.json.tmp.999999999"), "{").unwrap();
    std::fs::write(run.join("checkpoints/notes.txt"), "mine").unwrap();
    let resume = run.to_str().unwrap().to_string();
    let out = train(&run, 6, &["--resume", &resume]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("at step 3"),
        "{}",
        text(&out)
    );
    // Steps 4 to 6 written again, each complete; nothing else of the killed writes left.
    for n in 4..=6 {
        assert!(step(n).join("manifest.json").is_file(), "step {n}");
        let names: Vec<String> = std::fs::read_dir(step(n))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
    }
    assert!(
        !run.join("checkpoint/.checkpoint.json.tmp.999999999")
            .exists()
    );
    assert_eq!(
        std::fs::read_to_string(run.join("checkpoints/notes.txt")).unwrap(),
        "mine"
    );
}
