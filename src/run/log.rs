//! A training run's step log ([`RunLog`]): `metrics.jsonl` written a [`StepLine`] at a time
//! as the steps complete, and the steps kept for the closing [`RunSummary`]. The reference
//! trainer, the in-process pipeline and a launched job's rank 0 all log through it, so their
//! files carry the same fields and their `done:` lines the same figures.

use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::time::Instant;

use super::dir::RunDir;
use super::metrics::StepLine;
use crate::config::JobConfig;
use crate::model::checkpoint::resume::last_complete;
use crate::run::RunError;
use crate::train::StepMetrics;

/// Steps of the means at the start and the end of a run of `steps` in its summary: the
/// first and last 10%, at least one each (so a 4-step run compares its first step with its
/// last, not the whole run with itself).
pub fn summary_window(steps: usize) -> usize {
    (steps / 10).max(1).min(steps)
}

/// The steps a run starting at `first_step` has left of `steps`, or [`RunError::NothingToDo`].
pub fn steps_left(first_step: u64, steps: u64) -> Result<u64, RunError> {
    match steps.checked_sub(first_step) {
        Some(left) if left > 0 => Ok(left),
        _ => Err(RunError::NothingToDo { first_step, steps }),
    }
}

/// `metrics.jsonl` of a run, open for its steps, and the steps logged so far.
pub struct RunLog {
    file: BufWriter<File>,
    path: PathBuf,
    steps: Vec<StepMetrics>,
    started: Instant,
}

impl RunLog {
    /// Makes `run_dir` the run's ([`RunDir::create`]: `job.toml`, and `metrics.jsonl` for
    /// the steps from `first_step` on); the run's clock starts here.
    pub fn open(run_dir: &RunDir, job: &JobConfig, first_step: u64) -> Result<Self, RunError> {
        let file = run_dir.create(&job.to_toml(), first_step)?;
        Ok(RunLog {
            file,
            path: run_dir.path().join(super::dir::METRICS_FILE),
            steps: Vec::new(),
            started: Instant::now(),
        })
    }

    /// Restarts the run's clock: for a caller that opens the log well before its steps run
    /// (a launched rank 0 claims its directory before the ranks meet).
    pub fn start_clock(&mut self) {
        self.started = Instant::now();
    }

    /// Appends `line` and flushes it, so that the file follows the run. A line that cannot
    /// be written (a full disk) is the error that stops the run, naming the file and the
    /// checkpoint a resume would continue from.
    pub fn record(&mut self, line: &StepLine<'_>) -> Result<(), RunError> {
        let written = writeln!(self.file, "{}", line.to_json()).and_then(|()| self.file.flush());
        written.map_err(|cause| RunError::Metrics {
            last: self.path.parent().and_then(last_complete),
            path: self.path.clone(),
            cause,
        })?;
        self.steps.push(line.metrics().clone());
        Ok(())
    }

    /// The run's summary.
    pub fn finish(self) -> RunSummary {
        RunSummary::of(&self.steps, self.started.elapsed().as_secs_f64())
    }
}

/// What a run's `done:` line says: steps, seconds, tokens/s over the whole run, and the mean
/// loss of its first and last steps.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    pub steps: usize,
    pub seconds: f64,
    pub tokens: usize,
    /// Steps in each loss mean ([`summary_window`]).
    pub window: usize,
    pub first_loss: f32,
    pub last_loss: f32,
}

impl RunSummary {
    /// The summary of `steps` run in `seconds`.
    pub fn of(steps: &[StepMetrics], seconds: f64) -> Self {
        let window = summary_window(steps.len());
        let mean = |ms: &[StepMetrics]| match ms.len() {
            0 => f32::NAN,
            n => ms.iter().map(|m| m.loss).sum::<f32>() / n as f32,
        };
        RunSummary {
            steps: steps.len(),
            seconds,
            tokens: steps.iter().map(|m| m.tokens).sum(),
            window,
            first_loss: mean(&steps[..window]),
            last_loss: mean(&steps[steps.len() - window..]),
        }
    }
}

