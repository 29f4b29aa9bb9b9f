//! `pipefill schedule auto` through the built binary: the printed plan is valid within the
//! limit, the printed figures are the library's, `--json` is `simulate --json`'s object,
//! and a bad memory limit is one clear error line.

use std::process::{Command, Output};

use pipefill_schedules::{
    Action, CostModel, Placement, Plan, ValidateOptions, auto_plan, simulate, validate,
};
use serde_json::Value;

fn pipefill(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipefill"))
        .arg("schedule")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("the pipefill binary runs")
}

fn ok(args: &[&str]) -> String {
    let out = pipefill(args);
    assert!(
        out.status.success(),
        "pipefill schedule {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("stdout is UTF-8")
}

/// The error line of a failing `pipefill schedule ARGS` (exactly one, no panic).
fn error_line(args: &[&str]) -> String {
    let out = pipefill(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{args:?} succeeded");
    assert_ne!(out.status.code(), Some(101), "{args:?} panicked: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: not one line: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    lines[0].to_string()
}

const ARGS: [&str; 8] = [
    "auto",
    "-p",
    "4",
    "-m",
    "8",
    "--cost",
    "f=1,i=1.07,w=0.93,comm=0.05",
    "--memory-limit",
];

/// What the library finds for ARGS with memory limit `limit`.
fn library(limit: f64) -> (CostModel, pipefill_schedules::AutoPlan) {
    let cost = CostModel::uniform(1.0, 1.07, 0.93, 0.05);
    let found = auto_plan(&cost, 4, 8, 1, Placement::Contiguous, limit).unwrap();
    (cost, found)
}

#[test]
fn text_prints_a_valid_plan_and_the_figures_next_to_every_builtin() {
    let mut args = ARGS.to_vec();
    args.push("5");
    let out = ok(&args);
    // The plan, one `rank r:` line per rank, parses back into a plan valid within the limit.
    let mut plan = Plan::new(4, 4, 8, Placement::Contiguous);
    for (r, line) in out.lines().filter(|l| l.starts_with("rank ")).enumerate() {
        let actions = line.split_once(": ").expect("rank r: actions").1;
        plan.ranks[r] = actions
            .split_whitespace()
            .map(|a| Some(a.parse::<Action>().unwrap()))
            .collect();
    }
    let (cost, found) = library(5.0);
    let opts = ValidateOptions {
        cost: cost.clone(),
        memory_limit: Some(5.0),
    };
    validate(&plan, &opts).unwrap_or_else(|e| panic!("{e}\n{out}"));
    assert_eq!(plan, found.plan, "{out}");
    // The auto row carries the simulator's figures of that plan.
    let t = simulate(&plan, &cost).unwrap();
    let auto_row = out
        .lines()
        .find(|l| l.starts_with("auto "))
        .expect("auto row");
    let steady = format!("{:.4}", t.steady_bubble_ratio);
    let bubble = format!("{:.4}", t.bubble_ratio);
    assert!(
        auto_row.contains(&steady) && auto_row.contains(&bubble),
        "{auto_row}"
    );
    for name in [
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "looped-bfs",
        "zb-h1",
        "zb-h2",
        "zb-v",
    ] {
        assert!(
            out.lines().any(|l| l.starts_with(&format!("{name} "))),
            "no {name} row:\n{out}"
        );
    }
    // GPipe holds all 8 micro-batches: over the limit of 5, and said so.
    let gpipe = out.lines().find(|l| l.starts_with("gpipe ")).unwrap();
    assert!(gpipe.contains("over --memory-limit"), "{gpipe}");
}

#[test]
fn json_is_simulate_json_for_the_auto_plan() {
    let mut args = ARGS.to_vec();
    args.extend(["8", "--json"]);
    let v: Value = serde_json::from_str(&ok(&args)).unwrap();
    let (_, found) = library(8.0);
    assert_eq!(v["schedule"], "auto");
    assert_eq!(v["num_ranks"], 4);
    assert_eq!(v["microbatches"], 8);
    assert_eq!(v["placement"], "contiguous");
    let steady = v["steady_bubble_ratio"].as_f64().unwrap();
    assert!((steady - found.timeline.steady_bubble_ratio).abs() < 1e-12);
    assert_eq!(v["makespan"].as_f64().unwrap(), found.timeline.makespan);
    // Same keys as `schedule simulate --json`.
    let sim: Value = serde_json::from_str(&ok(&[
        "simulate",
        "zb-h1",
        "-p",
        "4",
        "-m",
        "8",
        "--cost",
        "f=1,i=1.07,w=0.93,comm=0.05",
        "--json",
    ]))
    .unwrap();
    let keys = |v: &Value| {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(keys(&v), keys(&sim));
    assert_eq!(keys(&v["ranks"][0]), keys(&sim["ranks"][0]));
}

#[test]
fn a_bad_memory_limit_is_one_error_line() {
    let mut args = ARGS.to_vec();
    args.push("0.5");
    let line = error_line(&args);
    assert!(line.contains("memory limit 0.5 is below 1"), "{line}");
    let line = error_line(&["auto", "-p", "4", "-m", "8", "--memory-limit=-1"]);
    assert!(line.contains("--memory-limit: -1"), "{line}");
    // With v = 2 each stage stashes half a rank's share (mb = 0.5 per chunk), so a
    // V-shaped rank needs 1 unit for one micro-batch.
    let line = error_line(&[
        "auto",
        "-p",
        "4",
        "-m",
        "8",
        "--chunks",
        "2",
        "--placement",
        "v-shape",
        "--memory-limit",
        "0.75",
    ]);
    assert!(line.contains("memory limit 0.75 is below 1"), "{line}");
}

/// A limit no plan meets without recomputation (below one forward's `mb` = 1): `--recompute
/// auto` finds one with it, within the limit, and says which; `none` is the plain error.
#[test]
fn recompute_auto_meets_a_limit_no_plain_plan_meets() {
    let mut args = ARGS.to_vec();
    args.push("0.9");
    let line = error_line(&args);
    assert!(line.contains("memory limit 0.9 is below 1"), "{line}");
    args.extend(["--recompute", "auto"]);
    let out = ok(&args);
    let recompute = out
        .lines()
        .find(|l| l.starts_with("recompute: "))
        .expect("a recompute line");
    assert!(recompute.starts_with("recompute: selective"), "{recompute}");
    let auto_row = out.lines().find(|l| l.starts_with("auto ")).unwrap();
    let peak: f64 = auto_row.split_whitespace().last().unwrap().parse().unwrap();
    assert!(peak <= 0.9, "{auto_row}");
    // Tighter than selective's share of mb: full.
    args[8] = "0.6";
    args.push("--json");
    let v: Value = serde_json::from_str(&ok(&args)).unwrap();
    assert_eq!(v["recompute"], "full");
    let peaks: Vec<f64> = (v["ranks"].as_array().unwrap().iter())
        .map(|r| r["peak_memory"].as_f64().unwrap())
        .collect();
    assert!(peaks.iter().all(|&p| p <= 0.6), "{peaks:?}");
}
