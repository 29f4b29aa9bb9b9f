//! GRPO over processes through the binary: `pipefill launch -n 2 -- rl` (rank 0 the rollout
//! engine, the update pipelined over both processes, weights synced to rank 0 every step)
//! ends with exactly the policy and optimizer moments of the in-process `pipefill rl` of
//! the same job: the rollouts are the same samples (same policy, same sampling seeds) and
//! the pipelined update is bitwise the in-process one; with the KL term too (rank 0's
//! frozen reference gives the in-process log-probs); and from a `pipefill train` run that
//! trained a drafter in its bubbles (`--init`), whose drafter rank 0's rollouts start from,
//! as in-process. A tiny model on the parity task, warmed up until some rollouts are right,
//! so both steps have a gradient.
//!
//! With replicas (`launch -n 4`, dp = 2 × pp = 2) the rollouts are rank 0's, so every
//! step's rewards equal dp = 1's (`launch -n 2`), and the parameters equal dp = 1's within a
//! tolerance: dp = 2 sums each replica's half of the micro-batch gradients and then the
//! halves, where dp = 1 accumulates them one after the other, so the two differ by float
//! rounding (see tests/dp.rs). From the same policy (`--init` of a launched train run), 2
//! RL steps measured max |Δparam| 3.7e-9, relative L2 3.6e-10 (plain and KL alike; 1.5e-8
//! and 1.2e-9 from another start); stated tolerance [`INIT_TOLERANCE`], ~70× the larger,
//! small next to what a wrong share, scale or reference would move (the RL step moves each
//! parameter by up to lr = 3e-4). Warmed up over the
//! replicas (60 steps at lr 1e-2), the start itself differs: `launch -n 4 -- train` with
//! dp = 2 vs dp = 1 of the warm-up job measured max 4.3e-5, relative L2 2.4e-5 (the
//! parameters here after the 2 RL steps: the same figures, and the warmed-up dp = 1 run
//! equals launch train + `rl --init` bitwise); stated tolerance [`WARM_UP_TOLERANCE`], ~20×.
//!
//! Each rank keeps its update compute alive from step to step (the default, as in-process);
//! rebuilding it every step from host copies (`keep_update_ranks` off) gives the same bits,
//! with replicas and the KL term too: ranks on threads of the test over a loopback mesh.

use std::path::Path;
use std::process::Output;
use std::sync::Arc;

use pipefill::comm::tcp::{MeshOptions, TcpMesh};
use pipefill::config::JobConfig;
use pipefill::model::checkpoint::{ADAM_M_PREFIX, ADAM_V_PREFIX, Checkpoint, MASTER_PREFIX};
use pipefill::pipeline::Clock;
use pipefill::rl::launched::{RankOptions, RlLaunchRun, rl_rank_with};
use pipefill::rl::trainer::RlTrainer;
use pipefill::rl::trainer_spec::PipelineRollouts;

