//! `schedule = "auto"` in a multi-process job: every rank runs ZB-H1 for two steps, measures
//! its stage, and the ranks all-gather their costs and switch to the same auto plan from the
//! third step on (src/launch/auto.rs). The launched run ends with exactly the parameters and
//! optimizer moments of the in-process auto run (which re-plans from its own measured
//! costs): every auto plan keeps each stage's micro-batch order, so both sum their gradients
//! in the reference trainer's order. That a slower stage gives a plan other than ZB-H1 is
//! tested on threads (src/launch/auto_tests.rs): the job file has no per-stage slowdown.

use std::path::Path;
use std::process::Output;

use pipefill::model::checkpoint::Checkpoint;

mod common;
use common::{assert_bitwise, clean, text};

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
fn launched_auto_ranks_switch_to_one_plan_and_equal_the_in_process_run() {
    let dir = tempfile::tempdir().unwrap();
    let (single, multi) = (dir.path().join("single"), dir.path().join("multi"));
    let out = train(&[], &single);
    assert!(out.status.success(), "{}", text(&out));
    let out = train(&["launch", "-n", "4", "--"], &multi);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_one_plan_of_the_measured_costs(&stdout, 4);

    let a = Checkpoint::load(&single.join("checkpoint")).unwrap();
    let b = Checkpoint::load(&multi.join("checkpoint")).unwrap();
    assert_eq!(a.meta.step, 3);
    assert_bitwise(&a, &b);
    let report = std::fs::read_to_string(multi.join("report.txt")).unwrap();
    assert!(report.contains("schedule auto"), "{report}");
}

/// One rank's line: `[rank r] schedule auto: from step 3 the auto plan HASH of the measured
/// costs; stage s measured F f I i W w`: the plan's digest, the stage and its costs.
fn choice_of(stdout: &str, rank: usize) -> (String, usize, [f64; 3]) {
    let prefix = format!("[rank {rank}] schedule auto: from step 3 the auto plan ");
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no auto plan line of rank {rank}:\n{stdout}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    // HASH of the measured costs; stage S measured F f I i W w
    let number = |i: usize| words[i].parse::<f64>().unwrap();
    (
        words[0].to_string(),
        words[6].parse().unwrap(),
        [number(9), number(11), number(13)],
    )
}

/// Every rank names the same plan, and the costs rank 0 reports as gathered are, stage by
/// stage, bitwise what that stage's rank measured (`{:?}` prints an f64 exactly).
fn assert_one_plan_of_the_measured_costs(stdout: &str, ranks: usize) {
    let choices: Vec<_> = (0..ranks).map(|r| choice_of(stdout, r)).collect();
    let gathered: Vec<[f64; 3]> = stdout
        .lines()
        .find_map(|l| l.strip_prefix("[rank 0] schedule auto: gathered costs (F, I, W by stage): "))
        .unwrap_or_else(|| panic!("no gathered costs:\n{stdout}"))
        .trim_matches(['[', ']'])
        .split("], [")
        .map(|stage| {
            let v: Vec<f64> = stage.split(", ").map(|x| x.parse().unwrap()).collect();
            [v[0], v[1], v[2]]
        })
        .collect();
    assert_eq!(gathered.len(), ranks, "{gathered:?}");
    for (rank, (hash, stage, measured)) in choices.iter().enumerate() {
        assert_eq!(
            hash, &choices[0].0,
            "rank {rank}'s plan differs from rank 0's"
        );
        assert_eq!(*stage, rank);
        assert!(measured.iter().all(|&c| c > 0.0), "{measured:?}");
        assert_eq!(
            gathered[rank].map(f64::to_bits),
            measured.map(f64::to_bits),
            "stage {rank}"
        );
    }
}
