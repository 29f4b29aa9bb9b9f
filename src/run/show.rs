//! How a run shows itself. The runner says what happens ([`Show`]): lines for the user and
//! ticks of its progress; the CLI draws them (bars on a terminal, plain lines elsewhere), a
//! library caller or a test may drop them ([`Quiet`]). Nothing the runner shows is needed to
//! read its results: those are in the run directory.

/// Which progress a [`Tick`] advances.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bar {
    /// Records of a JSONL dataset tokenized.
    Tokenizing,
    /// Optimizer steps of `pipefill train`.
    Step,
    /// `pipefill rl`'s supervised warm-up steps.
    WarmUp,
    /// `pipefill rl`'s rollout batches.
    Rollout,
    /// `pipefill rl`'s pipelined updates.
    Update,
}

/// One advance of a progress bar.
#[derive(Debug, Clone, Copy)]
pub struct Tick<'a> {
    pub bar: Bar,
    /// Items done (this one included) and in all.
    pub pos: u64,
    pub len: u64,
    /// The last item's figures, short enough for a bar.
    pub message: &'a str,
    /// A line to print instead where no bar is drawn; `None`: nothing (the runner sends one
    /// only for the items worth a line of a log).
    pub plain: Option<&'a str>,
}

/// Where a run's lines and progress go.
pub trait Show {
    /// A line for the user: what runs, what was resumed, the summary (a report may be
    /// several lines in one text).
    fn line(&mut self, text: &str);
    /// Progress of one bar.
    fn tick(&mut self, tick: Tick<'_>);
    /// `bar` is done; `ok` false: the run stopped at an error.
    fn finish(&mut self, bar: Bar, ok: bool);
}

/// Shows nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct Quiet;

impl Show for Quiet {
    fn line(&mut self, _: &str) {}
    fn tick(&mut self, _: Tick<'_>) {}
    fn finish(&mut self, _: Bar, _: bool) {}
}

/// Shows 0-based `step` of `len` on `bar`, with the plain line `step N/len message` for
/// about 20 of a run's steps (and the last).
pub(crate) fn step_tick(show: &mut dyn Show, bar: Bar, step: u64, len: u64, message: &str) {
    let plain_every = (len / 20).max(1);
    let plain = (step.is_multiple_of(plain_every) || step + 1 == len)
        .then(|| format!("step {:>5}/{len} {message}", step + 1));
    show.tick(Tick {
        bar,
        pos: step + 1,
        len,
        message,
        plain: plain.as_deref(),
    });
}
