//! `pipefill launch -n N [--master-addr A] [--master-port P] [--listen-addr IP] -- train
//! [ARGS]`: runs an N-process job on this machine. What each rank does is the runner's
//! ([`pipefill::run::train`], [`pipefill::run::rl`]), as under any other launcher.
//!
//! The launcher spawns N copies of this executable with pipefill's rank variables and a
//! fresh job token (or `PIPEFILL_TOKEN` when set), prefixes every output line with its
//! rank, and exits non-zero if any rank fails. When one rank fails, the others are given a
//! grace period (`--grace`, 8 s) to notice (their mesh names the failed rank within
//! seconds) and exit with their own error; whoever is still running after it is killed.
//! The ranks die with the launcher: a SIGTERM, SIGINT or SIGHUP is passed on to every rank
//! (the same grace follows, and a second signal kills them at once), and however the
//! launcher ends, a SIGKILL included, the kernel kills its ranks (their parent-death
//! signal). A failed or interrupted job ends with a summary naming every rank and what
//! became of it: exited ok, failed with its status, ended by a signal, or killed by the
//! launcher after the grace.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use pipefill::launch::MASTER_FD;

/// How long the other ranks have to exit on their own after one failed, or after the
/// launcher passed them a signal, unless `--grace` says otherwise.
const GRACE: &str = "8";

/// The most ranks one launcher starts: each is a process with a thread per stage and link,
/// and past a few hundred the machine runs out of threads before the job can meet.
const MAX_RANKS: usize = 256;

/// How long a rank the launcher killed (SIGKILL) may take to be reaped before the summary
/// goes on without it (a process stuck in the kernel ends only when the kernel lets it).
const REAP: Duration = Duration::from_secs(5);

#[derive(clap::Args)]
pub struct LaunchArgs {
    /// Number of ranks (processes) to start on this machine.
    #[arg(short = 'n', long = "nproc", value_name = "N")]
    nproc: usize,
    /// Address of rank 0's rendezvous.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of rank 0's rendezvous (default: a free port).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,
    /// IP address the ranks' sockets listen on (default: loopback).
    #[arg(long, value_name = "IP")]
    listen_addr: Option<String>,
    /// Seconds the other ranks have to exit on their own once one failed, or once the
    /// launcher passed on a SIGTERM, SIGINT or SIGHUP; whoever still runs then is killed.
    #[arg(long, value_name = "SECONDS", default_value = GRACE, value_parser = seconds)]
    grace: Duration,
    /// The subcommand every rank runs (`train`), and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<String>,
}

/// A non-negative number of seconds.
fn seconds(text: &str) -> Result<Duration, String> {
    text.trim()
        .parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| format!("{text:?} is not a non-negative number of seconds"))
}

