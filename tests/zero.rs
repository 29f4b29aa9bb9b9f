//! ZeRO-1, the sharded optimizer (`optimizer.shard = true`) through the binary: with it,
//! dp = 2 replicas end with bitwise the parameters and optimizer moments of the unsharded
//! dp = 2 run (the ring's reduce-scatter is its all-reduce's first half, and both sum the
//! clipped gradient norm from the same segments), in one process and launched; its periodic
//! and final checkpoints are the unsharded run's, so a resume crosses between the two; and
//! the memory estimate counts the moments once among the replicas.

use std::path::Path;

use pipefill::config::JobConfig;
use pipefill::config::memory::{MOMENT_BYTES, MemoryEstimate, Workload};
use pipefill::model::checkpoint::Checkpoint;

mod common;
use common::{LAUNCHED_MODEL, assert_bitwise, clean, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// Two replicas of two ZB-H1 ranks on [`LAUNCHED_MODEL`] (clipped on every step, so the
/// gradient norm decides the update), checkpointing every 2 steps.
const JOB: &[&str] = &[
    "schedule=\"zb-h1\"",
    "stages=2",
    "dp=2",
    "filler=\"none\"",
    "train.eval_tasks=2",
    "checkpoint_every=2",
];
const SHARD: &str = "optimizer.shard=true";
const TIED: &str = "model.tie_embeddings=true";

/// The job's settings, then `extra`.
fn sets<'a>(extra: &'a [&'a str]) -> impl Iterator<Item = &'a str> {
    JOB.iter().chain(&LAUNCHED_MODEL).chain(extra).copied()
}

fn train_args(out: &Path, extra: &[&str]) -> Vec<String> {
    common::train_args(out, sets(extra))
}

/// Runs `train` in one process into `dir`; its final checkpoint.
fn train(dir: &Path, extra: &[&str], more: &[&str]) -> Checkpoint {
    let out = clean(EXE)
        .args(train_args(dir, extra))
        .args(more)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    Checkpoint::load(&dir.join("checkpoint")).unwrap()
}

/// Each step's loss and gradient norm, as bits.
fn log(dir: &Path) -> Vec<(u64, u64, u64)> {
    common::metrics_lines(dir)
        .iter()
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap().to_bits(),
                v["grad_norm"].as_f64().unwrap().to_bits(),
            )
        })
        .collect()
}

/// The files of the periodic checkpoint after `steps` steps whose names start with
/// `prefix`, each as its length and a 64-bit FNV-1a hash of its bytes.
fn periodic(dir: &Path, steps: u64, prefix: &str) -> Vec<(String, usize, u64)> {
    let step = dir.join(format!("checkpoints/step-{steps:08}"));
    let mut files: Vec<(String, usize, u64)> = std::fs::read_dir(&step)
        .unwrap_or_else(|e| panic!("{}: {e}", step.display()))
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| {
            let bytes = std::fs::read(e.path()).unwrap();
            let hash = bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
                (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
            });
            (
                e.file_name().to_string_lossy().into_owned(),
                bytes.len(),
                hash,
            )
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}: no {prefix}* files", step.display());
    files
}

#[test]
fn sharded_replicas_equal_unsharded_ones_bitwise_with_two_stages_and_one() {
    let dir = tempfile::tempdir().unwrap();
    // A tied embedding sums its copies after the replicas' sum: across the two stages'
    // ranks with 2 stages, on one rank with 1; with 3 replicas the sums' order matters.
    let cases: [&[&str]; 5] = [
        &["stages=2"],
        &["stages=1"],
        &["stages=2", TIED],
        &["stages=1", TIED],
        &["stages=2", TIED, "dp=3", "train.micro_batches=6"],
    ];
    for case in cases {
        let name = case.join(",");
        let plain = dir.path().join(format!("plain-{name}"));
        let sharded = dir.path().join(format!("sharded-{name}"));
        let a = train(&plain, case, &[]);
        let b = train(&sharded, &[case, &[SHARD]].concat(), &[]);
        assert_bitwise(&a, &b);
        assert_eq!(log(&plain), log(&sharded), "{name}: step logs differ");
        assert_eq!(log(&plain).len(), 3);
        // The periodic checkpoint gathers the replicas' moments into the same shards.
        assert_eq!(periodic(&plain, 2, ""), periodic(&sharded, 2, ""), "{name}");
    }
}

