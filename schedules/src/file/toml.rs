//! pipefill's TOML form of a plan: readable, hand-editable, and able to state the placement.
//!
//! ```toml
//! stages = 4            # optional when inferable
//! microbatches = 8      # optional: highest micro-batch + 1
//! placement = "looped"  # contiguous | looped | v-shape | [0, 1, 1, 0]; optional (inferred)
//! [[rank]]
//! actions = "0F0 0F1 0I0 0W0 ..."   # whitespace-separated; "_" or "." is an idle step
//! ```
//!
//! When the placement is stated, it is taken as given and the validator checks every action
//! against it; when it is not, it is inferred from the rows exactly as for CSV.

use serde::Deserialize;

use super::{
    check_placement, infer_stage_ranks, inferred_microbatches, name_placement, parse_step,
};
use crate::action::Action;
use crate::error::{Result, ScheduleError, cut, cut_middle};
use crate::plan::{Placement, Plan};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanFile {
    stages: Option<usize>,
    microbatches: Option<usize>,
    /// A name or a stage → rank array; interpreted by hand for a clear error.
    placement: Option<::toml::Value>,
    #[serde(default)]
    rank: Vec<RankEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RankEntry {
    actions: String,
}

fn file_err(file: &str, reason: impl Into<String>) -> ScheduleError {
    ScheduleError::File {
        file: file.to_string(),
        reason: reason.into(),
    }
}

/// Parses a plan from TOML text; `file` names the source in errors.
pub fn parse_toml(text: &str, file: &str) -> Result<Plan> {
    let doc: PlanFile = ::toml::from_str(text).map_err(|e| {
        let line = e
            .span()
            .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        // A parser's message may quote the input: a huge bad value is cut.
        let msg = cut_middle(e.message().trim_end(), 160);
        match line {
            Some(l) => file_err(file, format!("line {l}: {msg}")),
            None => file_err(file, msg),
        }
    })?;
    if doc.rank.is_empty() {
        return Err(file_err(
            file,
            "no ranks: expected one [[rank]] table with `actions = \"...\"` per rank",
        ));
    }
    let rows = doc
        .rank
        .iter()
        .enumerate()
        .map(|(rank, entry)| parse_row(&entry.actions, file, rank))
        .collect::<Result<Vec<_>>>()?;
    let ranks = rows.len();

    let placement = doc
        .placement
        .as_ref()
        .map(|v| parse_placement(v, file))
        .transpose()?;
    let (placement, stage_rank, stages) = match placement {
        Some(placement) => {
            let stages = match (&placement, doc.stages) {
                (_, Some(n)) => n,
                (Placement::Custom(table), None) => table.len(),
                (_, None) => max_stage(&rows).map_or(0, |s| s + 1),
            };
            // Every stage needs an action: this also keeps a typo from sizing the table.
            let actions = rows.iter().flatten().flatten().count();
            if stages > actions {
                return Err(file_err(
                    file,
                    format!(
                        "{stages} stages, but the file has {actions} actions and every stage \
                         needs at least one"
                    ),
                ));
            }
            check_placement(&placement, ranks, stages, file)?;
            let table = placement.stage_ranks(ranks, stages);
            (placement, table, stages)
        }
        None => {
            let table = infer_stage_ranks(&rows, file)?;
            if let Some(n) = doc.stages.filter(|&n| n != table.len()) {
                return Err(file_err(
                    file,
                    format!(
                        "stages = {n}, but with no placement given the actions name stages \
                         0 to {} (state `placement` to place stages that have no actions)",
                        table.len() as isize - 1
                    ),
                ));
            }
            let placement = name_placement(&table, ranks);
            check_placement(&placement, ranks, table.len(), file)?;
            let stages = table.len();
            (placement, table, stages)
        }
    };
    let microbatches = doc
        .microbatches
        .unwrap_or_else(|| inferred_microbatches(&rows));
    check_ranges(&rows, stages, microbatches, file)?;
    Ok(Plan {
        stages,
        microbatches,
        placement,
        stage_rank,
        ranks: rows,
    })
}

/// One rank's `actions` string: whitespace-separated steps, `_` or `.` idle.
fn parse_row(text: &str, file: &str, rank: usize) -> Result<Vec<Option<Action>>> {
    text.split_whitespace()
        .enumerate()
        .map(|(step, tok)| match tok {
            "_" | "." => Ok(None),
            _ => parse_step(tok, file, rank, step).map(Some),
        })
        .collect()
}

fn parse_placement(v: &::toml::Value, file: &str) -> Result<Placement> {
    let bad = || {
        file_err(
            file,
            format!(
                "placement = {}: expected \"contiguous\", \"looped\", \"v-shape\" \
                 or an array giving each stage's rank",
                cut(&v.to_string())
            ),
        )
    };
    match v {
        ::toml::Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "contiguous" => Ok(Placement::Contiguous),
            "looped" => Ok(Placement::Looped),
            "v-shape" | "vshape" | "v" => Ok(Placement::VShape),
            _ => Err(bad()),
        },
        ::toml::Value::Array(items) => items
            .iter()
            .map(|x| match x {
                ::toml::Value::Integer(r) => usize::try_from(*r).map_err(|_| bad()),
                _ => Err(bad()),
            })
            .collect::<Result<Vec<_>>>()
            .map(Placement::Custom),
        _ => Err(bad()),
    }
}

