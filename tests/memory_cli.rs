//! Memory bounds and misleading errors (issue 19, items 2 and 6), through the binary: sizes
//! too large for the machine (or `--max-memory`) are one line naming the field and the
//! estimate, refused before anything is allocated (each such child's peak RSS is measured
//! and must stay small); the estimate covers what a run really uses; and the errors that
//! misled (overflowing costs reported as a deadlock, a huge bad cell echoed whole, a parse
//! error printed twice, a too-small vocabulary failing mid-run, `dp` ignored) say what is
//! wrong. A proptest over the job's size fields runs the binary: a job the check lets
//! through never uses more than its estimate.

use std::io::Read;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use pipefill::config::JobConfig;
use pipefill::config::memory::{Bytes, MemoryEstimate, Workload};
use proptest::prelude::*;

mod common;
use common::clean;

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// What a refused command may use at most: the binary and its start-up, nothing sized by
/// the job.
const REFUSED_RSS: u64 = 64 << 20;
const REFUSED_SECONDS: u64 = 10;

/// A finished child: its exit, output, peak RSS and wall time.
struct Run {
    success: bool,
    stdout: String,
    stderr: String,
    peak_rss: u64,
    elapsed: Duration,
}

/// Runs `pipefill ARGS` in `dir`, measuring the child's own peak RSS (`wait4`'s rusage).
#[expect(
    clippy::zombie_processes,
    reason = "the child is reaped by wait4, which std's Child cannot do with its rusage"
)]
fn run(dir: &Path, args: &[&str]) -> Run {
    let started = Instant::now();
    let mut child = clean(EXE)
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the pipefill binary runs");
    let read = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            pipe.read_to_string(&mut text)
                .map(|_| text)
                .unwrap_or_default()
        })
    };
    let out = read(Box::new(child.stdout.take().unwrap()));
    let err = read(Box::new(child.stderr.take().unwrap()));
    let hwm = watch_hwm(child.id());
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: `usage` is a plain C struct that wait4 fills; the child is ours and waited
    // for here only (std's `Child` is not waited on afterwards).
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let waited = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(waited, pid, "wait4 failed");
    let elapsed = started.elapsed();
    // Linux reports kilobytes. A child's `ru_maxrss` also holds the memory of the process
    // that spawned it (the kernel keeps the old address space's high-water mark across
    // `exec`), so where it is no more than this test process's own it may be that, and
    // the child's own high-water mark as last read while it ran is taken instead.
    let maxrss = usage.ru_maxrss as u64 * 1024;
    let polled = hwm.join().unwrap();
    let peak_rss = match maxrss > own_maxrss() {
        true => maxrss,
        false => polled,
    };
    Run {
        success: libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
        peak_rss,
        elapsed,
    }
}

/// This process's peak RSS, in bytes.
fn own_maxrss() -> u64 {
    // SAFETY: `usage` is a plain C struct that getrusage fills.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    usage.ru_maxrss as u64 * 1024
}

/// Reads process `pid`'s own RSS high-water mark (`VmHWM`) every millisecond until it
/// ends; the thread returns the last value read, in bytes.
fn watch_hwm(pid: u32) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut last = 0;
        while let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            let Some(kb) = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            else {
                break;
            };
            last = kb * 1024;
            std::thread::sleep(Duration::from_millis(1));
        }
        last
    })
}

/// A refused command: one `error: …` line, quickly and without allocating what the job
/// would need; returns that line.
fn refused(dir: &Path, args: &[&str]) -> String {
    let r = run(dir, args);
    assert!(!r.success, "{args:?} succeeded: {}", r.stdout);
    let line = r.stderr.trim().to_string();
    assert_eq!(line.lines().count(), 1, "{args:?}: not one line: {line}");
    assert!(line.starts_with("error: "), "{args:?}: {line}");
    assert!(
        r.peak_rss < REFUSED_RSS,
        "{args:?}: peak RSS {} before refusing",
        Bytes(r.peak_rss)
    );
    assert!(
        r.elapsed < Duration::from_secs(REFUSED_SECONDS),
        "{args:?}: took {:?} to refuse",
        r.elapsed
    );
    line
}

