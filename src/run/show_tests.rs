//! A [`Show`] that records what a run showed, for the runners' tests.

use super::show::{Bar, Show, Tick};

/// Everything a run showed, in order.
#[derive(Debug, Default)]
pub(crate) struct Recorded {
    pub(crate) lines: Vec<String>,
    /// `(bar, pos, len, plain line)` of every tick.
    pub(crate) ticks: Vec<(Bar, u64, u64, Option<String>)>,
    /// `(bar, ok)` of every finish.
    pub(crate) finished: Vec<(Bar, bool)>,
}

impl Recorded {
    /// The ticks of `bar`: `(pos, len)`.
    pub(crate) fn of(&self, bar: Bar) -> Vec<(u64, u64)> {
        self.ticks
            .iter()
            .filter(|t| t.0 == bar)
            .map(|t| (t.1, t.2))
            .collect()
    }

    /// The line starting with `prefix`, if one was shown.
    pub(crate) fn line(&self, prefix: &str) -> Option<&str> {
        self.lines
            .iter()
            .find(|l| l.starts_with(prefix))
            .map(String::as_str)
    }
}

impl Show for Recorded {
    fn line(&mut self, text: &str) {
        self.lines.push(text.to_string());
    }
    fn tick(&mut self, t: Tick<'_>) {
        self.ticks
            .push((t.bar, t.pos, t.len, t.plain.map(str::to_string)));
    }
    fn finish(&mut self, bar: Bar, ok: bool) {
        self.finished.push((bar, ok));
    }
}
