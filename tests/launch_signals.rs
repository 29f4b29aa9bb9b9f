//! The launcher and its ranks live and die together (issue 19, item 3): a SIGKILL of
//! `pipefill launch` takes its ranks with it (their parent-death signal), a SIGTERM is
//! passed on to every rank, and a rank that does not exit within the grace (here a
//! SIGSTOPped one) is killed and named in the summary, as every rank is.
//! A two-rank job of a tiny model trains until it is stopped; each test takes seconds.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

mod common;
use common::clean;

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// Two ranks of 1F1B on a tiny model, for as many steps as it takes to be stopped.
const JOB: &[&str] = &[
    "schedule=\"1f1b\"",
    "stages=2",
    "filler=\"none\"",
    "model.d_model=16",
    "model.heads=2",
    "model.layers=4",
    "model.seq_len=32",
    "train.micro_batches=4",
    "train.micro_batch_size=2",
    "train.steps=100000",
    "train.eval_tasks=0",
    "data.summary_tasks=50",
];

/// A running launch of [`JOB`] on two ranks, its ranks' pids and its output so far.
struct Job {
    launcher: Child,
    pids: Vec<u32>,
    stdout: Receiver<String>,
    stderr: Receiver<String>,
    seen: Vec<String>,
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

impl Job {
    /// Starts the launcher (with a one-second grace) and waits until both ranks' pids are
    /// known and rank 0 trains.
    fn start(out: &Path) -> Job {
        let mut cmd = clean(EXE);
        cmd.args(["launch", "-n", "2", "--grace", "1", "--", "train"]);
        for s in JOB {
            cmd.args(["--set", s]);
        }
        // The launcher keeps ignoring what it was started ignoring (nohup, a background job
        // of a non-interactive shell: SIGHUP, SIGINT); these tests start it as a terminal
        // would, whatever ran the tests.
        // SAFETY: between fork and exec only async-signal-safe calls (signal).
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
                    libc::signal(signal, libc::SIG_DFL);
                }
                Ok(())
            });
        }
        let mut launcher = cmd
            .arg("--out-dir")
            .arg(out)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut job = Job {
            stdout: lines(launcher.stdout.take().unwrap()),
            stderr: lines(launcher.stderr.take().unwrap()),
            launcher,
            pids: Vec::new(),
            seen: Vec::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut training = false;
        while job.pids.len() < 2 || !training {
            if Instant::now() > deadline {
                let _ = job.launcher.kill();
                panic!("the job did not start: {:#?}", job.seen);
            }
            while let Ok(line) = job.stderr.try_recv() {
                if let Some((_, pid)) = line.split_once(": pid ") {
                    job.pids.push(pid.trim().parse().unwrap());
                }
                job.seen.push(line);
            }
            while let Ok(line) = job.stdout.try_recv() {
                training |= line.starts_with("[rank 0] distributed:");
                job.seen.push(line);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // A few steps in.
        std::thread::sleep(Duration::from_millis(300));
        job
    }

    /// Sends `signal` to the launcher (or, with `rank`, to that rank).
    fn signal(&self, signal: &str, rank: Option<usize>) {
        let pid = rank.map_or(self.launcher.id(), |r| self.pids[r]);
        let status = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} {pid}");
    }

    /// Waits up to `limit` for the launcher to exit; then everything it printed.
    fn wait(&mut self, limit: Duration) -> (ExitStatus, String) {
        let start = Instant::now();
        let status = loop {
            if let Some(s) = self.launcher.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > limit {
                let _ = self.launcher.kill();
                self.kill_ranks();
                panic!("the launcher still runs {limit:?} later: {:#?}", self.seen);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        std::thread::sleep(Duration::from_millis(200));
        self.seen.extend(self.stderr.try_iter());
        self.seen.extend(self.stdout.try_iter());
        (status, self.seen.join("\n"))
    }

    /// The ranks that are still alive (a zombie, already dead, is not).
    fn alive(&self) -> Vec<u32> {
        self.pids.iter().copied().filter(|&p| alive(p)).collect()
    }

    /// Waits up to `limit` until no rank is alive; how long it took.
    fn ranks_gone(&self, limit: Duration) -> Result<Duration, Vec<u32>> {
        let start = Instant::now();
        loop {
            let alive = self.alive();
            if alive.is_empty() {
                return Ok(start.elapsed());
            }
            if start.elapsed() > limit {
                return Err(alive);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn kill_ranks(&self) {
        for p in self.alive() {
            let _ = std::process::Command::new("kill")
                .args(["-9", &p.to_string()])
                .status();
        }
    }
}

impl Drop for Job {
    /// Whatever a failed assertion left running is killed.
    fn drop(&mut self) {
        let _ = self.launcher.kill();
        self.kill_ranks();
    }
}

/// Whether process `pid` exists and is not a zombie.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

#[test]
fn a_sigkill_of_the_launcher_ends_every_rank_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut job = Job::start(&dir.path().join("run"));
    assert_eq!(job.alive(), job.pids, "both ranks run: {:#?}", job.seen);
    job.signal("KILL", None);
    let (status, all) = job.wait(Duration::from_secs(5));
    assert!(!status.success(), "{all}");
    let took = job.ranks_gone(Duration::from_secs(3));
    let took = took.unwrap_or_else(|alive| {
        panic!("ranks {alive:?} still run 3 s after the launcher was killed:\n{all}")
    });
    println!(
        "the ranks ({:?}) were gone {took:?} after the launcher's SIGKILL",
        job.pids
    );
}

#[test]
fn a_sigterm_sigint_or_sighup_of_the_launcher_is_passed_on_and_the_summary_names_every_rank() {
    for sig in ["TERM", "INT", "HUP"] {
        let dir = tempfile::tempdir().unwrap();
        let mut job = Job::start(&dir.path().join("run"));
        let sent = Instant::now();
        job.signal(sig, None);
        let (status, all) = job.wait(Duration::from_secs(10));
        let took = sent.elapsed();
        assert!(!status.success(), "{all}");
        assert_eq!(job.alive(), Vec::<u32>::new(), "{all}");
        assert!(
            all.contains(&format!(
                "[launch] got SIG{sig}: passing it on to ranks [0, 1]"
            )),
            "{all}"
        );
        let ended =
            |rank: usize| format!("rank {rank} ended by the SIG{sig} the launcher passed on");
        for rank in 0..2 {
            assert!(
                all.contains(&format!("[launch] {}", ended(rank))),
                "rank {rank} is not in the summary: {all}"
            );
        }
        assert!(
            all.contains(&format!(
                "error: the launcher got SIG{sig} and passed it on to the job's 2 ranks: {}, {}",
                ended(0),
                ended(1)
            )),
            "{all}"
        );
        println!("the job ended {took:?} after the launcher's SIG{sig}");
    }
}

#[test]
fn a_stopped_rank_is_killed_after_the_grace_and_named_in_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    let mut job = Job::start(&dir.path().join("run"));
    // Rank 1 hangs (stopped: it cannot act on the SIGTERM), rank 0 goes on.
    job.signal("STOP", Some(1));
    std::thread::sleep(Duration::from_millis(200));
    let sent = Instant::now();
    job.signal("TERM", None);
    let (status, all) = job.wait(Duration::from_secs(10));
    let took = sent.elapsed();
    assert!(!status.success(), "{all}");
    assert_eq!(job.alive(), Vec::<u32>::new(), "{all}");
    // Killed once the one-second grace ran out, not before.
    assert!(took >= Duration::from_secs(1), "took {took:?}: {all}");
    assert!(
        all.contains("[launch] rank 1 still running 1s after the launcher got SIGTERM: killing it"),
        "{all}"
    );
    assert!(
        all.contains("[launch] rank 0 ended by the SIGTERM the launcher passed on"),
        "{all}"
    );
    let killed = "rank 1 killed by the launcher (still running 1s after the launcher got SIGTERM)";
    assert!(all.contains(&format!("[launch] {killed}")), "{all}");
    assert!(
        all.lines()
            .any(|l| l.starts_with("error: the launcher got SIGTERM") && l.contains(killed)),
        "{all}"
    );
    println!("the job ended {took:?} after the launcher's SIGTERM, rank 1 stopped");
}

#[test]
fn a_stopped_rank_is_in_the_summary_after_its_peer_fails() {
    // The case: rank 1 stops, rank 0 declares it dead (no heartbeat) and fails,
    // and rank 1, which never exits, is killed after the grace and named.
    let dir = tempfile::tempdir().unwrap();
    let mut job = Job::start(&dir.path().join("run"));
    job.signal("STOP", Some(1));
    let (status, all) = job.wait(Duration::from_secs(30));
    assert!(!status.success(), "{all}");
    assert_eq!(job.alive(), Vec::<u32>::new(), "{all}");
    assert!(
        all.contains("[launch] rank 0 failed with exit status 1"),
        "{all}"
    );
    let killed = "rank 1 killed by the launcher (still running 1s after rank 0 failed)";
    assert!(all.contains(&format!("[launch] {killed}")), "{all}");
    assert!(
        all.lines()
            .any(|l| l.starts_with("error: 2 of the job's ranks failed")
                && l.contains("rank 0 failed with exit status 1")
                && l.contains(killed)),
        "{all}"
    );
}