mod common;
use common::{assert_bitwise, clean, metrics_column, metrics_lines, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");
/// dp = 2 vs dp = 1 from the same policy: (max |Δparam|, relative L2 of the difference).
const INIT_TOLERANCE: (f32, f64) = (1e-6, 1e-7);
/// dp = 2 vs dp = 1 warmed up over the replicas (see the module docs).
const WARM_UP_TOLERANCE: (f32, f64) = (1e-3, 5e-4);

const TINY: &[&str] = &[
    "model.d_model=16",
    "model.heads=2",
    "model.layers=4",
    "model.seq_len=40",
    "stages=2",
    "filler=\"none\"",
    "data.families=[\"parity\"]",
    "data.max_size=2",
    "data.summary_tasks=50",
    "train.micro_batch_size=4",
    "train.lr=1e-2",
    "train.eval_tasks=2",
    "rl.prompts=8",
    "rl.group=4",
    "rl.max_new_tokens=4",
    "rl.warmup_steps=60",
    "rl.steps=2",
];

/// `pipefill PREFIX... rl` of [`TINY`] and `extra` into `out`, with no launcher variables
/// inherited from the test's environment.
fn pipefill(prefix: &[&str], extra: &[&str], out: &Path) -> Output {
    run(prefix, &["rl"], extra, out)
}

/// `pipefill PREFIX... ARGS...` of [`TINY`] and `extra` into `out`.
fn run(prefix: &[&str], args: &[&str], extra: &[&str], out: &Path) -> Output {
    let mut cmd = clean(EXE);
    cmd.args(prefix).args(args);
    for s in TINY.iter().chain(extra) {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out-dir").arg(out).output().unwrap()
}

/// A launched `rl` runs its update over TCP: asked for NCCL, every rank refuses before
/// joining, naming the setting.
#[test]
fn launched_rl_refuses_the_nccl_transport_it_would_not_use() {
    let dir = tempfile::tempdir().unwrap();
    let out = pipefill(
        &["launch", "-n", "2", "--"],
        &["transport=\"nccl\""],
        &dir.path().join("run"),
    );
    assert!(!out.status.success());
    let all = text(&out);
    assert!(
        all.contains("invalid `transport`") && all.contains("runs its update over TCP"),
        "{all}"
    );
    assert!(!dir.path().join("run").exists(), "{all}");
}

/// `dir`'s final checkpoint.
fn checkpoint(dir: &Path) -> Checkpoint {
    Checkpoint::load(&dir.join("checkpoint")).unwrap()
}

#[test]
fn launched_rl_over_two_processes_equals_the_in_process_run_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let (single, multi) = (dir.path().join("single"), dir.path().join("multi"));
    let out = pipefill(&[], &[], &single);
    assert!(out.status.success(), "{}", text(&out));
    let out = pipefill(&["launch", "-n", "2", "--"], &[], &multi);
    assert!(out.status.success(), "{}", text(&out));

    // The same rollouts were scored, and they carried a gradient (else only weight decay
    // would move the parameters).
    let rewards = metrics_column(&multi, "reward");
    assert_eq!(rewards, metrics_column(&single, "reward"));
    assert!(
        metrics_column(&multi, "grad_norm").iter().all(|&g| g > 0.0),
        "a step without a gradient: {}",
        text(&out)
    );

    // The rollout figures rank 0 now reports: the same tokens as in-process (lossless
    // decoding), and a live batch per rollout step (its shape, and whether the rollout
    // speculated, follow the costs each run measured, so they may differ); only the
    // launched run has a weight sync.
    let live: Vec<serde_json::Value> = metrics_lines(&multi)
        .iter()
        .map(|l| l["live_batch"].clone())
        .collect();
    assert!(
        live.iter()
            .all(|v| v.as_array().is_some_and(|a| !a.is_empty())),
        "{live:?}"
    );
    for field in ["generated_tokens", "tokens_per_s", "sequences"] {
        let (m, s) = (
            metrics_column(&multi, field),
            metrics_column(&single, field),
        );
        assert!(m.iter().all(|&x| x > 0.0), "{field}: {m:?}");
        if field != "tokens_per_s" {
            assert_eq!(m, s, "{field}");
        }
    }
    assert!(
        metrics_column(&multi, "sync_seconds")
            .iter()
            .all(|&s| s >= 0.0)
    );
    assert!(
        metrics_column(&single, "sync_seconds")
            .iter()
            .all(|s| s.is_nan())
    );

    // Both measure the update's bubbles (rank 0 merging every rank's spans).
    for run in [&single, &multi] {
        let bubbles = metrics_column(run, "bubble_ratio");
        assert!(
            bubbles.iter().all(|b| (0.0..1.0).contains(b)),
            "{bubbles:?}"
        );
    }

    let (a, b) = (checkpoint(&single), checkpoint(&multi));
    assert_eq!(a.meta.step, 60 + 2);
    assert_bitwise(&a, &b);
}

#[test]
fn launched_rl_with_the_kl_term_equals_the_in_process_run_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let (single, multi) = (dir.path().join("single"), dir.path().join("multi"));
    let kl = ["rl.kl_coef=0.5"];
    let out = pipefill(&[], &kl, &single);
    assert!(out.status.success(), "{}", text(&out));
    let out = pipefill(&["launch", "-n", "2", "--"], &kl, &multi);
    assert!(out.status.success(), "{}", text(&out));

    assert_eq!(
        metrics_column(&multi, "reward"),
        metrics_column(&single, "reward")
    );
    // Step 1 starts at the reference (KL 0); after one update the policy has moved, and the
    // last stage's head saw the reference's log-probs that rank 0 sent.
    let (kl_multi, kl_single) = (metrics_column(&multi, "kl"), metrics_column(&single, "kl"));
    assert_eq!(kl_multi[0], 0.0, "{}", text(&out));
    assert!(kl_multi[1] > 0.0, "{}", text(&out));
    for (m, s) in kl_multi.iter().zip(&kl_single) {
        assert!((m - s).abs() <= 1e-12 * s.abs().max(1e-30), "kl {m} vs {s}");
    }
    assert_bitwise(&checkpoint(&single), &checkpoint(&multi));
}

