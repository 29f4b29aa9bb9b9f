//! `pipefill train` as the pipelined main job and `pipefill profile RUN_DIR`, through the
//! binary: the run directory's files, the bubble report, the trace, and the errors a user
//! meets. A tiny model (set with `--set`) keeps each run to a second or two.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use pipefill::config::JobConfig;
use pipefill::model::checkpoint::Checkpoint;
use pipefill::pipeline::PipelineTrainer;
use serde_json::Value;

mod common;
use common::{clean, one_line_error, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// A model small enough that a few pipelined steps take about a second.
const TINY: &[&str] = &[
    "model.d_model=16",
    "model.heads=2",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.eval_tasks=2",
    "data.summary_tasks=50",
];

fn train(args: &[&str], out: &Path) -> Output {
    let mut cmd = clean(EXE);
    cmd.arg("train").args(args);
    for s in TINY {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out-dir").arg(out).output().unwrap()
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

#[test]
fn a_pipelined_run_writes_its_run_directory_and_profile_reprints_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    // The default job's schedule (zb-h1) on 2 ranks of one block each.
    let out = train(
        &[
            "--steps",
            "4",
            "--set",
            "stages=2",
            "--set",
            "model.layers=2",
        ],
        &run,
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("schedule zb-h1 on 2 ranks"), "{stdout}");
    assert!(stdout.contains("done: 4 steps"), "{stdout}");
    assert!(stdout.contains("bubble report: schedule zb-h1"), "{stdout}");
    // The job runs once: step inflation is each step replayed without its fillers, not a
    // second run of the job with filler = "none" (that comparison is `bench filler`'s).
    assert!(!stdout.contains("filler = \"none\""), "{stdout}");
    assert!(stdout.contains("step inflation"), "{stdout}");
    assert!(
        stdout.contains("replayed with the same measured"),
        "{stdout}"
    );
    // A 4-step run's summary compares its first step with its last.
    assert!(stdout.contains("(mean of first/last 1 steps)"), "{stdout}");

    for f in [
        "job.toml",
        "metrics.jsonl",
        "report.txt",
        "report.json",
        "trace.json",
        "timeline.svg",
    ] {
        assert!(run.join(f).is_file(), "{f} missing");
    }
    assert_eq!(
        Checkpoint::load(&run.join("checkpoint")).unwrap().meta.step,
        4
    );

    // metrics.jsonl: one line per step with the loss, throughput and bubble ratios.
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let lines: Vec<Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"].as_u64(), Some(i as u64));
        assert!(l["loss"].as_f64().unwrap().is_finite());
        assert!(l["tokens_per_second"].as_f64().unwrap() > 0.0);
        for key in ["bubble_ratio", "steady_bubble_ratio"] {
            let r = l[key].as_f64().unwrap_or_else(|| panic!("{key}: {l}"));
            assert!((0.0..1.0).contains(&r), "{key} = {r}");
        }
    }

    // report.json: the documented fields, consistent with each other.
    let report = read_json(&run.join("report.json"));
    for key in [
        "bubble_ratio",
        "steady_bubble_ratio",
        "predicted_bubble_ratio",
        "predicted_steady_bubble_ratio",
        "makespan",
        "predicted_makespan",
    ] {
        let x = report[key].as_f64().unwrap_or_else(|| panic!("{key}"));
        assert!(x.is_finite() && x >= 0.0, "{key} = {x}");
    }
    assert_eq!(report["schedule"], "zb-h1");
    assert_eq!(report["clock"], "virtual");
    assert_eq!(report["stages"], 2);
    assert_eq!(report["microbatches"], 4);
    assert_eq!(report["steps"], 4);
    assert_eq!(report["units"], "s");
    let ranks = report["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    let makespan = report["makespan"].as_f64().unwrap();
    for r in ranks {
        let (busy, bubble) = (r["busy"].as_f64().unwrap(), r["bubble"].as_f64().unwrap());
        assert!(busy > 0.0);
        assert!(
            (busy + bubble - makespan).abs() < 1e-9 * makespan.max(1.0),
            "{r}"
        );
        assert!((r["bubble_ratio"].as_f64().unwrap() - bubble / makespan).abs() < 1e-9);
        assert!(r["predicted_bubble_ratio"].as_f64().is_some());
    }

    // trace.json: one process per rank, named compute actions, lanes that never overlap.
    let trace = read_json(&run.join("trace.json"));
    let events = trace["traceEvents"].as_array().unwrap();
    // In whole nanoseconds, the grid the writer snaps to (ts + dur in f64 µs may round up).
    let mut lanes: BTreeMap<(u64, u64), Vec<(i64, i64)>> = BTreeMap::new();
    let mut names = Vec::new();
    for e in events.iter().filter(|e| e["ph"] == "X") {
        let key = (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap());
        let ns = |k: &str| (e[k].as_f64().unwrap() * 1e3).round() as i64;
        lanes
            .entry(key)
            .or_default()
            .push((ns("ts"), ns("ts") + ns("dur")));
        if key.1 == 0 {
            names.push(e["name"].as_str().unwrap().to_string());
        }
    }
    let pids: Vec<u64> = lanes.keys().map(|k| k.0).collect();
    assert!(pids.contains(&0) && pids.contains(&1), "{pids:?}");
    // zb-h1 splits the backward: 4 steps × 2 stages × 4 micro-batches of each of F, I, W.
    for kind in ["F", "I", "W"] {
        let n = names
            .iter()
            .filter(|n| n.len() == 3 && &n[1..2] == kind)
            .count();
        assert_eq!(n, 32, "{kind}: {names:?}");
    }
    assert!(names.contains(&"1I3".to_string()), "{names:?}");
    assert!(lanes.keys().any(|k| k.1 == 1), "no bubble lane");
    for (key, mut spans) in lanes {
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "overlap in lane {key:?}: {w:?}");
        }
    }

    let svg = std::fs::read_to_string(run.join("timeline.svg")).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("zb-h1"),
        "{svg:.200}"
    );

    // `pipefill profile` prints report.txt again, byte for byte.
    let out = Command::new(EXE).arg("profile").arg(&run).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let report_txt = std::fs::read_to_string(run.join("report.txt")).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), report_txt);
    assert!(report_txt.contains("timeline: step "), "{report_txt}");

    // A damaged report.json is a clear error, not a panic.
    std::fs::write(run.join("report.json"), "{\"schedule\": ").unwrap();
    let out = Command::new(EXE).arg("profile").arg(&run).output().unwrap();
    let err = one_line_error(&out);
    assert!(
        err.contains("report.json is not a valid bubble report"),
        "{err}"
    );
}