fn max_stage(rows: &[Vec<Option<Action>>]) -> Option<usize> {
    rows.iter()
        .flatten()
        .flatten()
        .flat_map(|a| std::iter::once(a.stage).chain(a.pair.map(|p| p.stage)))
        .map(|s| s as usize)
        .max()
}

/// Every stage and micro-batch an action names must exist in the plan.
fn check_ranges(
    rows: &[Vec<Option<Action>>],
    stages: usize,
    microbatches: usize,
    file: &str,
) -> Result<()> {
    for (rank, row) in rows.iter().enumerate() {
        for (step, a) in row.iter().enumerate() {
            let Some(a) = a else { continue };
            for part in a.parts() {
                let what = if part.stage as usize >= stages {
                    format!("stage {}, but the plan has {stages} stages", part.stage)
                } else if part.microbatch as usize >= microbatches {
                    format!(
                        "micro-batch {}, but the plan has {microbatches} micro-batches",
                        part.microbatch
                    )
                } else {
                    continue;
                };
                return Err(file_err(
                    file,
                    format!("rank {rank}, step {step}: `{a}` names {what}"),
                ));
            }
        }
    }
    Ok(())
}

/// Writes `plan` in the TOML form; [`parse_toml`] reads it back to an equal plan.
pub fn to_toml(plan: &Plan) -> String {
    let mut out = String::new();
    out.push_str(&format!("stages = {}\n", plan.stages));
    out.push_str(&format!("microbatches = {}\n", plan.microbatches));
    match &plan.placement {
        Placement::Custom(table) => {
            let items: Vec<String> = table.iter().map(|r| r.to_string()).collect();
            out.push_str(&format!("placement = [{}]\n", items.join(", ")));
        }
        p => out.push_str(&format!("placement = \"{}\"\n", p.name())),
    }
    for row in &plan.ranks {
        let steps: Vec<String> = row
            .iter()
            .map(|a| a.map_or_else(|| "_".to_string(), |a| a.to_string()))
            .collect();
        out.push_str(&format!("\n[[rank]]\nactions = \"{}\"\n", steps.join(" ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOOPED: &str = r#"
stages = 4
microbatches = 2
placement = "looped"

[[rank]]
actions = "0F0 0F1 2F0 _ 2F1 2B0 0B0 2B1 0B1"

[[rank]]
actions = ". 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"
"#;

    #[test]
    fn parses_the_documented_form() {
        let p = parse_toml(LOOPED, "l.toml").unwrap();
        assert_eq!(p.stages, 4);
        assert_eq!(p.microbatches, 2);
        assert_eq!(p.placement, Placement::Looped);
        assert_eq!(p.stage_rank, vec![0, 1, 0, 1]);
        assert_eq!(p.ranks[0][3], None);
        assert_eq!(p.ranks[1][0], None);
        assert_eq!(p.ranks[1][3], Some(Action::f(3, 0)));
    }

    #[test]
    fn round_trips_through_to_toml() {
        let p = parse_toml(LOOPED, "l.toml").unwrap();
        assert_eq!(parse_toml(&to_toml(&p), "x.toml").unwrap(), p);
        let mut custom = p.clone();
        custom.placement = Placement::Custom(vec![0, 1, 0, 1]);
        let text = to_toml(&custom);
        assert!(text.contains("placement = [0, 1, 0, 1]"), "{text}");
        assert_eq!(parse_toml(&text, "x.toml").unwrap(), custom);
    }

    #[test]
    fn infers_what_is_left_out() {
        let p = parse_toml(
            "[[rank]]\nactions = \"0F0 1F0 1B0 0B0\"\n[[rank]]\nactions = \"2F0 3F0 3B0 2B0\"",
            "t.toml",
        )
        .unwrap();
        assert_eq!(p.stages, 4);
        assert_eq!(p.microbatches, 1);
        assert_eq!(p.placement, Placement::Contiguous);
    }

    #[test]
    fn errors_name_file_rank_step_and_text() {
        let bad = LOOPED.replace("3B0 3F1", "3B0 3Q1");
        let err = parse_toml(&bad, "l.toml").unwrap_err();
        assert!(
            matches!(
                err,
                ScheduleError::Action {
                    rank: 1,
                    step: 5,
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string()
                .starts_with("l.toml: rank 1, step 5: `3Q1` is not an action")
        );

        let bad = LOOPED.replace("0B1\"", "0B2\"");
        let msg = parse_toml(&bad, "l.toml").unwrap_err().to_string();
        assert_eq!(
            msg,
            "l.toml: rank 0, step 8: `0B2` names micro-batch 2, but the plan has 2 micro-batches"
        );

        let bad = LOOPED.replace("\"looped\"", "\"ring\"");
        let msg = parse_toml(&bad, "l.toml").unwrap_err().to_string();
        assert!(
            msg.starts_with("l.toml: placement = \"ring\": expected"),
            "{msg}"
        );

        let bad = LOOPED.replace("stages = 4", "stages = 3");
        let msg = parse_toml(&bad, "l.toml").unwrap_err().to_string();
        assert!(msg.contains("do not divide evenly"), "{msg}");

        let msg = parse_toml("stages = 2\nrank = 3\n", "t.toml")
            .unwrap_err()
            .to_string();
        assert!(msg.starts_with("t.toml: line 2:"), "{msg}");
        let huge = LOOPED.replace("stages = 4", "stages = 4000000000");
        let msg = parse_toml(&huge, "l.toml").unwrap_err().to_string();
        assert!(
            msg.starts_with("l.toml: 4000000000 stages, but the file has 16 actions"),
            "{msg}"
        );
        let msg = parse_toml("stages = 2\n", "t.toml")
            .unwrap_err()
            .to_string();
        assert!(msg.starts_with("t.toml: no ranks"), "{msg}");
        let msg = parse_toml("[[rank]]\nactoins = \"0F0\"\n", "t.toml")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("actoins"), "{msg}");
    }

    #[test]
    fn huge_bad_values_are_not_echoed_whole() {
        let long = "x".repeat(1_000_000);
        let bad = LOOPED.replace("\"looped\"", &format!("\"{long}\""));
        let msg = parse_toml(&bad, "l.toml").unwrap_err().to_string();
        assert!(msg.starts_with("l.toml: placement = \"xxx"), "{msg}");
        assert!(msg.contains("(1000002 characters)"), "{msg}");
        assert!(msg.len() < 300, "{} bytes", msg.len());
        // A parser's own message quoting the value is cut too.
        let bad = format!("stages = \"{long}\"\n[[rank]]\nactions = \"0F0 0B0\"\n");
        let msg = parse_toml(&bad, "t.toml").unwrap_err().to_string();
        assert!(msg.starts_with("t.toml: line 1: "), "{msg}");
        assert!(msg.len() < 300, "{} bytes: {}", msg.len(), &msg[..300]);
        let cell = format!("[[rank]]\nactions = \"0F0 {long}\"\n");
        let msg = parse_toml(&cell, "t.toml").unwrap_err().to_string();
        assert!(
            msg.contains("(1000000 characters)` is not an action"),
            "{msg}"
        );
    }
}