#[test]
fn launched_sharded_ranks_equal_the_in_process_sharded_run_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single");
    let one = train(&single, &[SHARD], &[]);
    let launched = dir.path().join("launched");
    let out = clean(EXE)
        .args(["launch", "-n", "4", "--"])
        .args(train_args(&launched, &[SHARD]))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_bitwise(
        &one,
        &Checkpoint::load(&launched.join("checkpoint")).unwrap(),
    );
    // A launched job saves replica 0's shards (ranks 0 and 1), an in-process one every
    // replica's: replica 0's are the same files.
    for rank in ["rank-00000", "rank-00001"] {
        assert_eq!(periodic(&single, 2, rank), periodic(&launched, 2, rank));
    }
}

#[test]
fn a_resume_crosses_between_sharded_and_unsharded_runs_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name);
    let four = ["train.steps=4"];
    let whole = train(&p("whole"), &four, &[]);
    let two = ["train.steps=2"];
    train(&p("sharded-2"), &[&two[..], &[SHARD]].concat(), &[]);
    train(&p("plain-2"), &two, &[]);
    // sharded → sharded, sharded → unsharded, unsharded → sharded.
    for (from, shard) in [("sharded-2", true), ("sharded-2", false), ("plain-2", true)] {
        let extra: Vec<&str> = four.iter().copied().chain(shard.then_some(SHARD)).collect();
        let to = p(&format!("{from}-then-{shard}"));
        let from = p(from);
        let resumed = train(&to, &extra, &["--resume", from.to_str().unwrap()]);
        assert_bitwise(&whole, &resumed);
    }
}

#[test]
fn the_memory_estimate_counts_the_moments_once_among_the_replicas() {
    let sets = |extra: &[&str]| -> Vec<String> { sets(extra).map(str::to_string).collect() };
    let live = |job: &JobConfig| {
        MemoryEstimate::of(job, Workload::Train)
            .unwrap()
            .parts
            .into_iter()
            .find(|p| p.what == "parameters, gradients and optimizer state")
            .unwrap()
            .bytes
    };
    for dp in [2u64, 4] {
        let dp_set = format!("dp={dp}");
        let plain = JobConfig::embedded(&sets(&[&dp_set])).unwrap();
        let sharded = JobConfig::embedded(&sets(&[&dp_set, SHARD])).unwrap();
        let params = plain.model.param_count() as u64;
        // Each of the dp replicas keeps 1/dp of the moments: (dp − 1) copies fewer.
        assert_eq!(
            live(&plain) - live(&sharded),
            params * MOMENT_BYTES * (dp - 1),
            "dp={dp}"
        );
        assert!(
            MemoryEstimate::of(&sharded, Workload::Train).unwrap().total
                < MemoryEstimate::of(&plain, Workload::Train).unwrap().total
        );
    }
    // One replica: nothing to shard, the same estimate.
    let one = JobConfig::embedded(&sets(&["dp=1"])).unwrap();
    let one_sharded = JobConfig::embedded(&sets(&["dp=1", SHARD])).unwrap();
    assert_eq!(
        MemoryEstimate::of(&one, Workload::Train).unwrap(),
        MemoryEstimate::of(&one_sharded, Workload::Train).unwrap()
    );
}

#[test]
fn sharding_is_accepted_on_every_transport_and_a_no_op_for_one_replica() {
    let dir = tempfile::tempdir().unwrap();
    // CUDA ranks shard over NCCL as over TCP: no transport is refused.
    for transport in ["auto", "nccl", "tcp"] {
        let set = format!("transport=\"{transport}\"");
        let job =
            JobConfig::embedded(&["dp=2".into(), SHARD.into(), "device=\"cuda\"".into(), set]);
        assert!(job.is_ok(), "transport = {transport}: {:?}", job.err());
    }
    // dp = 1: the setting changes nothing.
    let a = train(&dir.path().join("a"), &["dp=1"], &[]);
    let b = train(&dir.path().join("b"), &["dp=1", SHARD], &[]);
    assert_bitwise(&a, &b);
}