#[test]
fn a_schedule_too_large_to_build_is_refused_naming_its_flags() {
    let dir = tempfile::tempdir().unwrap();
    let line = refused(
        dir.path(),
        &[
            "schedule",
            "validate",
            "zb-h1",
            "--stages",
            "100000",
            "--microbatches",
            "100000",
        ],
    );
    assert!(
        line.contains(
            "--stages 100000 × --microbatches 100000: zb-h1's plan has 30000000000 actions"
        ) && line.contains("over the memory limit of"),
        "{line}"
    );
    // Under --max-memory, a shape that fits the machine is refused too, and the other
    // subcommands check before building.
    for cmd in ["show", "simulate"] {
        let line = refused(
            dir.path(),
            &[
                "schedule",
                cmd,
                "zb-h1",
                "-p",
                "64",
                "-m",
                "1024",
                "--max-memory",
                "1MiB",
            ],
        );
        assert!(line.contains("1.0 MiB (--max-memory)"), "{line}");
    }
    for cmd in ["compare", "auto"] {
        let line = refused(
            dir.path(),
            &[
                "schedule",
                cmd,
                "-p",
                "64",
                "-m",
                "1024",
                "--max-memory",
                "1MiB",
            ],
        );
        assert!(line.contains("--stages 64 × --microbatches 1024"), "{line}");
    }
}