/// Rollouts that speculate at every live-batch size with one draft length (and no plain
/// K = 0 arm), so that they are a function of the policy and the drafter only: the bandit
/// rewards each K by measured time, so with several two runs may choose differently, and
/// drafter slices in the stages' idle time sample rows by timing (which would change step
/// 2's drafter). The seed gives both steps informative groups from the run below.
const SPECULATIVE: &[&str] = &[
    "rl.speculation=true",
    "rl.advanced.plain_arm=false",
    "rl.draft_k=1",
    "rl.spec_threshold=32",
    "rl.advanced.drafter_work=\"after\"",
    "rl.seed=4",
];

#[test]
fn launched_rl_starts_from_the_init_runs_drafter_and_equals_the_in_process_run_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    // The planned placement trains the same drafter in every run (tests/resume_fill.rs), so
    // the rollouts below are the same from run to run; filling leaves the target as it is
    // without, so `plain` is the same policy with no drafter.
    let (init, plain) = (dir.path().join("init"), dir.path().join("plain"));
    let sft = ["train.steps=60", "drafter.placement=\"planned\""];
    let filled = [&sft[..], &["filler=\"drafter\""]].concat();
    let out = run(&[], &["train"], &filled, &init);
    assert!(out.status.success(), "{}", text(&out));
    let out = run(&[], &["train"], &sft, &plain);
    assert!(out.status.success(), "{}", text(&out));
    let trained = checkpoint(&init).drafter.expect("the train run's drafter");
    assert!(trained.weights.version > 0, "the drafter never stepped");
    let said = format!(
        "drafter: the starting checkpoint's (trained in its run's bubbles, {} optimizer steps)",
        trained.weights.version
    );

    let rl = |launch: &[&str], from: &Path, out: &Path| {
        let output = run(
            launch,
            &["rl", "--init", from.to_str().unwrap()],
            SPECULATIVE,
            out,
        );
        assert!(output.status.success(), "{}", text(&output));
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let launch2 = ["launch", "-n", "2", "--"];
    let (single, multi, fresh) = (
        dir.path().join("single"),
        dir.path().join("multi"),
        dir.path().join("fresh"),
    );
    let stdout = rl(&[], &init, &single);
    assert!(stdout.contains(&said), "{stdout}");
    let stdout = rl(&launch2, &init, &multi);
    assert!(stdout.contains(&said), "{stdout}");
    let stdout = rl(&launch2, &plain, &fresh);
    assert!(stdout.contains("drafter: untrained"), "{stdout}");

    // Every step speculated with the trained drafter, as in-process: its acceptance lengths
    // (those of an untrained drafter are lower: `fresh`), so the same samples were drawn;
    // and they carried a gradient.
    let accepted = metrics_column(&multi, "acceptance_length");
    assert_eq!(accepted, metrics_column(&single, "acceptance_length"));
    let untrained = metrics_column(&fresh, "acceptance_length");
    assert!(accepted[0] > untrained[0], "{accepted:?} vs {untrained:?}");
    assert_eq!(
        metrics_column(&multi, "reward"),
        metrics_column(&single, "reward")
    );
    assert!(
        metrics_column(&multi, "grad_norm").iter().all(|&g| g > 0.0),
        "a step without a gradient (another rl.seed in SPECULATIVE may give one)"
    );
    assert_bitwise(&checkpoint(&single), &checkpoint(&multi));
    // Both keep the drafter that followed the policy through the run, trained further than
    // --init's, the same bits.
    let kept = |run: &Path| checkpoint(run).drafter.expect("the run's drafter");
    let (a, b) = (kept(&single), kept(&multi));
    assert!(a.optimizer.step > trained.optimizer.step);
    assert_eq!((a.weights, a.optimizer), (b.weights, b.optimizer));
}

#[test]
fn launched_rl_with_two_replicas_equals_one_within_float_rounding() {
    let dir = tempfile::tempdir().unwrap();
    let init = trained_init(dir.path());
    let init = init.to_str().unwrap();
    let (launch2, launch4) = (["launch", "-n", "2", "--"], ["launch", "-n", "4", "--"]);
    // From the same policy: plain GRPO, and with the KL term (each replica's head reads its
    // own sequences' reference log-probs).
    for (name, kl) in [("plain", "rl.kl_coef=0"), ("kl", "rl.kl_coef=0.5")] {
        let (one, two) = (
            dir.path().join(name),
            dir.path().join(format!("{name}-dp2")),
        );
        let out = run(&launch2, &["rl", "--init", init], &[kl], &one);
        assert!(out.status.success(), "{}", text(&out));
        let out = run(&launch4, &["rl", "--init", init], &[kl, "dp=2"], &two);
        assert!(out.status.success(), "{}", text(&out));
        assert_replicas_match(&one, &two, &out, INIT_TOLERANCE);
    }
    // Warmed up over the replicas too (data-parallel, as launch train).
    let (one, two) = (dir.path().join("warm"), dir.path().join("warm-dp2"));
    let kl = "rl.kl_coef=0.5";
    let out = pipefill(&launch2, &[kl], &one);
    assert!(out.status.success(), "{}", text(&out));
    let out = pipefill(&launch4, &[kl, "dp=2"], &two);
    assert!(out.status.success(), "{}", text(&out));
    assert_replicas_match(&one, &two, &out, WARM_UP_TOLERANCE);
}