#[test]
fn a_custom_schedule_file_runs_under_the_wall_clock() {
    let dir = tempfile::tempdir().unwrap();
    let out = train(
        &[
            "--schedule",
            "examples/schedules/zb1p_2x2.toml",
            "--clock",
            "wall",
            "--steps",
            "2",
            "--set",
            "stages=2",
            "--set",
            "model.layers=4",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    let report = read_json(&dir.path().join("report.json"));
    assert_eq!(report["schedule"], "examples/schedules/zb1p_2x2.toml");
    assert_eq!(report["clock"], "wall");
    assert_eq!(report["stages"], 4);
    assert_eq!(report["ranks"].as_array().unwrap().len(), 2);
    // Two stages per rank: trace names carry the stage, and both of rank 0's appear.
    let trace = read_json(&dir.path().join("trace.json"));
    let names: Vec<&str> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == 0 && e["tid"] == 0)
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"0F0") && names.contains(&"2W3"),
        "{names:?}"
    );
}

#[test]
fn a_pipelined_run_resumes_from_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let two_ranks = ["--set", "stages=2", "--set", "model.layers=2"];
    let out = train(&[&["--steps", "2"][..], &two_ranks].concat(), dir.path());
    assert!(out.status.success(), "{}", text(&out));
    let checkpoint = dir.path().join("checkpoint");
    let checkpoint = checkpoint.to_str().unwrap();
    let out = train(
        &[&["--steps", "5", "--resume", checkpoint][..], &two_ranks].concat(),
        dir.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("at step 2"));
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, [0, 1, 2, 3, 4]);
    let report = read_json(&dir.path().join("report.json"));
    assert_eq!(report["steps"], 5);
    // Steps 3 and 4 follow the resumed run's warm-up step 2.
    let step = report["iteration"].as_u64().unwrap();
    assert!((3..=4).contains(&step), "{step}");
    assert_eq!(report["whole_run"]["steps"], 3);
    assert_eq!(
        Checkpoint::load(&dir.path().join("checkpoint"))
            .unwrap()
            .meta
            .step,
        5
    );
}

#[test]
fn bad_input_is_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let err = one_line_error(&train(&["--schedule", "zb-h9"], dir.path()));
    assert!(
        err.contains("\"zb-h9\"") && err.contains("zb-h1") && err.contains("schedule file"),
        "{err}"
    );
    let err = one_line_error(&train(&["--set", "train.stepz=3"], dir.path()));
    assert!(err.contains("stepz"), "{err}");
    let err = one_line_error(&train(&["--set", "stages=many"], dir.path()));
    assert!(err.contains("stages"), "{err}");
    // 4 ranks need at least 4 blocks.
    let err = one_line_error(&train(&["--set", "model.layers=2"], dir.path()));
    assert!(err.contains("model.layers"), "{err}");

    let missing = dir.path().join("no-such-run");
    let out = Command::new(EXE)
        .arg("profile")
        .arg(&missing)
        .output()
        .unwrap();
    let err = one_line_error(&out);
    assert!(err.contains("no such run directory"), "{err}");
    let out = Command::new(EXE)
        .arg("profile")
        .arg(dir.path())
        .output()
        .unwrap();
    let err = one_line_error(&out);
    assert!(err.contains("report.json"), "{err}");
}

#[test]
fn every_example_config_loads_and_builds_its_plan() {
    let mut seen = 0;
    for entry in std::fs::read_dir("examples").unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let job = JobConfig::load(&path, &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let trainer =
            PipelineTrainer::from_job(&job).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(trainer.plan().num_ranks(), job.stages, "{}", path.display());
        seen += 1;
    }
    // default + one per built-in schedule + the custom-file, auto and two RL examples
    // (rl.toml, rl-longtail.toml).
    assert_eq!(seen, 12);
}

#[test]
fn the_default_job_is_zb_h1_on_four_ranks() {
    let job = JobConfig::embedded(&[]).unwrap();
    assert_eq!(job, JobConfig::default());
    assert_eq!(
        (job.schedule.to_string().as_str(), job.stages),
        ("zb-h1", 4)
    );
    let trainer = PipelineTrainer::from_job(&job).unwrap();
    assert_eq!(trainer.plan().num_ranks(), 4);
}