#[test]
fn job_sizes_over_the_memory_are_one_line_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let train = |set: &str| {
        refused(
            dir.path(),
            &[
                "train",
                "--steps",
                "1",
                "--max-memory",
                "8GiB",
                "--set",
                set,
            ],
        )
    };
    // Too large to count: the estimate overflows.
    for (set, field) in [
        ("model.seq_len=100000000", "model.seq_len"),
        ("model.d_model=4000000000", "model.d_model"),
    ] {
        let line = train(set);
        assert!(
            line.starts_with(&format!("error: invalid `{field}`:"))
                && line.contains("the memory estimate of"),
            "{line}"
        );
    }
    // Compute threads start before the first step and the estimate does not count them.
    let line = train("train.threads=3000");
    assert!(
        line.contains("train.threads") && line.contains("is 3000, more than 1024"),
        "{line}"
    );
    // Countable, but over the limit: the estimate and its largest parts (the total is 35.8
    // GiB, or 35.9 with MKL's 20 MiB where it computes the products).
    let line = train("train.eval_tasks=100000000");
    assert!(
        ["35.8", "35.9"].iter().any(|total| line.starts_with(&format!(
            "error: invalid `train.eval_tasks`: the job needs an estimated {total} GiB (data 35.8 GiB"
        ))) && line.ends_with("over the memory limit of 8.0 GiB (--max-memory)"),
        "{line}"
    );
    let line = refused(
        dir.path(),
        &[
            "rl",
            "--max-memory",
            "8GiB",
            "--set",
            "model.seq_len=200000",
            "--set",
            "rl.max_new_tokens=10",
        ],
    );
    assert!(
        line.starts_with("error: invalid `model.seq_len`: the job needs an estimated"),
        "{line}"
    );
    let line = refused(dir.path(), &["train", "--max-memory", "lots"]);
    assert!(
        line.starts_with("error: invalid `--max-memory`: \"lots\" is not a size"),
        "{line}"
    );
    // Nothing was started: no run directory appeared.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn the_estimate_covers_what_a_run_uses() {
    let dir = tempfile::tempdir().unwrap();
    // Each run's peak RSS must stay within 15% over its estimate (the estimate is a model
    // of the run, calibrated to within ±15% of the peaks of the default job and of real
    // shapes), and the estimate within 2x of it (a bound so loose it refuses jobs that fit
    // would be no use either; one step trains the drafter less than a run does).
    // Each shape in f32 and in bf16 (`train.precision`: half the stash, and the f32
    // master weights beside the parameters).
    let bf16 = "train.precision=\"bf16\"";
    for sets in [
        &["schedule=\"none\"", "model.seq_len=512"][..],
        &["model.seq_len=512"],
        &["model.d_model=256"],
        &["schedule=\"none\"", "model.seq_len=512", bf16],
        &["model.seq_len=512", bf16],
        &["model.d_model=256", bf16],
    ] {
        let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        sets.extend([
            "train.steps=1".into(),
            "train.eval_tasks=2".into(),
            "data.summary_tasks=500".into(),
        ]);
        let job = JobConfig::embedded(&sets).unwrap();
        let estimate = MemoryEstimate::of(&job, Workload::Train).unwrap().total;
        let out = dir.path().join(format!("run{}", sets.len()));
        let mut args = vec!["train", "--out-dir", out.to_str().unwrap()];
        for s in &sets {
            args.extend(["--set", s]);
        }
        let r = run(dir.path(), &args);
        assert!(r.success, "{sets:?}: {}", r.stderr);
        assert!(
            r.stdout
                .contains(&format!("memory: {} estimated", Bytes(estimate))),
            "{}",
            r.stdout
        );
        assert!(
            r.peak_rss <= estimate + estimate * 15 / 100 && estimate <= 2 * r.peak_rss,
            "{sets:?}: peak RSS {} against an estimate of {}",
            Bytes(r.peak_rss),
            Bytes(estimate)
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
}

#[test]
fn overflowing_costs_are_named_not_a_deadlock() {
    let dir = tempfile::tempdir().unwrap();
    for cmd in [
        &["simulate", "zb-h1", "-p", "4", "-m", "8"][..],
        &["compare", "-p", "4", "-m", "8"],
        &["auto", "-p", "4", "-m", "8"],
    ] {
        let mut args = vec!["schedule"];
        args.extend_from_slice(cmd);
        args.extend(["--cost", "f=1e308,i=1e308,w=1e308"]);
        let line = refused(dir.path(), &args);
        assert!(
            line.starts_with("error: --cost f=1e308: the simulated makespan overflows")
                && !line.contains("deadlock"),
            "{line}"
        );
    }
}

#[test]
fn bad_schedule_files_are_quoted_short_and_once() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("big.csv"),
        format!("0F0,{}\n", "x".repeat(10_000_000)),
    )
    .unwrap();
    std::fs::write(dir.path().join("garbage.csv"), "0F0,garbage\n").unwrap();
    for args in [
        &["schedule", "validate", "big.csv"][..],
        &["train", "--schedule", "big.csv", "--steps", "1"],
    ] {
        let r = run(dir.path(), args);
        let line = r.stderr.trim();
        assert!(
            !r.success && line.lines().count() == 1,
            "{args:?}: {line:.300}"
        );
        assert!(
            line.len() < 400 && line.contains("… (10000000 characters)` is not an action"),
            "{args:?}: {line:.400}"
        );
    }
    for args in [
        &["schedule", "validate", "garbage.csv"][..],
        &["train", "--schedule", "garbage.csv", "--steps", "1"],
    ] {
        let line = refused(dir.path(), args);
        assert_eq!(
            line.matches("`garbage` is not an action").count(),
            1,
            "{args:?}: {line}"
        );
    }
}