/// A launched RL run with two replicas shards its update's optimizer where asked
/// (ZeRO-1: each replica keeps half the moments between RL steps, and the last update
/// gathers them for the checkpoint): its checkpoint, parameters and moments, is bitwise
/// the unsharded run's. In one process the setting is refused, naming it.
#[test]
fn launched_rl_with_a_sharded_optimizer_equals_the_unsharded_run_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let init = trained_init(dir.path());
    let init = init.to_str().unwrap();
    let launch4 = ["launch", "-n", "4", "--"];
    let runs: Vec<Vec<u8>> = ["false", "true"]
        .iter()
        .map(|shard| {
            let out_dir = dir.path().join(format!("shard-{shard}"));
            let set = format!("optimizer.shard={shard}");
            let extra = ["dp=2", "rl.steps=3", set.as_str()];
            let out = run(&launch4, &["rl", "--init", init], &extra, &out_dir);
            assert!(out.status.success(), "{}", text(&out));
            std::fs::read(out_dir.join("checkpoint/model.safetensors")).unwrap()
        })
        .collect();
    assert!(
        runs[0] == runs[1],
        "sharded and unsharded checkpoints differ"
    );
    let refused = dir.path().join("in-process");
    let out = run(
        &[],
        &["rl", "--init", init],
        &["dp=2", "optimizer.shard=true"],
        &refused,
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("optimizer.shard") && err.contains("launched run"),
        "{err}"
    );
}

/// A policy for `--init`: [`TINY`] trained 60 steps by `launch -n 2 -- train`, in `dir`.
fn trained_init(dir: &Path) -> std::path::PathBuf {
    let init = dir.join("init");
    let out = run(
        &["launch", "-n", "2", "--"],
        &["train"],
        &["train.steps=60"],
        &init,
    );
    assert!(out.status.success(), "{}", text(&out));
    init
}

/// `two` (dp = 2) had `one`'s (dp = 1) rollouts, and ends with its parameters within the
/// stated tolerance.
fn assert_replicas_match(
    one: &Path,
    two: &Path,
    out: &Output,
    (max_abs_diff, max_rel_l2): (f32, f64),
) {
    // Rank 0's rollouts under (almost) the same policy: the same samples, the same rewards.
    assert_eq!(metrics_column(two, "reward"), metrics_column(one, "reward"));
    assert_eq!(
        metrics_column(two, "sequences"),
        metrics_column(one, "sequences")
    );
    assert!(
        metrics_column(two, "grad_norm").iter().all(|&g| g > 0.0),
        "a step without a gradient: {}",
        text(out)
    );
    for (k2, k1) in metrics_column(two, "kl")
        .iter()
        .zip(metrics_column(one, "kl"))
    {
        let same = (k2.is_nan() && k1.is_nan()) || (k2 - k1).abs() <= 1e-5 * (1.0 + k1.abs());
        assert!(same, "kl {k2} vs {k1}");
    }

    let (a, b) = (checkpoint(one), checkpoint(two));
    assert_eq!(a.meta.step, b.meta.step);
    assert_eq!(a.meta.optimizer_step, b.meta.optimizer_step);
    let (mut max_abs, mut diff_sq, mut norm_sq) = (0.0f32, 0.0f64, 0.0f64);
    let moment = |n: &str| {
        [ADAM_M_PREFIX, ADAM_V_PREFIX, MASTER_PREFIX]
            .iter()
            .any(|p| n.starts_with(p))
    };
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        assert_eq!((&x.name, &x.shape), (&y.name, &y.shape));
        if moment(&x.name) {
            continue;
        }
        for (&p, &q) in x.data.iter().zip(&y.data) {
            max_abs = max_abs.max((p - q).abs());
            diff_sq += f64::from(p - q).powi(2);
            norm_sq += f64::from(p).powi(2);
        }
    }
    let rel_l2 = (diff_sq / norm_sq).sqrt();
    eprintln!("dp = 2 vs dp = 1: max |Δparam| {max_abs:e}, relative L2 {rel_l2:e}");
    assert!(max_abs <= max_abs_diff, "max |Δparam| {max_abs}");
    assert!(rel_l2 <= max_rel_l2, "relative L2 {rel_l2}");
}

