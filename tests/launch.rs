//! Multi-process jobs through the binary: `pipefill launch -n 4`, a real `mpirun`, and ranks
//! started as torchrun and srun start them (described by their variables alone) give
//! exactly the parameters (and optimizer moments) of the in-process run of the same job; a
//! killed rank ends the job within 10 s with its rank named; a wrong job token is refused;
//! dp = 2 replicas × 2 stages equal the in-process dp = 1 run within tests/dp.rs's tolerance.
//! A tiny model keeps each job to a few seconds.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use pipefill::model::checkpoint::Checkpoint;

mod common;
use common::{LAUNCHED_MODEL, assert_bitwise, clean, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// Four ranks of ZB-H1 on [`LAUNCHED_MODEL`].
const JOB: &[&str] = &[
    "schedule=\"zb-h1\"",
    "stages=4",
    "filler=\"none\"",
    "train.eval_tasks=2",
];

fn train_args(out: &Path, extra: &[&str]) -> Vec<String> {
    common::train_args(out, JOB.iter().chain(&LAUNCHED_MODEL).chain(extra).copied())
}

/// The in-process run's checkpoint (computed once per test that needs it).
fn in_process(dir: &Path, extra: &[&str]) -> Checkpoint {
    let out = clean(EXE).args(train_args(dir, extra)).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    Checkpoint::load(&dir.join("checkpoint")).unwrap()
}

/// The launched run's directory holds what a single-process run's does: the merged
/// profile's report, trace (a process per rank) and timeline, and the step log with the
/// same losses as the in-process run (bitwise: the same computation).
fn assert_run_files(single: &Path, launched: &Path) {
    for name in ["report.txt", "report.json", "timeline.svg"] {
        let path = launched.join(name);
        assert!(
            std::fs::metadata(&path).is_ok_and(|m| m.len() > 0),
            "{} missing or empty",
            path.display()
        );
    }
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(launched.join("trace.json")).unwrap()).unwrap();
    let events = trace
        .get("traceEvents")
        .and_then(|e| e.as_array())
        .or(trace.as_array())
        .expect("a trace is an event list");
    let mut pids: Vec<u64> = events
        .iter()
        .filter(|e| e.get("ph").and_then(|p| p.as_str()) == Some("X"))
        .filter_map(|e| e.get("pid").and_then(|p| p.as_u64()))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(pids.len(), 4, "compute spans of every rank: {pids:?}");
    let report = std::fs::read_to_string(launched.join("report.txt")).unwrap();
    assert!(report.contains("merged from 4 processes"), "{report}");
    let losses = |dir: &Path| -> Vec<(u64, f64)> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
            })
            .collect()
    };
    let (a, b) = (losses(single), losses(launched));
    assert_eq!(a.len(), 3, "{a:?}");
    // One line type for both runs (pipefill::run::StepLine): the same fields, step by step.
    let keys = |dir: &Path| -> Vec<Vec<String>> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
                k.sort();
                k
            })
            .collect()
    };
    assert_eq!(
        keys(single),
        keys(launched),
        "metrics.jsonl lines differ in their fields"
    );
    assert_eq!(
        a, b,
        "the launched run's losses differ from the in-process run's"
    );
}

