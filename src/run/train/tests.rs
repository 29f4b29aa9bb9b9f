//! The training runner through the library, as the CLI calls it: what it shows, what it
//! writes, and what it refuses before any work.

use std::path::Path;

use super::train;
use crate::config::JobConfig;
use crate::launch::RankEnv;
use crate::model::checkpoint::Checkpoint;
use crate::run::RunError;
use crate::run::show_tests::Recorded;
use crate::run::{Bar, Existing, Start};

/// A job small enough that a few steps of any path take well under a second.
fn tiny(schedule: &str, steps: u64, out: &Path) -> JobConfig {
    let sets = [
        "model.d_model=16".to_string(),
        "model.heads=2".into(),
        "model.layers=4".into(),
        "model.seq_len=32".into(),
        "train.micro_batch_size=2".into(),
        "train.eval_tasks=2".into(),
        "data.summary_tasks=20".into(),
        "filler=\"none\"".into(),
        format!("train.steps={steps}"),
        format!("schedule=\"{schedule}\""),
        format!("out_dir={}", toml::Value::String(out.display().to_string())),
    ];
    JobConfig::embedded(&sets).unwrap()
}

fn run(job: &JobConfig, resume: Option<&Path>, show: &mut Recorded) -> Result<(), RunError> {
    let env = RankEnv::single();
    let start = Start {
        env: &env,
        existing: Existing::overwrite(false),
        max_memory: None,
    };
    train(job, resume, &start, show).map(|_| ())
}

#[test]
fn every_path_in_one_process_ticks_each_step_and_writes_one_metrics_line_per_step() {
    let dir = tempfile::tempdir().unwrap();
    for schedule in ["none", "1f1b"] {
        let out = dir.path().join(schedule);
        let job = tiny(schedule, 3, &out);
        let mut shown = Recorded::default();
        run(&job, None, &mut shown).unwrap();
        assert_eq!(shown.of(Bar::Step), [(1, 3), (2, 3), (3, 3)], "{schedule}");
        assert_eq!(shown.finished, [(Bar::Step, true)], "{schedule}");
        // Few steps: every one is worth a plain line.
        assert!(shown.ticks.iter().all(|t| t.3.is_some()), "{schedule}");
        let done = shown
            .line("done: 3 steps")
            .unwrap_or_else(|| panic!("{shown:?}"));
        assert!(done.contains(&out.display().to_string()), "{done}");
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.lines().count(), 3, "{schedule}: {metrics}");
        assert_eq!(
            Checkpoint::load(&out.join("checkpoint")).unwrap().meta.step,
            3
        );
    }
}

#[test]
fn a_run_directory_holding_a_run_is_refused_before_any_step() {
    let dir = tempfile::tempdir().unwrap();
    let job = tiny("none", 2, dir.path());
    run(&job, None, &mut Recorded::default()).unwrap();
    let before = std::fs::read(dir.path().join("metrics.jsonl")).unwrap();
    let mut shown = Recorded::default();
    let err = run(&job, None, &mut shown).unwrap_err();
    assert!(matches!(err, RunError::NotEmpty { .. }), "{err}");
    assert!(shown.ticks.is_empty(), "{shown:?}");
    // Nothing but the memory estimate: no data loaded, no model built.
    assert!(
        shown.lines.iter().all(|l| l.starts_with("memory:")),
        "{shown:?}"
    );
    assert_eq!(
        std::fs::read(dir.path().join("metrics.jsonl")).unwrap(),
        before
    );
}

#[test]
fn resuming_a_finished_run_has_nothing_to_do_and_resuming_further_continues_it() {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first");
    run(&tiny("1f1b", 2, &first), None, &mut Recorded::default()).unwrap();
    let err = run(
        &tiny("1f1b", 2, &first),
        Some(&first),
        &mut Recorded::default(),
    )
    .unwrap_err();
    assert!(matches!(err, RunError::NothingToDo { .. }), "{err}");
    let mut shown = Recorded::default();
    run(&tiny("1f1b", 4, &first), Some(&first), &mut shown).unwrap();
    assert_eq!(shown.of(Bar::Step), [(3, 4), (4, 4)]);
    assert!(shown.line("resuming from").is_some(), "{shown:?}");
    let metrics = std::fs::read_to_string(first.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 4, "{metrics}");
}

#[test]
fn a_reference_run_refuses_a_sharded_checkpoint_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let piped = dir.path().join("piped");
    let mut job = tiny("1f1b", 2, &piped);
    job.checkpoint_every = 1;
    run(&job, None, &mut Recorded::default()).unwrap();
    let sharded = piped.join("checkpoints").join(format!("step-{:08}", 2));
    assert!(
        sharded.is_dir(),
        "no sharded checkpoint at {}",
        sharded.display()
    );
    let reference = tiny("none", 3, &dir.path().join("reference"));
    let err = run(&reference, Some(&sharded), &mut Recorded::default()).unwrap_err();
    assert!(
        matches!(&err, RunError::ShardedForReference { dir } if dir == &sharded),
        "{err}"
    );
}

#[test]
fn dp_above_one_for_the_reference_trainer_is_refused_with_the_launch_to_use() {
    let dir = tempfile::tempdir().unwrap();
    let mut job = tiny("none", 2, dir.path());
    job.dp = 2;
    let mut shown = Recorded::default();
    let err = run(&job, None, &mut shown).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("with schedule = \"none\" trains one model")
            && text.contains(&format!("pipefill launch -n {} -- train", 2 * job.stages)),
        "{err}"
    );
    assert!(shown.lines.is_empty(), "{shown:?}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
