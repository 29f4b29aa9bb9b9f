//! The merged profile of a data-parallel multi-process job: `pipefill launch -n 4` with
//! dp = 2 replicas × 2 stages puts every replica's ranks in `trace.json` (one process per
//! mesh rank, named by replica and stage), in the timeline and in the report, which gives
//! each replica's figures next to the bubble ratio over all ranks.

use std::path::Path;

mod common;
use common::clean;

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

const JOB: &[&str] = &[
    "schedule=\"1f1b\"",
    "stages=2",
    "dp=2",
    "filler=\"none\"",
    "model.d_model=16",
    "model.heads=2",
    "model.layers=2",
    "model.seq_len=32",
    "train.micro_batches=4",
    "train.micro_batch_size=2",
    "train.steps=2",
    "train.eval_tasks=2",
    "data.summary_tasks=50",
];

/// `pipefill launch -n 4 -- train` of [`JOB`] into `out`, with no launcher variables
/// inherited from the test's environment.
fn launch(out: &Path) {
    let mut cmd = clean(EXE);
    cmd.args(["launch", "-n", "4", "--", "train"]);
    for s in JOB {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out-dir").arg(out);
    let run = cmd.output().unwrap();
    assert!(
        run.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}

#[test]
fn dp_trace_report_and_timeline_hold_every_replica() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    launch(&out);

    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    // Every mesh rank's compute: 2 steps × its replica's 2 of the 4 micro-batches × (F + B).
    for pid in 0..4u64 {
        let computed = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == pid && e["tid"] == 0)
            .count();
        assert_eq!(computed, 2 * 2 * 2, "compute events of pid {pid}");
    }
    assert!(
        events
            .iter()
            .all(|e| e["pid"].as_u64().is_none_or(|p| p < 4)),
        "a pid outside the 4 mesh ranks"
    );
    let mut names: Vec<(u64, String)> = events
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| {
            let name = e["args"]["name"].as_str().unwrap().to_string();
            (e["pid"].as_u64().unwrap(), name)
        })
        .collect();
    names.sort();
    let expected: Vec<(u64, String)> = [
        (0, "rank 0 · replica 0 stage 0"),
        (1, "rank 1 · replica 0 stage 1"),
        (2, "rank 2 · replica 1 stage 0"),
        (3, "rank 3 · replica 1 stage 1"),
    ]
    .iter()
    .map(|(p, n)| (*p, n.to_string()))
    .collect();
    assert_eq!(names, expected);

    let report = std::fs::read_to_string(out.join("report.txt")).unwrap();
    assert!(report.contains("on 4 ranks"), "{report}");
    for r in 0..2 {
        assert!(
            report.contains(&format!("replica {r} (ranks {}–{})", 2 * r, 2 * r + 1)),
            "{report}"
        );
    }
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["ranks"].as_array().unwrap().len(), 4);
    let ratio = json["bubble_ratio"].as_f64().unwrap();
    assert!(
        ratio > 0.0 && ratio < 1.0,
        "bubble ratio over all ranks {ratio}"
    );

    let svg = std::fs::read_to_string(out.join("timeline.svg")).unwrap();
    assert!(svg.contains("4 ranks = 2 replicas × 2"), "{svg}");
}
