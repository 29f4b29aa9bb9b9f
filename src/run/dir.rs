//! The run directory ([`RunDir`]): the one place that decides whether a run may write into
//! a directory, and that creates it.
//!
//! A user's finished run is never overwritten by accident. A directory that already holds
//! anything is refused unless the run continues it (`--resume` from a checkpoint inside it)
//! or the user asked for `--overwrite`. The check ([`RunDir::claim`]) only reads, so every
//! rank of a launched job can make it before any rank writes; the writes
//! ([`RunDir::create`]) come after the job has been checked against its checkpoint, so a
//! start that fails changes no file.

use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::JobConfig;
use crate::model::checkpoint::Checkpoint;
use crate::model::checkpoint::resume::FINAL_DIR;
use crate::model::checkpoint::sweep::{Sweep, sweep_run};
use crate::profile::report::{REPORT_JSON, REPORT_TXT};
use crate::run::RunError;

/// The job file a run directory holds.
pub const JOB_FILE: &str = "job.toml";
/// One JSON line per step.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// The Chrome/Perfetto trace of a pipelined run.
pub const TRACE_FILE: &str = "trace.json";
/// The SVG timeline of a pipelined run's reported step.
pub const TIMELINE_FILE: &str = "timeline.svg";

/// Every file a pipefill run writes into its directory besides its checkpoints: what
/// `--overwrite` removes with the files of `checkpoint/` and `checkpoints/` (and nothing
/// else: a file of the user's in the same directory stays).
const RUN_FILES: [&str; 6] = [
    JOB_FILE,
    METRICS_FILE,
    REPORT_JSON,
    REPORT_TXT,
    TRACE_FILE,
    TIMELINE_FILE,
];

/// What a run continues from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume<'a> {
    /// The command cannot continue a run (`pipefill rl`).
    Unsupported,
    /// A fresh run.
    Fresh,
    /// The checkpoint (or run directory) given to `--resume`.
    From(&'a Path),
}

/// How a run treats a directory that already holds files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Existing {
    /// Refuse it (the default).
    #[default]
    Refuse,
    /// Replace the run in it (`--overwrite`): its run files go, other files stay.
    Overwrite,
}

impl Existing {
    /// `--overwrite`'s choice: [`Existing::Overwrite`] when given.
    pub fn overwrite(given: bool) -> Self {
        match given {
            true => Existing::Overwrite,
            false => Existing::Refuse,
        }
    }
}

/// A run directory that a run has been allowed to write (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunDir {
    path: PathBuf,
    /// The directory holds the run that this one continues: its metrics are kept.
    continues: bool,
    /// The directory holds files that `--overwrite` replaces.
    replaces: bool,
}