#[test]
fn a_vocabulary_too_small_and_dp_where_one_process_cannot_run_it_are_refused_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let line = refused(dir.path(), &["train", "--set", "model.vocab=5"]);
    assert_eq!(
        line,
        "error: invalid `model.vocab`: 5 is too small: the tokenizer's ids (PAD, BOS, EOS and \
         the tasks' characters) need at least 50"
    );
    // `train` runs dp × stages in one process; the reference trainer and `rl`'s kept update
    // ranks cannot.
    let cases = [
        (
            &["train", "--set", "dp=2", "--set", "schedule=\"none\""][..],
            "train",
            "with schedule = \"none\" trains one model",
        ),
        (
            &["rl", "--set", "dp=2"][..],
            "rl",
            "keeps one pipeline of update ranks",
        ),
    ];
    for (args, cmd, runs) in cases {
        let line = refused(dir.path(), args);
        assert_eq!(
            line,
            format!(
                "error: dp = 2: a single-process `pipefill {cmd}` {runs}; launch dp × stages = 8 \
                 processes (`pipefill launch -n 8 -- {cmd} ...`), or set dp = 1"
            )
        );
    }
    let line = refused(dir.path(), &["train", "--set", "dp=3"]);
    assert_eq!(
        line,
        "error: dp = 3 replicas cannot take equal shares of train.micro_batches = 4"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// A size field of the default job and a value for it, from tiny to far over the limit
/// (bounded where one step's compute, not its memory, would take minutes).
fn size_set() -> impl Strategy<Value = String> {
    prop_oneof![
        (1u32..=9).prop_map(|b| format!("model.d_model={}", 8u64 << b)),
        (1u64..=24).prop_map(|n| format!("model.layers={n}")),
        (3u32..=10).prop_map(|b| format!("model.seq_len={}", 1u64 << b)),
        (1u64..=48).prop_map(|n| format!("train.micro_batch_size={n}")),
        (1u64..=32).prop_map(|n| format!("train.micro_batches={n}")),
        (1u64..=8).prop_map(|n| format!("stages={n}")),
        (4u32..=17).prop_map(|b| format!("data.summary_tasks={}", 1u64 << b)),
        (1u32..=16).prop_map(|b| format!("drafter.advanced.buffer_rows={}", 1u64 << b)),
        Just("schedule=\"none\"".to_string()),
        Just("schedule=\"gpipe\"".to_string()),
        Just("filler=\"none\"".to_string()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Through the binary: a job the memory check lets through uses at most 15% over its
    /// estimate (the child's peak RSS), and one it refuses is one line, refused before
    /// allocating.
    #[test]
    fn a_job_the_check_lets_through_stays_within_its_estimate(
        sets in proptest::collection::vec(size_set(), 1..=3)
    ) {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let mut args = vec![
            "train", "--steps", "1", "--max-memory", "384MiB",
            "--set", "train.eval_tasks=2", "--out-dir", out.to_str().unwrap(),
        ];
        for s in &sets {
            args.extend(["--set", s.as_str()]);
        }
        let r = run(dir.path(), &args);
        let estimated = r
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix("memory: ")?.split(" estimated").next())
            .map(str::to_string);
        if r.success {
            let mut job_sets: Vec<String> = sets.clone();
            job_sets.extend(["train.eval_tasks=2".into(), "train.steps=1".into()]);
            let job = JobConfig::embedded(&job_sets).unwrap();
            let estimate = MemoryEstimate::of(&job, Workload::Train).unwrap().total;
            prop_assert_eq!(estimated, Some(Bytes(estimate).to_string()), "{:?}", sets);
            prop_assert!(
                r.peak_rss <= estimate + estimate * 15 / 100,
                "{:?}: peak RSS {} over the estimate {}",
                sets,
                Bytes(r.peak_rss),
                Bytes(estimate)
            );
        } else {
            let errors: Vec<&str> = r.stderr.lines().filter(|l| l.starts_with("error")).collect();
            prop_assert_eq!(errors.len(), 1, "{:?}: {}", sets, r.stderr);
            if errors[0].contains("estimate") {
                prop_assert!(
                    r.peak_rss < REFUSED_RSS,
                    "{:?}: refused after using {}",
                    sets,
                    Bytes(r.peak_rss)
                );
            }
        }
    }
}
