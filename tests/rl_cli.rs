//! `pipefill rl` through the binary: a tiny GRPO run from a supervised warm-up and one
//! from a `pipefill train` run (`--init`), their run directories, and the errors a user
//! meets. A tiny model keeps each run to a few seconds.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

mod common;
use common::{metrics_lines, one_line_error, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// A model and RL step small enough that a few steps take a second or two.
const TINY: &[&str] = &[
    "model.d_model=16",
    "model.heads=2",
    "model.layers=4",
    "model.seq_len=40",
    "stages=2",
    "data.max_size=3",
    "data.summary_tasks=50",
    "train.micro_batch_size=2",
    "train.eval_tasks=2",
    "rl.prompts=2",
    "rl.group=3",
    "rl.max_new_tokens=12",
    "rl.warmup_steps=3",
];

fn pipefill(sub: &str, args: &[&str], out: &Path) -> Output {
    let mut cmd = Command::new(EXE);
    cmd.arg(sub);
    for s in TINY {
        cmd.args(["--set", s]);
    }
    // After TINY, so a test's own --set wins.
    cmd.args(args).arg("--out-dir").arg(out).output().unwrap()
}

/// metrics.jsonl's lines, each checked for every per-step field.
fn metrics(dir: &Path) -> Vec<Value> {
    let lines = metrics_lines(dir);
    for (i, m) in lines.iter().enumerate() {
        for field in [
            "reward",
            "rollout_share",
            "live_batch",
            "acceptance_length",
            "chosen_k",
            "drafter_agreement",
            "tokens_per_s",
            "tokens_per_s_sd",
            "tokens_per_s_plain",
            "grad_norm",
            "bubble_ratio",
        ] {
            assert!(m.get(field).is_some(), "line {i} lacks {field}: {m}");
        }
        assert_eq!(m["step"], i as u64);
        assert_eq!(m["sequences"], 6);
        let reward = m["reward"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&reward), "{m}");
        let share = m["rollout_share"].as_f64().unwrap();
        assert!(share > 0.0 && share < 1.0, "{m}");
        let live: Vec<u64> = serde_json::from_value(m["live_batch"].clone()).unwrap();
        assert!(live.windows(2).all(|w| w[0] >= w[1]), "{m}");
        assert_eq!(live.last(), Some(&0), "{m}");
        assert!(m["tokens_per_s"].as_f64().unwrap() > 0.0, "{m}");
        // The completions' lengths, and the share of the rollout their longest tenth ran
        // alone (this engine times its steps).
        let lens = &m["completion_lengths"];
        let (median, max) = (
            lens["median"].as_f64().unwrap(),
            lens["max"].as_u64().unwrap(),
        );
        assert!(median >= 1.0 && median <= max as f64 && max <= 12, "{m}");
        let tail = m["tail_share"].as_f64().unwrap();
        assert!((0.0..1.0).contains(&tail), "{m}");
    }
    lines
}

#[test]
fn rl_from_a_warm_up_writes_metrics_and_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = pipefill("rl", &["--steps", "2"], dir.path());
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("warm-up: 3 supervised steps"), "{stdout}");
    assert!(stdout.contains("drafter: untrained"), "{stdout}");
    assert!(stdout.contains("done: 2 RL steps"), "{stdout}");
    assert_eq!(metrics(dir.path()).len(), 2);
    assert!(dir.path().join("checkpoint/checkpoint.json").is_file());
    assert!(dir.path().join("job.toml").is_file());
}

#[test]
fn rl_from_a_train_run_starts_at_its_checkpoint() {
    let train_dir = tempfile::tempdir().unwrap();
    let out = pipefill("train", &["--steps", "2"], train_dir.path());
    assert!(out.status.success(), "{}", text(&out));
    let dir = tempfile::tempdir().unwrap();
    let init = train_dir.path().to_str().unwrap();
    // A different model on the command line: --init's model wins, and says so.
    let out = pipefill(
        "rl",
        &["--init", init, "--steps", "1", "--set", "model.mlp_ratio=2"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("at step 2"), "{stdout}");
    assert!(stdout.contains("using its [model]"), "{stdout}");
    // The train run's drafter (filler = "drafter" by default) starts the rollouts' one.
    assert!(
        stdout.contains("drafter: the starting checkpoint's"),
        "{stdout}"
    );
    assert!(!stdout.contains("warm-up"), "{stdout}");
    assert_eq!(metrics(dir.path()).len(), 1);
}

#[test]
fn an_rl_run_keeps_the_drafter_that_followed_its_policy() {
    use pipefill::model::checkpoint::Checkpoint;
    let drafter_of = |dir: &Path| {
        Checkpoint::load(&dir.join("checkpoint"))
            .unwrap()
            .drafter
            .expect("the checkpoint keeps a drafter")
    };
    // From a warm-up (no drafter): the rollouts speculate (a fixed threshold: the calibrated
    // one finds that speculation cannot pay on a model this small), their drafter trains 16
    // slices a step after the rollout, and the run's checkpoint keeps it.
    let first = tempfile::tempdir().unwrap();
    let (after, fixed) = ("rl.advanced.drafter_work=\"after\"", "rl.spec_threshold=8");
    let spec = ["--set", after, "--set", fixed];
    let out = pipefill("rl", &[&["--steps", "2"], &spec[..]].concat(), first.path());
    assert!(out.status.success(), "{}", text(&out));
    let kept = drafter_of(first.path());
    assert_eq!(kept.optimizer.step, 2 * 16);
    assert!(!kept.buffer.current.is_empty() && !kept.held_out.current.is_empty());
    // A run from it starts from that drafter and keeps training it.
    let init = first.path().to_str().unwrap();
    let next = tempfile::tempdir().unwrap();
    let args = [&["--init", init, "--steps", "1"], &spec[..]].concat();
    let out = pipefill("rl", &args, next.path());
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("drafter: the starting checkpoint's"),
        "{stdout}"
    );
    assert_eq!(drafter_of(next.path()).optimizer.step, 3 * 16);
    // Without speculation nothing trains it: the checkpoint keeps --init's as it was.
    let plain = tempfile::tempdir().unwrap();
    let off = [
        "--init",
        init,
        "--steps",
        "1",
        "--set",
        "rl.speculation=false",
    ];
    let out = pipefill("rl", &off, plain.path());
    assert!(out.status.success(), "{}", text(&out));
    let carried = drafter_of(plain.path());
    assert_eq!(carried.weights, kept.weights);
    assert_eq!(carried.optimizer, kept.optimizer);
}