impl RunDir {
    /// Checks, reading only, that a run may write into `path` (the job's `out_dir`; `None`:
    /// a fresh `runs/<prefix><UTC time>`). A directory that holds the checkpoint the run
    /// resumes from is the run being continued.
    pub fn claim(
        path: Option<&Path>,
        prefix: &str,
        resume: Resume,
        existing: Existing,
    ) -> Result<RunDir, RunError> {
        let path = match path {
            Some(p) if p.as_os_str().is_empty() => return Err(RunError::EmptyOutDir),
            Some(p) => p.to_path_buf(),
            None => fresh_default(Path::new("runs"), prefix, now()),
        };
        let io_err = |source| RunError::RunDirIo {
            path: path.clone(),
            source,
        };
        let entries = match fs::read_dir(&path) {
            Ok(entries) => entries
                .map(|e| e.map(|e| e.file_name()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(io_err)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io_err(e)),
        };
        let mut dir = RunDir {
            path,
            continues: false,
            replaces: false,
        };
        if entries.is_empty() {
            return Ok(dir);
        }
        if let Resume::From(r) = resume
            && inside(r, &dir.path)
        {
            dir.continues = true;
            return Ok(dir);
        }
        if existing == Existing::Overwrite {
            dir.replaces = true;
            return Ok(dir);
        }
        let mut names: Vec<String> = entries
            .iter()
            .map(|n| n.to_string_lossy().into_owned())
            .collect();
        names.sort();
        let what = match names.iter().any(|n| n == JOB_FILE) {
            true => "a run (job.toml)".to_string(),
            false => {
                let shown: Vec<&str> = names.iter().take(3).map(String::as_str).collect();
                let more = names.len().saturating_sub(shown.len());
                let more = if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                };
                format!("{}{more}", shown.join(", "))
            }
        };
        Err(RunError::NotEmpty {
            path: dir.path,
            what,
            resumable: resume != Resume::Unsupported,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the run continues the one already in the directory.
    pub fn continues(&self) -> bool {
        self.continues
    }

    /// Makes the directory the run's: removes a replaced run's files (`--overwrite`), or in
    /// a continued run what a checkpoint write that was killed left, creates it, writes
    /// `job.toml` and opens `metrics.jsonl` for the steps from `first_step` on. A continued run keeps the lines of the steps before `first_step`
    /// and drops the rest (the steps after its checkpoint, which it runs again); any other
    /// run starts the file empty.
    pub fn create(&self, job_toml: &str, first_step: u64) -> Result<BufWriter<File>, RunError> {
        let io_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| RunError::RunDirIo { path, source }
        };
        if self.replaces {
            self.remove_run_files()?;
        } else if self.continues {
            // What a run killed while writing a checkpoint left: temporary files and
            // step directories without a manifest (a complete checkpoint stays whole).
            let removed = sweep_run(&self.path, Sweep::Leftovers)?;
            if !removed.is_empty() {
                tracing::info!(
                    "removed {} leftovers of interrupted checkpoint writes in {}",
                    removed.len(),
                    self.path.display()
                );
            }
        }
        fs::create_dir_all(&self.path).map_err(io_err(&self.path))?;
        let job = self.path.join(JOB_FILE);
        fs::write(&job, job_toml).map_err(io_err(&job))?;
        let metrics = self.path.join(METRICS_FILE);
        let kept = match self.continues {
            true => self.metrics_before(first_step)?,
            false => Vec::new(),
        };
        // The kept lines go to a new file renamed over the old one: a crash part-way leaves
        // either file whole.
        let partial = self.path.join(format!("{METRICS_FILE}.partial"));
        let mut out = File::create(&partial).map_err(io_err(&partial))?;
        for line in &kept {
            writeln!(out, "{line}").map_err(io_err(&partial))?;
        }
        out.sync_all().map_err(io_err(&partial))?;
        fs::rename(&partial, &metrics).map_err(io_err(&metrics))?;
        let file = File::options()
            .append(true)
            .open(&metrics)
            .map_err(io_err(&metrics))?;
        Ok(BufWriter::new(file))
    }

    /// Saves the run's final `checkpoint` into `checkpoint/`, with the job it was trained
    /// with (`job.toml`) and its schedule among its notes; returns its directory.
    pub fn save_final(
        &self,
        checkpoint: &mut Checkpoint,
        job: &JobConfig,
    ) -> Result<PathBuf, RunError> {
        let notes = &mut checkpoint.meta.notes;
        notes.insert(JOB_FILE.into(), job.to_toml());
        notes.insert("schedule".into(), job.schedule.to_string());
        let dir = self.path.join(FINAL_DIR);
        checkpoint.save(&dir)?;
        Ok(dir)
    }

    /// The lines of `metrics.jsonl` whose step is before `first_step`.
    fn metrics_before(&self, first_step: u64) -> Result<Vec<String>, RunError> {
        let path = self.path.join(METRICS_FILE);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(RunError::RunDirIo { path, source }),
        };
        let mut kept = Vec::new();
        for (i, line) in BufReader::new(file).lines().enumerate() {
            let line = line.map_err(|source| RunError::RunDirIo {
                path: path.clone(),
                source,
            })?;
            if line.trim().is_empty() {
                continue;
            }
            let bad = |reason: String| RunError::BadMetrics {
                path: path.clone(),
                line: i + 1,
                reason,
            };
            let value: serde_json::Value =
                serde_json::from_str(&line).map_err(|e| bad(e.to_string()))?;
            let step = value
                .get("step")
                .and_then(serde_json::Value::as_u64)
                .ok_or_else(|| bad("no integer \"step\"".into()))?;
            if step < first_step {
                kept.push(line);
            }
        }
        Ok(kept)
    }

    /// Removes what a previous run wrote: its files among [`RUN_FILES`], and in
    /// `checkpoint/` and `checkpoints/` only the files of its checkpoints
    /// ([`sweep_run`]: a user's file or folder there stays, and so does the directory
    /// holding it).
    fn remove_run_files(&self) -> Result<(), RunError> {
        for name in RUN_FILES {
            let path = self.path.join(name);
            let removed = match fs::symlink_metadata(&path) {
                // A file of the run's; a directory (or a symlink) under its name is not.
                Ok(m) if m.is_file() => fs::remove_file(&path),
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => Err(e),
            };
            removed.map_err(|source| RunError::RunDirIo { path, source })?;
        }
        sweep_run(&self.path, Sweep::Everything)?;
        Ok(())
    }
}

/// Whether `path` is `dir` or lies inside it (both resolved; a path that does not exist is
/// inside nothing).
fn inside(path: &Path, dir: &Path) -> bool {
    match (path.canonicalize(), dir.canonicalize()) {
        (Ok(p), Ok(d)) => p.starts_with(d),
        _ => false,
    }
}

/// Seconds since the Unix epoch.
fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `root/<prefix><UTC time of secs>`, with `-2`, `-3`, ... appended while that name is taken
/// (two runs started in the same second).
fn fresh_default(root: &Path, prefix: &str, secs: u64) -> PathBuf {
    let base = format!("{prefix}{}", utc_stamp(secs));
    let mut path = root.join(&base);
    let mut n = 2u32;
    while fs::symlink_metadata(&path).is_ok() {
        path = root.join(format!("{base}-{n}"));
        n += 1;
    }
    path
}

/// `YYYYMMDD-HHMMSS` of a Unix time (civil-from-days, proleptic Gregorian calendar).
pub fn utc_stamp(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
#[path = "dir_tests.rs"]
mod tests;
