//! Custom schedule files: PyTorch pipelining's CSV form and pipefill's TOML form.
//!
//! Both hold one ordered action list per rank in the text grammar of [`crate::action`]
//! (an idle step is an empty CSV cell, or `_`/`.` in TOML). CSV carries no placement, so
//! the stage → rank table is inferred from which row each stage appears in; TOML may
//! state it. Parse errors name the file, the rank (row), the step (0-based cell position)
//! and the offending text. Whether the plan is *correct* (dependencies, deadlock,
//! memory) is the validator's job ([`crate::validate`](fn@crate::validate)), not the parser's.

mod csv;
mod toml;

use std::path::Path;

pub use self::csv::{parse_csv, to_csv};
pub use self::toml::{parse_toml, to_toml};

use crate::action::Action;
use crate::error::{Result, ScheduleError};
use crate::plan::{Placement, Plan};

/// Parses a schedule file's text, choosing the form by the extension of `file` (`.csv` or
/// `.toml`), which also names the file in errors. Reading the file is the caller's: this
/// crate does no I/O.
pub fn parse_plan(text: &str, file: &str) -> Result<Plan> {
    let ext = Path::new(file)
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let parse: fn(&str, &str) -> Result<Plan> = match ext.as_deref() {
        Some("csv") => parse_csv,
        Some("toml") => parse_toml,
        _ => {
            return Err(ScheduleError::File {
                file: file.to_string(),
                reason: "unknown schedule file type: expected a .csv (PyTorch pipelining) \
                         or .toml (pipefill) file"
                    .into(),
            });
        }
    };
    parse(text, file)
}

/// Parses one step's text (already trimmed, non-idle) into an action, naming where it was.
pub(crate) fn parse_step(text: &str, file: &str, rank: usize, step: usize) -> Result<Action> {
    text.parse().map_err(|error| ScheduleError::Action {
        file: file.to_string(),
        rank,
        step,
        error,
    })
}

/// The stage → rank table implied by which rank's list each stage appears in.
///
/// Every action (and an overlap's backward half, and SEND/RECV) names a stage held by the
/// rank whose list it is in; a stage seen on two ranks is an error, and so is a stage
/// below the highest one that appears nowhere (its rank cannot be known).
pub(crate) fn infer_stage_ranks(rows: &[Vec<Option<Action>>], file: &str) -> Result<Vec<usize>> {
    // Every stage needs an action, so no stage number can reach the count of actions:
    // checking that first keeps a typo like `4000000000F0` from sizing the table.
    let actions = rows.iter().flatten().flatten().count();
    let mut table: Vec<Option<usize>> = Vec::new();
    for (rank, row) in rows.iter().enumerate() {
        for (step, cell) in row.iter().enumerate() {
            let Some(action) = cell else { continue };
            let pair = action.pair.map(|p| p.stage);
            for stage in std::iter::once(action.stage).chain(pair) {
                let s = stage as usize;
                let at = |what: String| ScheduleError::File {
                    file: file.to_string(),
                    reason: format!("rank {rank}, step {step}: `{action}`: {what}"),
                };
                if s >= actions {
                    return Err(at(format!(
                        "stage {s} cannot exist: stages 0 to {s} would need at least one \
                         action each, and the file has {actions}"
                    )));
                }
                if s >= table.len() {
                    table.resize(s + 1, None);
                }
                match table[s] {
                    None => table[s] = Some(rank),
                    Some(r) if r == rank => {}
                    Some(r) => {
                        return Err(at(format!("stage {s} is placed on ranks {r} and {rank}")));
                    }
                }
            }
        }
    }
    table
        .iter()
        .enumerate()
        .map(|(s, r)| {
            r.ok_or_else(|| ScheduleError::File {
                file: file.to_string(),
                reason: format!(
                    "stage {s} appears in no rank's list, so its rank is unknown \
                     (stages run from 0 to {})",
                    table.len() - 1
                ),
            })
        })
        .collect()
}

/// Names a stage → rank table: the built-in placement it matches, else `Custom`.
pub(crate) fn name_placement(table: &[usize], ranks: usize) -> Placement {
    let stages = table.len();
    [Placement::Contiguous, Placement::Looped, Placement::VShape]
        .into_iter()
        .find(|p| p.check(ranks, stages).is_ok() && p.stage_ranks(ranks, stages) == table)
        .unwrap_or_else(|| Placement::Custom(table.to_vec()))
}

/// Largest micro-batch index named anywhere in `rows`, plus one (0 when there is none).
pub(crate) fn inferred_microbatches(rows: &[Vec<Option<Action>>]) -> usize {
    rows.iter()
        .flatten()
        .flatten()
        .flat_map(|a| std::iter::once(a.microbatch).chain(a.pair.map(|p| p.microbatch)))
        .map(|mb| mb as usize + 1)
        .max()
        .unwrap_or(0)
}

/// Checks that `placement` can hold `stages` stages on `ranks` ranks, as a file error.
pub(crate) fn check_placement(
    placement: &Placement,
    ranks: usize,
    stages: usize,
    file: &str,
) -> Result<()> {
    placement
        .check(ranks, stages)
        .map_err(|reason| ScheduleError::File {
            file: file.to_string(),
            reason: format!("placement {}: {reason}", placement.name()),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_plan_rejects_unknown_extensions() {
        let err = parse_plan("0F0", "plan.json").unwrap_err().to_string();
        assert!(
            err.starts_with("plan.json: unknown schedule file type"),
            "{err}"
        );
        assert!(parse_plan("0F0,0B0", "plan.CSV").is_ok());
    }

    #[test]
    fn names_the_built_in_placements() {
        assert_eq!(name_placement(&[0, 0, 1, 1], 2), Placement::Contiguous);
        assert_eq!(name_placement(&[0, 1, 0, 1], 2), Placement::Looped);
        assert_eq!(name_placement(&[0, 1, 1, 0], 2), Placement::VShape);
        assert_eq!(name_placement(&[0, 1, 2], 3), Placement::Contiguous);
        assert_eq!(
            name_placement(&[1, 0, 0, 1, 1, 0], 2),
            Placement::Custom(vec![1, 0, 0, 1, 1, 0])
        );
    }
}
