//! `pipefill bench rollout` through the binary, on a target small enough for a second: its
//! JSON names the device it ran on and carries its figures; a device that cannot be used is
//! one error before any work.

use std::process::Output;

mod common;
use common::{clean, one_line_error, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// `bench rollout --json` on a tiny target kept in `run_dir`, with `extra` arguments.
fn bench_in(run_dir: &std::path::Path, extra: &[&str]) -> Output {
    let mut cmd = clean(EXE);
    cmd.args([
        "bench",
        "rollout",
        "--json",
        "--steps",
        "3",
        "--drafter-slices",
        "2",
    ])
    .args(["--requests", "16", "--drafter-requests", "16"])
    .args(["--reps", "1", "--stages", "2"])
    .arg("--run-dir")
    .arg(run_dir);
    for s in ["model.d_model=32", "model.heads=2", "model.layers=4"] {
        cmd.args(["--set", s]);
    }
    cmd.args(extra).output().unwrap()
}

/// [`bench_in`] a fresh directory.
fn bench(extra: &[&str]) -> Output {
    bench_in(tempfile::tempdir().unwrap().path(), extra)
}

#[test]
fn the_json_names_the_device_and_holds_every_mode_s_throughput() {
    let out = bench(&["--device", "cpu"]);
    assert!(out.status.success(), "{}", text(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {}", text(&out)));
    let device = json["device"].as_str().unwrap_or_default();
    assert!(device.starts_with("cpu"), "{json}");
    for field in [
        "plain_tokens_per_s",
        "fixed_tokens_per_s",
        "adaptive_tokens_per_s",
    ] {
        let v = json[field].as_f64().unwrap_or(f64::NAN);
        assert!(v > 0.0, "{field}: {json}");
    }
    // The progress lines went to stderr, the target's among them with its device.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("on {device}, trained 3 steps")),
        "{stderr}"
    );
}

/// The first run trains the target and the drafter and keeps them in its run directory;
/// a rerun loads both, and its figures check the engine against its step costs per bucket.
#[test]
fn a_rerun_loads_the_target_and_the_drafter_and_fits_the_step_costs() {
    let dir = tempfile::tempdir().unwrap();
    let first = bench_in(dir.path(), &[]);
    assert!(first.status.success(), "{}", text(&first));
    assert!(dir.path().join("job.toml").exists() && dir.path().join("checkpoint").is_dir());
    let again = bench_in(dir.path(), &[]);
    assert!(again.status.success(), "{}", text(&again));
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        stderr.contains(&format!("from {} at step 3", dir.path().display()))
            && stderr.contains("drafter: loaded from"),
        "{stderr}"
    );
    let json: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    let plain = json["buckets"]["plain"].as_array().unwrap();
    assert!(!plain.is_empty(), "{json}");
    for b in plain
        .iter()
        .chain(json["buckets"]["fixed"].as_array().unwrap())
    {
        assert!(b["measured"].as_f64().unwrap() > 0.0, "{b}");
        assert!(b["predicted"].as_f64().unwrap() > 0.0, "{b}");
    }
    let share = json["plain_tail_share"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&share), "{json}");
    // The drafter's agreement, on the measured batch it never trained on and on its rows.
    for which in ["held_out", "own_rows"] {
        let a = json["drafter_agreement"][which]
            .as_f64()
            .unwrap_or(f64::NAN);
        assert!((0.0..=1.0).contains(&a), "{which}: {json}");
    }
    // The own-rows figure was kept beside the drafter: the rerun prints the first run's
    // without rolling the drafter's batch out again.
    let first: serde_json::Value = serde_json::from_slice(&first.stdout).unwrap();
    let own = |j: &serde_json::Value| j["drafter_agreement"]["own_rows"].as_f64();
    assert_eq!(own(&json), own(&first), "{json}");
    let kept = std::fs::read_dir(dir.path()).unwrap().flatten();
    let names: Vec<String> = kept
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names
            .iter()
            .any(|n| n.starts_with("drafter-") && n.ends_with(".own")),
        "{names:?}"
    );
    // Read, not computed again: a kept figure no rollout gives comes back as it is.
    let own_file = names.iter().find(|n| n.ends_with(".own")).unwrap();
    std::fs::write(dir.path().join(own_file), "0.25\n").unwrap();
    let third = bench_in(dir.path(), &[]);
    assert!(third.status.success(), "{}", text(&third));
    let third: serde_json::Value = serde_json::from_slice(&third.stdout).unwrap();
    assert_eq!(own(&third), Some(0.25), "{third}");
}

/// A drafter batch of no prompts is one error naming the flag, before any training.
#[test]
fn no_drafter_requests_is_one_error_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = clean(EXE)
        .args(["bench", "rollout", "--drafter-requests", "0", "--run-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = one_line_error(&out);
    assert!(stderr.contains("--drafter-requests"), "{stderr}");
    assert!(!dir.path().join("job.toml").exists());
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_is_one_error_naming_the_device() {
    let stderr = common::one_line_error(&bench(&["--device", "cuda"]));
    assert!(
        stderr.starts_with("error: invalid `device`") && stderr.contains("--features cuda"),
        "{stderr}"
    );
}

/// `bench filler` runs the job with its filler and without, alternating, and reports the
/// medians; a job without a filler or without a pipeline is one error naming the setting.
#[test]
fn bench_filler_compares_the_job_with_and_without_its_filler() {
    let run = |extra: &[&str]| {
        let mut cmd = clean(env!("CARGO_BIN_EXE_pipefill"));
        cmd.args(["bench", "filler", "--steps", "3", "--rounds", "2", "--json"]);
        for s in [
            "model.d_model=16",
            "model.heads=2",
            "model.seq_len=32",
            "stages=2",
        ] {
            cmd.args(["--set", s]);
        }
        cmd.args(extra).output().unwrap()
    };
    let out = run(&[]);
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["rounds"], 2);
    assert_eq!(v["step_makespan_with"].as_array().unwrap().len(), 2);
    assert_eq!(v["step_makespan_without"].as_array().unwrap().len(), 2);
    assert!(v["step_inflation"].as_f64().unwrap().is_finite(), "{v}");
    let fill = v["bubble_fill_ratio"][0].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&fill), "{v}");
    let err = one_line_error(&run(&["--set", "filler=\"none\""]));
    assert!(err.contains("`filler`"), "{err}");
    let err = one_line_error(&run(&["--set", "schedule=\"none\""]));
    assert!(err.contains("`schedule`"), "{err}");
}
