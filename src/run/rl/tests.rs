//! The RL runner through the library: what it shows and writes, and what it refuses
//! before any work.

use std::path::Path;

use super::rl;
use crate::config::JobConfig;
use crate::launch::RankEnv;
use crate::model::checkpoint::Checkpoint;
use crate::run::RunError;
use crate::run::show_tests::Recorded;
use crate::run::{Bar, Existing, Start};

/// A model and RL step small enough that a few steps take well under a second.
fn tiny(sets: &[&str], out: &Path) -> JobConfig {
    let mut all: Vec<String> = [
        "model.d_model=16",
        "model.heads=2",
        "model.layers=4",
        "model.seq_len=40",
        "stages=2",
        "data.max_size=3",
        "data.summary_tasks=20",
        "train.micro_batch_size=2",
        "rl.prompts=2",
        "rl.group=3",
        "rl.max_new_tokens=12",
        "rl.warmup_steps=3",
        "rl.steps=2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    all.extend(sets.iter().map(|s| s.to_string()));
    all.push(format!(
        "out_dir={}",
        toml::Value::String(out.display().to_string())
    ));
    JobConfig::embedded(&all).unwrap()
}

fn run(job: &JobConfig, show: &mut Recorded) -> Result<Option<std::path::PathBuf>, RunError> {
    let env = RankEnv::single();
    let start = Start {
        env: &env,
        existing: Existing::overwrite(false),
        max_memory: None,
    };
    rl(job, None, &start, show)
}

#[test]
fn an_in_process_run_warms_up_ticks_rollouts_and_updates_and_writes_a_line_per_step() {
    let dir = tempfile::tempdir().unwrap();
    let mut shown = Recorded::default();
    let out = run(&tiny(&[], dir.path()), &mut shown).unwrap();
    assert_eq!(out.as_deref(), Some(dir.path()));
    assert_eq!(shown.of(Bar::WarmUp), [(1, 3), (2, 3), (3, 3)]);
    assert_eq!(shown.of(Bar::Rollout), [(1, 2), (2, 2)]);
    assert_eq!(shown.of(Bar::Update), [(1, 2), (2, 2)]);
    // Where no bar is drawn, each update is one line of the step's figures.
    let plain: Vec<_> = shown
        .ticks
        .iter()
        .filter(|t| t.0 == Bar::Update)
        .filter_map(|t| t.3.clone())
        .collect();
    assert_eq!(plain.len(), 2);
    assert!(plain[1].starts_with("step    2/2 reward"), "{}", plain[1]);
    assert!(shown.line("done: 2 RL steps").is_some(), "{shown:?}");
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");
    // Warm-up steps, then one optimizer step per RL step.
    let checkpoint = Checkpoint::load(&dir.path().join("checkpoint")).unwrap();
    assert_eq!(checkpoint.meta.step, 5);
}

#[test]
fn a_run_that_cannot_start_is_refused_before_its_directory_is_looked_at() {
    let dir = tempfile::tempdir().unwrap();
    // A directory holding another run: had the runner claimed it first, that would be the
    // error.
    std::fs::write(dir.path().join("job.toml"), "# another run").unwrap();
    for (sets, what) in [
        (&["schedule=\"none\""][..], "schedule \"none\""),
        (&["rl.warmup_steps=0"][..], "rl.warmup_steps is 0"),
    ] {
        let mut shown = Recorded::default();
        let err = run(&tiny(sets, dir.path()), &mut shown).unwrap_err();
        assert!(err.to_string().starts_with(what), "{err}");
        assert!(shown.ticks.is_empty(), "{shown:?}");
        assert!(shown.line("model:").is_none(), "{shown:?}");
    }
    let kept = std::fs::read_to_string(dir.path().join("job.toml")).unwrap();
    assert_eq!(kept, "# another run");
}

#[test]
fn a_drafter_that_cannot_train_on_the_model_is_refused_at_start_only_when_rl_speculates() {
    let dir = tempfile::tempdir().unwrap();
    // Exact unrolled steps need plain attention; rope is not. The job fills no bubbles, so
    // only the rollouts' drafter would meet it.
    let sets = [
        "filler=\"none\"",
        "model.positions=\"rope\"",
        "drafter.unroll=2",
        "drafter.unroll_context=\"exact\"",
    ];
    let speculative = dir.path().join("speculative");
    let job = tiny(
        &[&sets[..], &["rl.speculation=true"]].concat(),
        &speculative,
    );
    let mut shown = Recorded::default();
    let err = run(&job, &mut shown).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("invalid `drafter.unroll_context`"),
        "{err}"
    );
    assert!(shown.ticks.is_empty(), "{shown:?}");
    assert!(!speculative.exists());
    // Without speculation no drafter trains: the same job runs.
    let plain = dir.path().join("plain");
    let job = tiny(&[&sets[..], &["rl.speculation=false"]].concat(), &plain);
    run(&job, &mut Recorded::default()).unwrap();
    assert!(plain.join("checkpoint").is_dir());
}