/// A random job token from the OS (32 hex digits).
fn fresh_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("cannot read /dev/urandom for the job token; set PIPEFILL_TOKEN instead")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Kills and reaps the ranks started so far (a start that cannot go on).
fn stop(ranks: &mut [Rank]) {
    for r in ranks {
        if let Rank::Running(child) = r {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Copies `from` to `to` line by line, each prefixed with `[rank R] `, until `from` ends.
fn forward(
    rank: usize,
    from: impl Read + Send + 'static,
    mut to: impl Write + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().spawn(move || {
        for line in BufReader::new(from).split(b'\n') {
            let Ok(line) = line else { return };
            let mut out = format!("[rank {rank}] ").into_bytes();
            out.extend_from_slice(&line);
            out.push(b'\n');
            if to.write_all(&out).and_then(|()| to.flush()).is_err() {
                return;
            }
        }
    })
}

pub fn run(args: LaunchArgs) -> anyhow::Result<()> {
    if args.nproc == 0 || args.nproc > MAX_RANKS {
        bail!(
            "-n {}: a launcher starts 1 to {MAX_RANKS} ranks on one machine",
            args.nproc
        );
    }
    // Each rank runs its part of the job (train: its stages; rl: its stages of the update,
    // rank 0 the rollouts); anything else would run N whole copies.
    match args.command.first().map(String::as_str) {
        Some("train" | "rl") => {}
        other => bail!("launch runs `train` or `rl` on every rank, not {other:?}"),
    }
    let token = match std::env::var("PIPEFILL_TOKEN") {
        Ok(t) if !t.is_empty() => t,
        _ => fresh_token()?,
    };
    // Without --master-port the launcher binds the rendezvous listener itself and hands
    // the open socket to rank 0 (`PIPEFILL_MASTER_FD`): a port only chosen here and bound
    // again by rank 0 could be taken by another process in between.
    let (master, port) = match args.master_port {
        Some(port) => (None, port),
        None => {
            let listener = TcpListener::bind((args.master_addr.as_str(), 0))
                .with_context(|| format!("no free port on {}", args.master_addr))?;
            let port = listener
                .local_addr()
                .with_context(|| format!("no free port on {}", args.master_addr))?
                .port();
            (Some(listener), port)
        }
    };
    let exe = std::env::current_exe().context("cannot find this executable")?;
    // From here a SIGTERM, SIGINT or SIGHUP is passed on to the ranks (see `supervise`).
    signals::install().context("cannot install the launcher's signal handlers")?;
    let mut ranks: Vec<Rank> = Vec::with_capacity(args.nproc);
    let mut output = Vec::with_capacity(2 * args.nproc);
    // The ranks' own process group (rank 0's pid): a signal passed on reaches them all in
    // one kill(2), so no rank sees another end before its own signal arrives.
    let mut group: Option<libc::pid_t> = None;
    for rank in 0..args.nproc {
        let mut cmd = Command::new(&exe);
        cmd.args(&args.command)
            .env("PIPEFILL_RANK", rank.to_string())
            .env("PIPEFILL_WORLD_SIZE", args.nproc.to_string())
            .env("PIPEFILL_LOCAL_RANK", rank.to_string())
            .env("PIPEFILL_MASTER_ADDR", &args.master_addr)
            .env("PIPEFILL_MASTER_PORT", port.to_string())
            .env("PIPEFILL_TOKEN", &token)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(ip) = &args.listen_addr {
            cmd.env("PIPEFILL_LISTEN_ADDR", ip);
        }
        match (&master, rank) {
            (Some(listener), 0) => hand_down(&mut cmd, listener),
            _ => {
                cmd.env_remove(MASTER_FD);
            }
        }
        die_with_launcher(&mut cmd);
        {
            use std::os::unix::process::CommandExt;
            cmd.process_group(group.unwrap_or(0));
        }
        // A signal while ranks are still being started stops the start (the ranks started
        // so far are ended): nobody waits for the whole job to come up to be told no.
        if let (1.., signal) = signals::received() {
            stop(&mut ranks);
            bail!(
                "{} while starting rank {rank} of {}: the ranks started are stopped",
                signal_name(signal),
                args.nproc
            );
        }
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                // The ranks already started would wait for this one until their timeout.
                stop(&mut ranks);
                return Err(e).with_context(|| format!("cannot start rank {rank}"));
            }
        };
        eprintln!("[launch] rank {rank}: pid {}", child.id());
        group.get_or_insert(child.id() as libc::pid_t);
        let streams = [
            child
                .stdout
                .take()
                .map(|out| forward(rank, out, std::io::stdout())),
            child
                .stderr
                .take()
                .map(|err| forward(rank, err, std::io::stderr())),
        ];
        ranks.push(Rank::Running(child));
        for stream in streams.into_iter().flatten() {
            match stream {
                Ok(handle) => output.push(handle),
                Err(e) => {
                    stop(&mut ranks);
                    return Err(e).with_context(|| {
                        format!("cannot start a thread for rank {rank}'s output")
                    });
                }
            }
        }
    }
    // Rank 0 holds its own copy of the rendezvous listener now.
    drop(master);
    supervise(ranks, group, args.grace, output)
}

/// Passes `listener` to the rank as an open descriptor named in `PIPEFILL_MASTER_FD`
/// (std opens every descriptor close-on-exec; this one rank's copy is kept open).
fn hand_down(cmd: &mut Command, listener: &TcpListener) {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let fd = listener.as_raw_fd();
    cmd.env(MASTER_FD, fd.to_string());
    // SAFETY: runs in the forked child before exec and calls only fcntl (async-signal-safe)
    // on a descriptor the launcher holds open until every rank is spawned.
    unsafe {
        cmd.pre_exec(move || {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Arms the rank's parent-death signal: the kernel sends it SIGKILL when the launcher ends,
/// however it ends (a SIGKILL of the launcher included), so no rank outlives its launcher.
/// It is set between fork and exec, in `pipefill launch`'s own children only: ranks that
/// mpirun, srun or torchrun start live by their launcher's rules, not these. The signal
/// follows the thread that spawned the rank, here the launcher's main thread, which lives
/// as long as the launcher. If the launcher ended before the signal was armed, the rank
/// is not started.
#[cfg(target_os = "linux")]
fn die_with_launcher(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and calls only prctl and
    // getppid (async-signal-safe) and builds an io::Error from a raw code (no allocation).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Without a parent-death signal (not Linux) a rank outlives a killed launcher; a SIGTERM,
/// SIGINT or SIGHUP of the launcher is still passed on.
#[cfg(not(target_os = "linux"))]
fn die_with_launcher(_: &mut Command) {}

/// The launcher's SIGTERM, SIGINT and SIGHUP: the handler only counts the signal (atomics,
/// safe in a handler); [`supervise`] polls the count and passes the signal on to the ranks.
mod signals {
    use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

    static LAST: AtomicI32 = AtomicI32::new(0);
    static COUNT: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn record(signal: libc::c_int) {
        LAST.store(signal, Ordering::SeqCst);
        COUNT.fetch_add(1, Ordering::SeqCst);
    }

    /// Handles each of SIGTERM, SIGINT and SIGHUP that this process does not ignore: a
    /// launcher started under nohup, or in the background of a non-interactive shell, goes
    /// on ignoring what it was told to ignore (and so do its ranks, which inherit that).
    pub fn install() -> std::io::Result<()> {
        for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            // SAFETY: sigaction with zero-initialised structs (a valid empty action), a
            // handler that only touches atomics, and SA_RESTART so that no other call of
            // the launcher sees EINTR.
            unsafe {
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(signal, std::ptr::null(), &mut old) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if old.sa_sigaction == libc::SIG_IGN {
                    continue;
                }
                let mut new: libc::sigaction = std::mem::zeroed();
                new.sa_sigaction = record as extern "C" fn(libc::c_int) as libc::sighandler_t;
                new.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut new.sa_mask);
                if libc::sigaction(signal, &new, std::ptr::null_mut()) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
        }
        Ok(())
    }

    /// How many of them arrived so far, and the last one.
    pub fn received() -> (usize, i32) {
        let count = COUNT.load(Ordering::SeqCst);
        (count, LAST.load(Ordering::SeqCst))
    }
}

/// A signal's name, for the launcher's lines.
fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        other => return format!("signal {other}"),
    };
    name.into()
}

/// One rank, as the launcher sees it.
enum Rank {
    Running(Child),
    /// Sent SIGKILL by the launcher (why), not reaped yet (since when).
    Killing(Child, String, Instant),
    /// It ended by itself (or by a signal someone else, or the launcher passing one on, sent).
    Ended(ExitStatus),
    /// The launcher killed it: why (the grace ran out, or a second signal).
    Killed(String),
    /// The launcher cannot tell (waiting for it failed, why).
    Unknown(String),
}

impl Rank {
    fn running(&self) -> bool {
        matches!(self, Rank::Running(_) | Rank::Killing(..))
    }

    fn ok(&self) -> bool {
        matches!(self, Rank::Ended(s) if s.success())
    }

    /// Sends the rank SIGKILL, for `why`.
    fn kill(&mut self, rank: usize, why: &str) {
        let Rank::Running(child) = self else { return };
        eprintln!("[launch] rank {rank} {why}: killing it");
        match child.kill() {
            Ok(()) => {}
            // It ended just now; the next poll reaps it.
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => return,
            Err(e) => eprintln!("[launch] rank {rank}: cannot kill it: {e}"),
        }
        let Rank::Running(child) = std::mem::replace(self, Rank::Unknown(String::new())) else {
            return;
        };
        *self = Rank::Killing(child, why.to_string(), Instant::now());
    }

    /// What became of it, for the summary; `passed_on` is the signal the launcher passed on.
    fn describe(&self, passed_on: Option<i32>) -> String {
        match self {
            Rank::Running(_) => "still running".into(),
            Rank::Killing(_, why, _) => {
                format!("killed by the launcher ({why}), not reaped {REAP:?} later")
            }
            Rank::Ended(s) if s.success() => "exited ok".into(),
            Rank::Ended(s) => match (s.code(), s.signal()) {
                (Some(code), _) => format!("failed with exit status {code}"),
                (None, Some(sig)) if Some(sig) == passed_on => {
                    format!("ended by the {} the launcher passed on", signal_name(sig))
                }
                (None, Some(sig)) => format!("killed by signal {sig} ({})", signal_name(sig)),
                (None, None) => format!("ended: {s}"),
            },
            Rank::Killed(why) => format!("killed by the launcher ({why})"),
            Rank::Unknown(why) => format!("cannot be waited for: {why}"),
        }
    }
}

/// Waits for every rank. After the first failure, or once the launcher got a SIGTERM,
/// SIGINT or SIGHUP (passed on to every rank still running), the others have `grace` to
/// exit; whoever still runs then is killed, and a second signal kills them at once. Then,
/// once the ranks' `output` is drained, fails naming every rank with what became of it
/// (and prints the same, a `[launch]` line per rank) unless every rank exited ok.
fn supervise(
    mut ranks: Vec<Rank>,
    group: Option<libc::pid_t>,
    grace: Duration,
    output: Vec<JoinHandle<()>>,
) -> anyhow::Result<()> {
    // When the grace started, and why.
    let mut cause: Option<(Instant, String)> = None;
    let mut signals_seen = 0;
    let mut passed_on: Option<i32> = None;
    while ranks.iter().any(Rank::running) {
        for (rank, state) in ranks.iter_mut().enumerate() {
            let (child, killed) = match state {
                Rank::Running(child) => (child, None),
                Rank::Killing(child, why, since) => (child, Some((why.clone(), *since))),
                _ => continue,
            };
            match (child.try_wait(), killed) {
                (Ok(Some(_)), Some((why, _))) => *state = Rank::Killed(why),
                (Ok(Some(status)), None) => {
                    let expected = passed_on.is_some_and(|sig| status.signal() == Some(sig));
                    if !status.success() && !expected {
                        eprintln!("[launch] rank {rank} failed: {status}");
                        cause
                            .get_or_insert_with(|| (Instant::now(), format!("rank {rank} failed")));
                    }
                    *state = Rank::Ended(status);
                }
                (Ok(None), Some((why, since))) if since.elapsed() > REAP => {
                    eprintln!(
                        "[launch] rank {rank} was killed ({why}) but has not ended {REAP:?} later: leaving it"
                    );
                    *state = Rank::Killed(format!("{why}; not reaped {REAP:?} later"));
                }
                (Ok(None), _) => {}
                (Err(e), _) => {
                    eprintln!("[launch] rank {rank}: cannot wait for it: {e}");
                    let _ = child.kill();
                    cause.get_or_insert_with(|| (Instant::now(), format!("rank {rank} was lost")));
                    *state = Rank::Unknown(e.to_string());
                }
            }
        }
        let (count, signal) = signals::received();
        if count > signals_seen {
            signals_seen = count;
            let name = signal_name(signal);
            let live: Vec<usize> = (0..ranks.len())
                .filter(|&r| matches!(ranks[r], Rank::Running(_)))
                .collect();
            if passed_on.is_none() {
                passed_on = Some(signal);
                eprintln!(
                    "[launch] got {name}: passing it on to ranks {live:?}; whoever still runs {grace:?} later is killed"
                );
                // One kill(2) of the ranks' group: passed on rank by rank, a rank could see
                // an earlier one's end (its connection closed) and fail before its own
                // signal came, when the launcher is descheduled between two kills.
                if let (Some(group), false) = (group, live.is_empty()) {
                    // SAFETY: kill(2) of the process group the launcher made for its ranks
                    // (a live rank keeps the group, so its id is still theirs).
                    unsafe { libc::kill(-group, signal) };
                }
                // The ranks have the whole grace from now to act on it.
                cause = Some((Instant::now(), format!("the launcher got {name}")));
            } else {
                for &rank in &live {
                    ranks[rank].kill(rank, &format!("still running at a second {name}"));
                }
            }
        }
        if let Some((since, why)) = &cause
            && since.elapsed() > grace
        {
            for (rank, state) in ranks.iter_mut().enumerate() {
                state.kill(rank, &format!("still running {grace:?} after {why}"));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // What the ranks wrote last, before the summary (a rank's pipe ends with the rank,
    // unless a process it started holds it: then the summary goes on after a second).
    let drained = Instant::now() + Duration::from_secs(1);
    while output.iter().any(|t| !t.is_finished()) && Instant::now() < drained {
        std::thread::sleep(Duration::from_millis(10));
    }
    let failed = ranks.iter().filter(|r| !r.ok()).count();
    if failed == 0 && passed_on.is_none() {
        return Ok(());
    }
    let outcomes: Vec<String> = ranks
        .iter()
        .enumerate()
        .map(|(rank, r)| format!("rank {rank} {}", r.describe(passed_on)))
        .collect();
    for line in &outcomes {
        eprintln!("[launch] {line}");
    }
    match passed_on {
        Some(signal) => bail!(
            "the launcher got {} and passed it on to the job's {} ranks: {}",
            signal_name(signal),
            ranks.len(),
            outcomes.join(", ")
        ),
        None => bail!(
            "{failed} of the job's ranks failed ({} ranks in all): {}",
            ranks.len(),
            outcomes.join(", ")
        ),
    }
}