/// A port for a launcher that is told one (mpirun, torchrun-style variables): free now,
/// and below the kernel's ephemeral range, so that no test's `bind(0)` or outgoing
/// connection can be given it before rank 0 binds it (a port from `bind(0)` could be).
fn free_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let span = u32::from(low.saturating_sub(10_000)).max(1);
    let mut seed = std::process::id() ^ std::time::UNIX_EPOCH.elapsed().unwrap().subsec_nanos();
    for _ in 0..1000 {
        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let port = 10_000 + ((seed >> 8) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between 10000 and {low}")
}

#[test]
fn launch_of_four_ranks_and_mpirun_equal_the_in_process_run() {
    let dir = tempfile::tempdir().unwrap();
    let single = clean(EXE)
        .args(train_args(&dir.path().join("single"), &[]))
        .output()
        .unwrap();
    assert!(single.status.success(), "{}", text(&single));
    let reference = Checkpoint::load(&dir.path().join("single/checkpoint")).unwrap();

    let launched = dir.path().join("launch");
    let out = clean(EXE)
        .args(["launch", "-n", "4", "--"])
        .args(train_args(&launched, &[]))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    // Both runs sum themselves up alike (one RunSummary): the same steps and, computing the
    // same, the same loss means.
    let losses = |out: &std::process::Output| {
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let done = stdout
            .lines()
            .find_map(|l| l.split_once("done: ").map(|(_, rest)| rest.to_string()))
            .unwrap_or_else(|| panic!("no done: line in {stdout}"));
        let steps = done.split(" steps in ").next().unwrap().to_string();
        let loss = done
            .split("; loss ")
            .nth(1)
            .unwrap()
            .split(';')
            .next()
            .unwrap();
        (steps, loss.to_string())
    };
    assert_eq!(losses(&out), losses(&single), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("[rank 0] done: "), "{}", text(&out));
    // Rank 0 shows each step as an in-process run does (one runner): loss, learning rate,
    // tokens/s and the step's bubble ratios from the merged profile.
    let first = stdout
        .lines()
        .find(|l| l.starts_with("[rank 0] step     1/"))
        .unwrap_or_else(|| panic!("no step line: {}", text(&out)));
    assert!(
        first.contains(" | lr ") && first.contains(" tok/s | bubble "),
        "{first}"
    );
    assert!(stdout.contains("; run directory "), "{}", text(&out));
    assert!(launched.join("job.toml").exists());
    assert_run_files(&dir.path().join("single"), &launched);
    assert_bitwise(
        &reference,
        &Checkpoint::load(&launched.join("checkpoint")).unwrap(),
    );

    let has_mpirun = Command::new("sh")
        .args(["-c", "command -v mpirun"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_mpirun {
        println!("skipping the mpirun run: mpirun is not installed (apt-get install openmpi-bin)");
        return;
    }
    let mpi = dir.path().join("mpirun");
    let port = free_port().to_string();
    let out = clean("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "4"])
        .args(["-x", "PIPEFILL_TOKEN=mpirun-test-token"])
        .args(["-x", &format!("PIPEFILL_MASTER_PORT={port}")])
        .arg(EXE)
        .args(train_args(&mpi, &[]))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_bitwise(
        &reference,
        &Checkpoint::load(&mpi.join("checkpoint")).unwrap(),
    );
}

/// torchrun and srun start every rank themselves and describe it in the environment only
/// (`RANK`/`WORLD_SIZE`/`LOCAL_RANK`, `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_LOCALID`, with
/// `MASTER_ADDR`/`MASTER_PORT`): four processes started that way, with nothing but those
/// variables, run the same runner and end with the in-process run's parameters, bit for bit.
#[test]
fn torchrun_and_srun_style_ranks_equal_the_in_process_run() {
    let dir = tempfile::tempdir().unwrap();
    let reference = in_process(&dir.path().join("single"), &[]);
    let launchers: [(&str, [&str; 3]); 2] = [
        ("torchrun", ["RANK", "WORLD_SIZE", "LOCAL_RANK"]),
        ("srun", ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"]),
    ];
    for (launcher, [rank_var, world_var, local_var]) in launchers {
        let out_dir = dir.path().join(launcher);
        let port = free_port().to_string();
        let ranks: Vec<_> = (0..4)
            .map(|rank| {
                clean(EXE)
                    .args(train_args(&out_dir, &[]))
                    .env(rank_var, rank.to_string())
                    .env(world_var, "4")
                    .env(local_var, rank.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", &port)
                    .env("PIPEFILL_TOKEN", format!("{launcher}-test-token"))
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (rank, child) in ranks.into_iter().enumerate() {
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{launcher} rank {rank}: {}",
                text(&out)
            );
            // One job, not four: only rank 0 sums the run up.
            let done = String::from_utf8_lossy(&out.stdout).contains("done: ");
            assert_eq!(done, rank == 0, "{launcher} rank {rank}: {}", text(&out));
        }
        assert_bitwise(
            &reference,
            &Checkpoint::load(&out_dir.join("checkpoint")).unwrap(),
        );
    }
}

/// Sends every line of `from` on a channel.
fn lines(from: impl Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

#[test]
fn killing_one_rank_ends_the_job_within_ten_seconds_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = clean(EXE)
        .args(["launch", "-n", "4", "--"])
        .args(train_args(&dir.path().join("run"), &["train.steps=100000"]))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = lines(child.stdout.take().unwrap());
    let stderr = lines(child.stderr.take().unwrap());
    let mut seen = Vec::new();
    let mut victim = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    // Wait until rank 2's pid is known and the job trains (rank 0 reports the mesh).
    let mut training = false;
    while victim.is_none() || !training {
        assert!(
            Instant::now() < deadline,
            "the job did not start: {seen:#?}"
        );
        while let Ok(line) = stderr.try_recv() {
            if let Some(pid) = line.strip_prefix("[launch] rank 2: pid ") {
                victim = Some(pid.trim().to_string());
            }
            seen.push(line);
        }
        while let Ok(line) = stdout.try_recv() {
            training |= line.starts_with("[rank 0] distributed:");
            seen.push(line);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    let killed = Instant::now();
    let status = Command::new("kill")
        .args(["-9", victim.as_deref().unwrap()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if killed.elapsed() > Duration::from_secs(15) {
            let _ = child.kill();
            panic!("the job still runs 15 s after rank 2 was killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = killed.elapsed();
    std::thread::sleep(Duration::from_millis(200));
    seen.extend(stderr.try_iter());
    seen.extend(stdout.try_iter());
    let all = seen.join("\n");
    assert!(!exit.success(), "{all}");
    assert!(took < Duration::from_secs(10), "took {took:?}: {all}");
    assert!(all.contains("[launch] rank 2 failed: signal: 9"), "{all}");
    for rank in [0, 1, 3] {
        assert!(
            all.lines()
                .any(|l| l.starts_with(&format!("[rank {rank}] error:"))
                    && l.contains("rank 2 died")),
            "rank {rank} did not name rank 2: {all}"
        );
    }
    println!("the job ended {took:?} after rank 2 was killed");
}

#[test]
fn a_rank_with_a_wrong_token_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let spawn = |rank: &str, token: &str| {
        clean(EXE)
            .args(train_args(&dir.path().join(format!("run{rank}")), &[]))
            .env("PIPEFILL_RANK", rank)
            .env("PIPEFILL_WORLD_SIZE", "4")
            .env("PIPEFILL_MASTER_PORT", &port)
            .env("PIPEFILL_TOKEN", token)
            .env("PIPEFILL_JOIN_TIMEOUT", "3")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let master = spawn("0", "the-job-token");
    let intruder = spawn("1", "a-guessed-token");
    let (master, intruder) = (
        master.wait_with_output().unwrap(),
        intruder.wait_with_output().unwrap(),
    );
    let (m, i) = (text(&master), text(&intruder));
    assert!(
        !master.status.success() && !intruder.status.success(),
        "{m}\n{i}"
    );
    assert!(
        m.contains("refused connection") && m.contains("wrong job token"),
        "{m}"
    );
    assert!(m.contains("ranks [1, 2, 3] did not join within 3 s"), "{m}");
    assert!(i.contains("rank 0 closed the connection"), "{i}");
}

#[test]
fn launch_refuses_what_it_cannot_run_and_fails_when_every_rank_does() {
    let out = clean(EXE)
        .args(["launch", "-n", "2", "--", "profile"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("launch runs `train` or `rl` on every rank, not Some(\"profile\")"),
        "{}",
        text(&out)
    );
    // Two processes for a four-rank schedule: each rank refuses, the launcher names both.
    let dir = tempfile::tempdir().unwrap();
    let out = clean(EXE)
        .args(["launch", "-n", "2", "--"])
        .args(train_args(dir.path(), &[]))
        .output()
        .unwrap();
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("has 4 ranks × dp = 1 but 2 processes were launched"),
        "{all}"
    );
    assert!(all.contains("2 of the job's ranks failed"), "{all}");
}

/// tests/dp.rs's tolerance: the all-reduce sums the replicas' gradients in another order
/// than one pipeline does (≈1e-7 relative), which AdamW carries into the parameters.
const DP_MAX_ABS_DIFF: f32 = 1e-5;
const DP_MAX_REL_L2: f64 = 1e-6;

#[test]
fn launch_of_dp2_times_pp2_equals_the_in_process_dp1_run() {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single");
    let out = clean(EXE)
        .args(train_args(&single, &["stages=2"]))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let reference = Checkpoint::load(&single.join("checkpoint")).unwrap();

    let launched = dir.path().join("dp2");
    let out = clean(EXE)
        .args(["launch", "-n", "4", "--"])
        .args(train_args(&launched, &["stages=2", "dp=2"]))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let got = Checkpoint::load(&launched.join("checkpoint")).unwrap();
    assert_eq!(reference.meta.step, got.meta.step);
    assert_eq!(reference.tensors.len(), got.tensors.len());
    let (mut diff2, mut norm2, mut max_abs) = (0.0f64, 0.0f64, 0.0f32);
    for (a, b) in reference.tensors.iter().zip(&got.tensors) {
        assert_eq!((&a.name, &a.shape), (&b.name, &b.shape));
        for (x, y) in a.data.iter().zip(&b.data) {
            max_abs = max_abs.max((x - y).abs());
            diff2 += f64::from(x - y).powi(2);
            norm2 += f64::from(*x).powi(2);
        }
    }
    let rel = (diff2 / norm2.max(f64::MIN_POSITIVE)).sqrt();
    assert!(max_abs <= DP_MAX_ABS_DIFF, "max |Δ| {max_abs}");
    assert!(rel <= DP_MAX_REL_L2, "relative L2 {rel}");
    // The whole batch's losses (each replica's token-weighted), as one pipeline computes
    // them up to the summation order.
    let losses = |dir: &Path| -> Vec<f64> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    let (a, b) = (losses(&single), losses(&launched));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "losses {a:?} vs {b:?}");
    }
    println!("dp=2 × pp=2 through launch: max |Δparam| {max_abs:e}, relative L2 {rel:e}");
}

/// `dp × stages` in one process is the launched job: each replica a group of threads, the
/// replicas all-reducing over in-process links in the ring the mesh runs, so the final
/// checkpoint is bitwise the launched one's and the step log's whole-batch losses are the
/// same numbers.
#[test]
fn dp2_times_pp2_in_one_process_equals_launch_of_four_ranks_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let settings = ["stages=2", "dp=2"];
    let single = dir.path().join("single");
    let one = in_process(&single, &settings);
    let launched = dir.path().join("launched");
    let out = clean(EXE)
        .args(["launch", "-n", "4", "--"])
        .args(train_args(&launched, &settings))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_bitwise(
        &one,
        &Checkpoint::load(&launched.join("checkpoint")).unwrap(),
    );
    let losses = |dir: &Path| -> Vec<(u64, u64, u64)> {
        common::metrics_lines(dir)
            .iter()
            .map(|v| {
                let loss = v["loss"].as_f64().unwrap();
                (
                    v["step"].as_u64().unwrap(),
                    loss.to_bits(),
                    v["tokens"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(losses(&single), losses(&launched));
    assert_eq!(losses(&single).len(), 3);
}

/// A Llama-shaped model with the LM head tied to the token embedding: its first and last
/// stages are in different processes and sum the tied gradient over the mesh. Two ranks
/// launched equal the in-process run bitwise; with two replicas of those (the pair's
/// group offset by the replica) the copies stay bitwise tied too.
#[test]
fn a_tied_model_launched_equals_the_in_process_run_and_stays_tied() {
    const TIED: &[&str] = &[
        "stages=2",
        "model.tie_embeddings=true",
        "model.positions=\"rope\"",
        "model.activation=\"swiglu\"",
        "model.kv_heads=1",
    ];
    let dir = tempfile::tempdir().unwrap();
    let reference = in_process(&dir.path().join("single"), TIED);
    let tied = |c: &Checkpoint| {
        let get = |n: &str| &c.tensors.iter().find(|t| t.name == n).unwrap().data;
        assert_eq!(get("embed.tok"), get("head.w"));
    };
    tied(&reference);
    let launched = dir.path().join("launched");
    let out = clean(EXE)
        .args(["launch", "-n", "2", "--"])
        .args(train_args(&launched, TIED))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_bitwise(
        &reference,
        &Checkpoint::load(&launched.join("checkpoint")).unwrap(),
    );
    let dp = dir.path().join("dp2");
    let out = clean(EXE)
        .args(["launch", "-n", "4", "--"])
        .args(train_args(&dp, &[TIED, &["dp=2"]].concat()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    tied(&Checkpoint::load(&dp.join("checkpoint")).unwrap());
}

#[test]
fn a_launched_run_of_2_steps_resumed_for_2_more_equals_4_steps_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let reference = in_process(&dir.path().join("single"), &["train.steps=4"]);
    let first = dir.path().join("first");
    let out = clean(EXE)
        .args(["launch", "-n", "4", "--"])
        .args(train_args(&first, &["train.steps=2"]))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let second = dir.path().join("second");
    let out = clean(EXE)
        .args(["launch", "-n", "4", "--"])
        .args(train_args(&second, &["train.steps=4"]))
        .arg("--resume")
        .arg(&first)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_bitwise(
        &reference,
        &Checkpoint::load(&second.join("checkpoint")).unwrap(),
    );
}