#[test]
fn launched_rl_refuses_unequal_shares_and_a_world_unlike_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    // 32 sequences and 4 warm-up micro-batches do not split into 3 shares.
    let out = pipefill(
        &["launch", "-n", "3", "--"],
        &["dp=3", "stages=1"],
        dir.path(),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("dp = 3 replicas cannot take equal shares"),
        "{err}"
    );

    let out = pipefill(&["launch", "-n", "3", "--"], &[], dir.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("3 processes were launched"), "{err}");
}

/// [`TINY`] and `extra` as a job.
fn tiny_job(extra: &[&str]) -> JobConfig {
    let sets: Vec<String> = TINY.iter().chain(extra).map(|s| s.to_string()).collect();
    JobConfig::embedded(&sets).unwrap()
}

/// `job`'s launched RL with its `world` ranks on threads of this process (a loopback TCP
/// mesh), from `init` or the warm-up, each rank keeping its update compute from step to
/// step or not: rank 0's run.
fn launched_on_threads(
    job: &JobConfig,
    world: usize,
    init: Option<&Checkpoint>,
    keep: bool,
) -> RlLaunchRun {
    let meshes = TcpMesh::loopback(world, &MeshOptions::new("launch-rl-test")).unwrap();
    let options = RankOptions {
        keep_update_ranks: keep,
    };
    std::thread::scope(|s| {
        let ranks: Vec<_> = meshes
            .into_iter()
            .map(|mesh| {
                let mesh = Arc::new(mesh);
                let clock = Clock::virtual_free();
                s.spawn(move || rl_rank_with(job, &mesh, clock, init, options, |_| {}))
            })
            .collect();
        let mut runs = ranks.into_iter().map(|r| r.join().unwrap().unwrap());
        let run = runs.next().unwrap().expect("rank 0 returns the run");
        assert!(runs.all(|r| r.is_none()), "only rank 0 returns the run");
        run
    })
}

fn rewards(run: &RlLaunchRun) -> Vec<f64> {
    run.steps.iter().map(|s| s.reward).collect()
}

fn grad_norms(run: &RlLaunchRun) -> Vec<f32> {
    run.steps.iter().map(|s| s.grad_norm).collect()
}

#[test]
fn launched_rl_keeping_its_update_ranks_equals_rebuilding_them_bitwise() {
    // One pipeline of plain GRPO, and two replicas with the KL term; 3 steps, each after
    // the first continuing from the kept ranks (the warm-up's, for the first).
    for (world, extra) in [
        (2, &["rl.steps=3"][..]),
        (4, &["rl.steps=3", "dp=2", "rl.kl_coef=0.5"][..]),
    ] {
        let job = tiny_job(extra);
        let kept = launched_on_threads(&job, world, None, true);
        let rebuilt = launched_on_threads(&job, world, None, false);
        assert_eq!(rewards(&kept), rewards(&rebuilt));
        assert!(grad_norms(&kept).iter().all(|&g| g > 0.0), "{world}");
        assert_eq!(grad_norms(&kept), grad_norms(&rebuilt));
        assert_eq!(kept.checkpoint.meta.step, 60 + 3);
        assert_bitwise(&kept.checkpoint, &rebuilt.checkpoint);
    }
}

#[test]
fn launched_rl_from_an_init_checkpoint_keeping_its_ranks_equals_the_in_process_run_bitwise() {
    // The first update starts from the checkpoint's host copy, the next from the kept
    // ranks; plain sampling, so the rollouts are a function of the policy alone.
    let job = tiny_job(&["rl.steps=3", "rl.speculation=false"]);
    let init = launched_on_threads(&tiny_job(&["rl.steps=1"]), 2, None, true).checkpoint;
    let launched = launched_on_threads(&job, 2, Some(&init), true);

    let mut trainer = RlTrainer::new(&job, init).unwrap();
    let mut engine = PipelineRollouts::new(&job).unwrap();
    let in_process: Vec<_> = (0..job.rl.steps)
        .map(|_| trainer.run_step(&mut engine, |_| {}).unwrap())
        .collect();
    let in_process_rewards: Vec<f64> = in_process.iter().map(|m| m.reward).collect();
    assert_eq!(rewards(&launched), in_process_rewards);
    assert!(grad_norms(&launched).iter().all(|&g| g > 0.0));
    assert_bitwise(&trainer.checkpoint().unwrap(), &launched.checkpoint);
}