#[test]
fn rl_with_draft_trees_runs_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let out = pipefill(
        "rl",
        &[
            "--steps",
            "1",
            "--set",
            "rl.draft_tree.nodes=5",
            "--set",
            "rl.spec_threshold=6",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("draft trees of up to 5 nodes"), "{stdout}");
    let m = metrics(dir.path());
    assert!(m[0]["acceptance_length"].as_f64().is_some(), "{}", m[0]);
}

#[test]
fn rl_with_an_auto_threshold_calibrates_and_records_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = pipefill(
        "rl",
        &["--steps", "2", "--set", "rl.spec_threshold=\"auto\""],
        dir.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("calibrated on the policy"), "{stdout}");
    assert!(
        stdout.contains("K ∈ 0..=4 (0: plain)"),
        "the plain arm: {stdout}"
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("calibration ("))
        .unwrap_or_else(|| panic!("no calibration line: {stdout}"));
    assert!(line.contains("b=1 ") && line.contains("b=2 "), "{line}");
    let m = metrics(dir.path());
    // The costs measured, on the first line only.
    let costs = m[0]["calibration"]["costs"].as_array().unwrap();
    assert!(!costs.is_empty(), "{}", m[0]);
    for c in costs {
        for f in ["decode_ms", "verify_ms", "propose_ms"] {
            assert!(c[f].as_f64().unwrap() > 0.0, "{c}");
        }
    }
    assert!(m[1].get("calibration").is_none(), "{}", m[1]);
    let (first, second) = (&m[0]["spec_threshold"], &m[1]["spec_threshold"]);
    if line.contains("cannot pay") {
        // Speculation off for the run: nothing drafted, the drafter left alone.
        assert_eq!(first["source"], "cannot pay", "{first}");
        assert!(m[1]["acceptance_length"].is_null(), "{}", m[1]);
    } else {
        // The warm-up trained no drafter: no acceptance to start from, so the first
        // rollout does not speculate; its held-out rows measure one for the second.
        assert_eq!(first["source"], "no acceptance measured yet", "{first}");
        assert_eq!(first["threshold"], 0, "{first}");
        assert!(m[0]["acceptance_length"].is_null(), "{}", m[0]);
        assert_eq!(second["source"], "calibrated", "{second}");
        let alpha = second["alpha"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&alpha), "{second}");
    }
    // A fixed threshold is used as given.
    let dir = tempfile::tempdir().unwrap();
    let out = pipefill(
        "rl",
        &["--steps", "1", "--set", "rl.spec_threshold=5"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    let m = metrics(dir.path());
    assert_eq!(m[0]["spec_threshold"]["threshold"], 5, "{}", m[0]);
    assert_eq!(m[0]["spec_threshold"]["source"], "rl.spec_threshold");
    assert!(m[0].get("calibration").is_none(), "{}", m[0]);
}

#[test]
fn bad_rl_settings_are_one_line_errors_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let err = one_line_error(&pipefill("rl", &["--set", "rl.group=1"], dir.path()));
    assert!(
        err.contains("`rl.group`") && err.contains("at least 2"),
        "{err}"
    );
    let err = one_line_error(&pipefill("rl", &["--set", "rl.kl_coef=-0.1"], dir.path()));
    assert!(err.contains("`rl.kl_coef`"), "{err}");
    let err = one_line_error(&pipefill(
        "rl",
        &["--set", "rl.max_new_tokens=40"],
        dir.path(),
    ));
    assert!(err.contains("`rl.max_new_tokens`"), "{err}");
    let err = one_line_error(&pipefill(
        "rl",
        &["--set", "rl.spec_threshold=often"],
        dir.path(),
    ));
    assert!(
        err.contains("spec_threshold") && err.contains("\"auto\""),
        "{err}"
    );
    let err = one_line_error(&pipefill("rl", &["--set", "rl.bogus=1"], dir.path()));
    assert!(err.contains("bogus"), "{err}");
    let err = one_line_error(&pipefill(
        "rl",
        &["--set", "rl.draft_tree.width=0"],
        dir.path(),
    ));
    assert!(err.contains("`rl.draft_tree.width`"), "{err}");
    let missing = dir.path().join("no-such-run");
    let err = one_line_error(&pipefill(
        "rl",
        &["--init", missing.to_str().unwrap()],
        dir.path(),
    ));
    assert!(err.contains("no-such-run"), "{err}");
}
