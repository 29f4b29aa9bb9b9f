//! [`Terminal`]: how the CLI shows a run ([`pipefill::run::Show`]). On a terminal each
//! [`Bar`] is an indicatif bar (several at once for `pipefill rl`); elsewhere (a pipe, a
//! file, a launched rank's prefixed output) the bars are hidden and the runner's plain lines
//! are printed instead.

use std::collections::HashMap;

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use pipefill::run::{Bar, Show, Tick};

#[derive(Default)]
pub struct Terminal {
    bars: MultiProgress,
    open: HashMap<Bar, ProgressBar>,
    /// Lines (and plain progress lines) go to stderr: a command whose stdout is JSON.
    stderr: bool,
}

impl Terminal {
    /// Prints the runner's lines on stderr when `stderr`.
    pub fn lines_to_stderr(mut self, stderr: bool) -> Self {
        self.stderr = stderr;
        self
    }

    fn bar(&mut self, bar: Bar, len: u64) -> &ProgressBar {
        self.open.entry(bar).or_insert_with(|| {
            let template = match bar {
                Bar::Tokenizing => {
                    "tokenizing {bar:30} {pos}/{len} records, {msg} [{elapsed}]".to_string()
                }
                Bar::Step => "{bar:30} step {pos}/{len} {msg} [{elapsed} < {eta}]".to_string(),
                Bar::WarmUp => "warm-up {bar:30} {pos}/{len} {msg}".to_string(),
                Bar::Rollout => "rollout {bar:30} {pos}/{len} {msg}".to_string(),
                Bar::Update => "update  {bar:30} {pos}/{len} {msg}".to_string(),
            };
            let style = ProgressStyle::with_template(&template).expect("valid template");
            self.bars.add(ProgressBar::new(len).with_style(style))
        })
    }
}

impl Terminal {
    /// Prints `text` on this terminal's stream.
    fn print(&self, text: &str) {
        match self.stderr {
            true => eprintln!("{text}"),
            false => println!("{text}"),
        }
    }
}

impl Show for Terminal {
    fn line(&mut self, text: &str) {
        // While bars are drawn they are lifted off for the line, which then stays above them.
        if self.bars.is_hidden() || self.open.is_empty() {
            self.print(text);
        } else {
            self.bars.suspend(|| self.print(text));
        }
    }

    fn tick(&mut self, tick: Tick<'_>) {
        let hidden = self.bar(tick.bar, tick.len).is_hidden();
        if hidden && let Some(plain) = tick.plain {
            self.print(plain);
        }
        let bar = &self.open[&tick.bar];
        bar.set_length(tick.len);
        bar.set_position(tick.pos);
        bar.set_message(tick.message.to_string());
    }

    fn finish(&mut self, bar: Bar, ok: bool) {
        let Some(b) = self.open.remove(&bar) else {
            return;
        };
        match (bar, ok) {
            (Bar::Tokenizing, _) => b.finish_and_clear(),
            (_, true) => b.finish(),
            (_, false) => b.abandon(),
        }
    }
}