impl fmt::Display for RunSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} steps in {:.1} s, {:.0} tok/s; loss {:.4} → {:.4} (mean of first/last {} steps)",
            self.steps,
            self.seconds,
            self.tokens as f64 / self.seconds.max(1e-9),
            self.first_loss,
            self.last_loss,
            self.window
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64, loss: f32) -> StepMetrics {
        StepMetrics {
            step,
            loss,
            lr: 1e-3,
            grad_norm: 1.0,
            tokens: 100,
            seconds: 0.5,
        }
    }

    #[test]
    fn steps_left_counts_from_the_first_step_and_refuses_none_left() {
        assert_eq!(steps_left(0, 5).unwrap(), 5);
        assert_eq!(steps_left(3, 5).unwrap(), 2);
        for first_step in [5, 9] {
            let e = steps_left(first_step, 5).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "the checkpoint is at step {first_step}: nothing to do for train.steps = 5"
                )
            );
        }
    }

    #[test]
    fn the_summary_means_the_first_and_last_tenth_of_the_losses() {
        let steps: Vec<StepMetrics> = (0..100).map(|i| step(i, i as f32)).collect();
        let s = RunSummary::of(&steps, 8.0);
        assert_eq!((s.steps, s.tokens, s.window), (100, 10000, 10));
        assert_eq!((s.first_loss, s.last_loss), (4.5, 94.5));
        assert_eq!(
            s.to_string(),
            "100 steps in 8.0 s, 1250 tok/s; loss 4.5000 → 94.5000 (mean of first/last 10 steps)"
        );
        // Fewer than 20 steps: the first and the last step, never the run against itself.
        let s = RunSummary::of(&steps[..4], 1.0);
        assert_eq!((s.window, s.first_loss, s.last_loss), (1, 0.0, 3.0));
        assert_eq!(summary_window(25), 2);
        assert_eq!(summary_window(1), 1);
        assert_eq!(summary_window(0), 0);
    }

    /// A fresh run directory `run` under `root` and the default job's log opened in it.
    fn opened(root: &std::path::Path) -> (PathBuf, RunLog) {
        let path = root.join("run");
        let dir = RunDir::claim(
            Some(path.as_path()),
            "",
            super::super::Resume::Fresh,
            super::super::Existing::Refuse,
        )
        .unwrap();
        let job = JobConfig::embedded(&[]).unwrap();
        (path.clone(), RunLog::open(&dir, &job, 0).unwrap())
    }

    #[test]
    fn the_log_writes_each_line_as_it_comes_and_keeps_the_steps() {
        let root = tempfile::tempdir().unwrap();
        let (path, mut log) = opened(root.path());
        for i in 0..3 {
            log.record(&StepLine::new(&step(i, 2.0), None)).unwrap();
            let written = std::fs::read_to_string(path.join("metrics.jsonl")).unwrap();
            assert_eq!(written.lines().count(), i as usize + 1);
        }
        let summary = log.finish();
        assert_eq!((summary.steps, summary.tokens), (3, 300));
    }

    #[test]
    fn a_line_that_cannot_be_written_is_the_error_naming_the_file_and_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let (path, mut log) = opened(root.path());
        log.record(&StepLine::new(&step(0, 2.0), None)).unwrap();
        // The disk fills: every write of the file fails from here on.
        let full = std::fs::OpenOptions::new().append(true).open("/dev/full");
        let Ok(full) = full else {
            eprintln!("skipped: no /dev/full here");
            return;
        };
        log.file = BufWriter::new(full);
        let err = log.record(&StepLine::new(&step(1, 2.0), None)).unwrap_err();
        let metrics = path.join(super::super::dir::METRICS_FILE);
        assert!(
            matches!(&err, RunError::Metrics { path: p, last: None, .. } if p == &metrics),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("cannot write")
                && msg.contains("No space left on device")
                && msg.contains("the run stopped: it has no complete checkpoint"),
            "{msg}"
        );
        // The step that was not written is not in the summary either.
        assert_eq!(log.finish().steps, 1);
    }
}
