//! `checkpoint_keep = N`: a run that checkpoints every step keeps only its newest N complete
//! sharded checkpoints, in the in-process pipeline and in a launched job alike, and the
//! ones it keeps resume bit for bit. Files in `checkpoints/` that are not this run's
//! checkpoints stay.

use std::path::Path;
use std::process::Output;

use pipefill::config::JobConfig;
use pipefill::model::checkpoint::Checkpoint;
use pipefill::model::checkpoint::sharded::{
    CHECKPOINTS_DIR, Layout, MANIFEST_FILE, Manifest, load_sharded, step_dir,
};
use pipefill::pipeline::PipelineTrainer;

mod common;
use common::job::{one_replica_layout, sorted_bits, tiny_job};
use common::{clean, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// The names in `run/checkpoints/`, sorted.
fn listing(run: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(run.join(CHECKPOINTS_DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn keep_two(steps: u64) -> JobConfig {
    JobConfig {
        checkpoint_keep: 2,
        ..tiny_job(2, steps)
    }
}

#[test]
fn the_in_process_pipeline_keeps_the_newest_two_and_they_resume_bitwise() {
    let job = keep_two(5);
    let run_dir = tempfile::tempdir().unwrap();
    // Not this run's: stays.
    let others = run_dir.path().join(CHECKPOINTS_DIR);
    std::fs::create_dir_all(&others).unwrap();
    std::fs::write(others.join("notes.txt"), "mine").unwrap();
    let trainer = PipelineTrainer::from_job(&job).unwrap();
    let whole = trainer
        .clone()
        .checkpoint_every(1, run_dir.path())
        .run(5, |_| {})
        .unwrap();
    assert_eq!(
        listing(run_dir.path()),
        ["notes.txt", "step-00000004", "step-00000005"]
    );
    let (layout, hash) = (one_replica_layout(&trainer), job.fingerprint());
    let last = load_sharded(&step_dir(run_dir.path(), 5), &layout, &hash).unwrap();
    let end = sorted_bits(&whole.checkpoint().unwrap());
    assert!(
        sorted_bits(&last) == end,
        "step 5 is not the run's final state"
    );
    // The older kept one is complete too: one step from it ends where the run ended.
    let four = load_sharded(&step_dir(run_dir.path(), 4), &layout, &hash).unwrap();
    let rest = trainer.resume(&four).run(1, |_| {}).unwrap();
    assert!(sorted_bits(&rest.checkpoint().unwrap()) == end);

    // checkpoint_keep = 0 keeps every one.
    let all = tempfile::tempdir().unwrap();
    let job = JobConfig {
        checkpoint_keep: 0,
        ..tiny_job(2, 5)
    };
    PipelineTrainer::from_job(&job)
        .unwrap()
        .checkpoint_every(1, all.path())
        .run(5, |_| {})
        .unwrap();
    assert_eq!(listing(all.path()).len(), 5);
}

/// Two ranks of 1F1B, a checkpoint every step, the newest two kept.
const JOB: &[&str] = &[
    "schedule=\"1f1b\"",
    "stages=2",
    "filler=\"none\"",
    "checkpoint_every=1",
    "checkpoint_keep=2",
    "model.d_model=16",
    "model.heads=2",
    "model.layers=2",
    "model.seq_len=32",
    "train.micro_batches=4",
    "train.micro_batch_size=2",
    "train.eval_tasks=0",
    "data.summary_tasks=50",
];

/// `pipefill launch -n 2 -- train` of [`JOB`] for `steps` steps into `out`.
fn launch(steps: u64, out: &Path, resume: Option<&Path>) -> Output {
    train(true, steps, out, resume)
}

fn final_bits(run: &Path) -> common::job::TensorBits {
    sorted_bits(&Checkpoint::load(&run.join("checkpoint")).unwrap())
}

#[test]
fn a_launched_job_keeps_the_newest_two_and_resumes_from_them_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first");
    let out = launch(5, &first, None);
    assert_eq!(listing(&first), ["step-00000004", "step-00000005"]);
    for step in [4, 5] {
        let m = Manifest::read(&step_dir(&first, step)).unwrap();
        assert_eq!((m.step, m.shards.len()), (step, 2));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("sharded checkpoints: 2"), "{}", text(&out));
    let layout = Layout {
        dp: 1,
        stage_rank: vec![0, 1],
    };
    let hash = Manifest::read(&step_dir(&first, 5)).unwrap().config_hash;
    let five = load_sharded(&step_dir(&first, 5), &layout, &hash).unwrap();
    assert!(sorted_bits(&five) == final_bits(&first));

    // Seven uninterrupted steps; the same from the run directory's newest checkpoint.
    let whole = dir.path().join("whole");
    launch(7, &whole, None);
    let resumed = dir.path().join("resumed");
    launch(7, &resumed, Some(&first));
    assert!(final_bits(&resumed) == final_bits(&whole));
    assert_eq!(listing(&resumed), ["step-00000006", "step-00000007"]);
    // From the older kept one: step 5 of the first run.
    let from_four = dir.path().join("from-four");
    launch(5, &from_four, Some(&step_dir(&first, 4)));
    assert!(final_bits(&from_four) == final_bits(&first));
    assert!(step_dir(&first, 4).join(MANIFEST_FILE).is_file());
}

/// `pipefill [launch -n 2 --] train` of [`JOB`] for `steps` steps into `out`.
fn train(launched: bool, steps: u64, out: &Path, resume: Option<&Path>) -> Output {
    let mut cmd = clean(EXE);
    if launched {
        cmd.args(["launch", "-n", "2", "--"]);
    }
    cmd.arg("train");
    for s in JOB {
        cmd.args(["--set", s]);
    }
    cmd.args(["--set", &format!("train.steps={steps}")]);
    cmd.arg("--out-dir").arg(out);
    if let Some(r) = resume {
        cmd.arg("--resume").arg(r);
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    o
}

/// A run resumed into its own directory continues it: the newest two checkpoints across
/// both parts stay (the older part's were left, four of them after two resumes).
#[test]
fn resuming_into_the_same_directory_keeps_the_newest_two_of_the_whole_run() {
    for launched in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        train(launched, 3, &run, None);
        assert_eq!(listing(&run), ["step-00000002", "step-00000003"]);
        train(launched, 5, &run, Some(&run));
        assert_eq!(
            listing(&run),
            ["step-00000004", "step-00000005"],
            "launched: {launched}"
        );
        // Resumed from the older kept checkpoint (4): the continuation writes step 5 anew
        // and still keeps the newest two.
        train(launched, 7, &run, Some(&step_dir(&run, 4)));
        assert_eq!(
            listing(&run),
            ["step-00000006", "step-00000007"],
            "launched: {launched}"
        );
    }
}
