//! Errors of the schedules crate: each names what is wrong and where.

use crate::action::ParseActionError;

/// Everything that can go wrong building, reading, checking or simulating a plan.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    /// A generator cannot build a plan for these parameters (e.g. `m < p` for 1F1B).
    #[error("{schedule}: {reason}")]
    Unsupported { schedule: String, reason: String },

    /// The schedule name is not one of the built-in generators.
    #[error(
        "unknown schedule `{0}` (built-in: gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zb-h2, zb-v, dualpipe-v)"
    )]
    UnknownSchedule(String),

    /// A schedule file cannot be read or parsed.
    #[error("{file}: {reason}")]
    File { file: String, reason: String },

    /// An action's text is malformed, with where it was found. (The parse error is part
    /// of this message, not a separate source, so a chain of causes prints it once.)
    #[error("{file}: rank {rank}, step {step}: {error}")]
    Action {
        file: String,
        rank: usize,
        step: usize,
        error: ParseActionError,
    },

    /// The plan breaks a rule: `at` says where (e.g. "rank 1, step 14"), `rule` what.
    #[error("{at}: {rule}")]
    Invalid { at: String, rule: String },

    /// The plan as a whole breaks a rule that no single step is to blame for
    /// (e.g. "stage 2, micro-batch 3 has no forward", "stage 5 is placed on ranks 0 and 2").
    #[error("{0}")]
    Plan(String),

    /// The plan hangs under blocking point-to-point semantics.
    #[error("deadlock: {0}")]
    Deadlock(String),

    /// A simulated time is past the largest finite `f64`: the costs are too large.
    #[error(
        "rank {rank}, step {step} ({action}): the simulated time overflows (it passes {max:e}); \
         the costs are too large"
    , max = f64::MAX)]
    TimeOverflow {
        rank: usize,
        step: usize,
        action: String,
    },

    /// Peak activation memory exceeds the limit.
    #[error("rank {rank} needs {peak} units of activation memory, over the limit of {limit}")]
    Memory { rank: usize, peak: f64, limit: f64 },
}

pub type Result<T, E = ScheduleError> = std::result::Result<T, E>;

/// Most characters of a piece of input (a cell, a value) an error quotes.
pub const QUOTE_CHARS: usize = 40;

/// `text` as an error quotes it: whole when short, else its first [`QUOTE_CHARS`]
/// characters, an ellipsis and its length, so a huge bad cell is not echoed whole.
pub fn cut(text: &str) -> String {
    match text.char_indices().nth(QUOTE_CHARS) {
        None => text.to_string(),
        Some((end, _)) => format!("{}… ({} characters)", &text[..end], text.chars().count()),
    }
}

/// A message (a parser's, which may quote the input) of at most `max` characters: its head
/// and tail around an ellipsis and its length when longer.
pub fn cut_middle(text: &str, max: usize) -> String {
    let n = text.chars().count();
    if n <= max {
        return text.to_string();
    }
    let head: String = text.chars().take(max * 2 / 3).collect();
    let tail: String = text.chars().skip(n - max / 3).collect();
    format!("{head}…{tail} ({n} characters)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_quotes_are_cut_with_their_length() {
        assert_eq!(cut("0X3"), "0X3");
        let exact = "x".repeat(QUOTE_CHARS);
        assert_eq!(cut(&exact), exact);
        let long = "é".repeat(10_000_000);
        let shown = cut(&long);
        assert_eq!(shown, format!("{}… (10000000 characters)", "é".repeat(40)));
        let msg = format!(
            "invalid type: string \"{}\", expected a sequence",
            "y".repeat(5000)
        );
        let shown = cut_middle(&msg, 120);
        assert!(shown.starts_with("invalid type: string \"yyy"), "{shown}");
        assert!(
            shown.ends_with("expected a sequence (5044 characters)"),
            "{shown}"
        );
        assert!(shown.chars().count() < 150, "{shown}");
        assert_eq!(cut_middle("short", 120), "short");
    }
}
