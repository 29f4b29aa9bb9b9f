//! [`Engine`]: what differs between the ways `pipefill train` runs its steps (the reference
//! trainer, the in-process pipeline, a launched rank), and [`drive`]: the rest, written
//! once for all three: each step's tick and metrics line, the summary, the final
//! checkpoint, what follows it, and the `done:` line.

use std::path::Path;

use crate::config::JobConfig;
use crate::model::checkpoint::Checkpoint;
use crate::run::RunError;
use crate::run::show::{Bar, Show, step_tick};
use crate::run::{RunDir, RunLog, StepLine};

/// One way of running a job's steps.
pub(super) trait Engine {
    /// What the steps leave for [`Engine::checkpoint`] and [`Engine::after`].
    type Ran;
    /// Runs `steps` steps, handing each to `out` as it completes (a launched rank: once
    /// the steps' losses have reached rank 0).
    fn run(&mut self, steps: u64, out: &mut Steps<'_>) -> Result<Self::Ran, RunError>;
    /// The whole model after the run, for the run directory's `checkpoint/`; `None`: this
    /// engine has none to write.
    fn checkpoint(&mut self, ran: &mut Self::Ran) -> Result<Option<Checkpoint>, RunError>;
    /// What follows the final checkpoint in `dir`: profile files, the report, the held-out
    /// score. Returns the files of the run directory the `done:` line names.
    fn after(
        &mut self,
        ran: Self::Ran,
        dir: &Path,
        show: &mut dyn Show,
    ) -> Result<&'static str, RunError>;
}

/// Where an engine's completed steps go: the step bar, and `metrics.jsonl` where this
/// process writes the run directory.
pub(super) struct Steps<'a> {
    show: &'a mut dyn Show,
    log: Option<&'a mut RunLog>,
    /// The run's last step (`train.steps`).
    len: u64,
}

impl Steps<'_> {
    /// A completed step: its metrics `line`, and the `message` its tick shows. A line that
    /// cannot be written is the error that stops the run.
    pub(super) fn step(&mut self, line: &StepLine<'_>, message: &str) -> Result<(), RunError> {
        step_tick(self.show, Bar::Step, line.metrics().step, self.len, message);
        if let Some(log) = self.log.as_deref_mut() {
            log.record(line)?;
        }
        Ok(())
    }

    /// For the lines an engine shows while its steps run.
    pub(super) fn show(&mut self) -> &mut dyn Show {
        self.show
    }
}

/// Runs the `left` steps of `job` still to run on `engine` (the caller checked there are
/// some, [`crate::run::steps_left`], before opening the log). `run` is the run directory and
/// its log where this process writes them (a launched rank other than 0 writes nothing).
pub(super) fn drive<E: Engine>(
    job: &JobConfig,
    engine: &mut E,
    left: u64,
    run: Option<(&RunDir, RunLog)>,
    show: &mut dyn Show,
) -> Result<(), RunError> {
    let (dir, mut log) = run.unzip();
    let mut steps = Steps {
        show: &mut *show,
        log: log.as_mut(),
        len: job.train.steps,
    };
    let ran = engine.run(left, &mut steps);
    show.finish(Bar::Step, ran.is_ok());
    let mut ran = ran?;
    let (Some(dir), Some(log)) = (dir, log) else {
        return Ok(());
    };
    let summary = log.finish();
    if let Some(mut checkpoint) = engine.checkpoint(&mut ran)? {
        dir.save_final(&mut checkpoint, job)?;
    }
    let files = engine.after(ran, dir.path(), show)?;
    show.line(&format!(
        "done: {summary}; run directory {} ({files})",
        dir.path().display()
    ));
    if let Some(line) = crate::run::peak::peak_line() {
        show.line(&line);
    }
    Ok(())
}

/// The tick message of step `m`, every path alike: loss, learning rate, tokens/s, and the
/// step's measured bubble ratios where a pipeline measured its `timeline`.
pub(super) fn step_message(
    m: &crate::train::StepMetrics,
    timeline: Option<&crate::schedules::Timeline>,
) -> String {
    let mut line = format!(
        "loss {:.4} | lr {:.2e} | {:.0} tok/s",
        m.loss,
        m.lr,
        m.tokens_per_second()
    );
    if let Some(t) = timeline {
        line += &format!(
            " | bubble {:.1}% (steady {:.1}%)",
            100.0 * t.bubble_ratio,
            100.0 * t.steady_bubble_ratio
        );
    }
    line
}
