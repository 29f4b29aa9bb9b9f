//! PyTorch pipelining's CSV form: one row per rank, one cell per step.
//!
//! An empty cell is an idle step; a composite reads `(0F7;7B3)OVERLAP_F_B` (its `;` keeps
//! it one cell). Rows may differ in length and carry no padding, and the file ends with a
//! newline: [`to_csv`] writes exactly what PyTorch writes, so a file read and written back
//! is byte-identical.

use super::{infer_stage_ranks, inferred_microbatches, name_placement, parse_step};
use crate::action::Action;
use crate::error::{Result, ScheduleError};
use crate::plan::Plan;

/// Parses a plan from CSV text; `file` names the source in errors.
///
/// The placement is inferred from the rows (a stage on two ranks is an error) and named
/// Contiguous, Looped or VShape when it matches one, else Custom; `stages` is the highest
/// stage + 1 and `microbatches` the highest micro-batch + 1.
pub fn parse_csv(text: &str, file: &str) -> Result<Plan> {
    let body = text.strip_suffix('\n').unwrap_or(text);
    if body.trim().is_empty() {
        return Err(ScheduleError::File {
            file: file.to_string(),
            reason: "no ranks: the file is empty (expected one row of actions per rank)".into(),
        });
    }
    let rows = body
        .split('\n')
        .enumerate()
        .map(|(rank, line)| parse_row(line.strip_suffix('\r').unwrap_or(line), file, rank))
        .collect::<Result<Vec<_>>>()?;
    let stage_rank = infer_stage_ranks(&rows, file)?;
    let placement = name_placement(&stage_rank, rows.len());
    super::check_placement(&placement, rows.len(), stage_rank.len(), file)?;
    Ok(Plan {
        stages: stage_rank.len(),
        microbatches: inferred_microbatches(&rows),
        placement,
        stage_rank,
        ranks: rows,
    })
}

/// One row: comma-separated cells, empty (or blank) = idle step.
fn parse_row(line: &str, file: &str, rank: usize) -> Result<Vec<Option<Action>>> {
    if line.is_empty() {
        return Ok(Vec::new());
    }
    line.split(',')
        .enumerate()
        .map(|(step, cell)| {
            let cell = cell.trim();
            if cell.is_empty() {
                Ok(None)
            } else {
                parse_step(cell, file, rank, step).map(Some)
            }
        })
        .collect()
}

/// Writes `plan` in PyTorch's CSV form: cells joined by `,`, idle steps empty, one
/// newline-terminated row per rank.
pub fn to_csv(plan: &Plan) -> String {
    let mut out = String::new();
    for row in &plan.ranks {
        for (i, cell) in row.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            if let Some(a) = cell {
                out.push_str(&a.to_string());
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Placement;

    #[test]
    fn parses_idle_cells_and_composites() {
        let text = "0F0,,(0F1;3B0)OVERLAP_F_B,3B1\n,1F0,2F0,\n";
        let p = parse_csv(text, "t.csv").unwrap();
        assert_eq!(p.num_ranks(), 2);
        assert_eq!(p.stages, 4);
        assert_eq!(p.microbatches, 2);
        assert_eq!(p.placement, Placement::VShape);
        assert_eq!(p.ranks[1].len(), 4, "a trailing empty cell is an idle step");
        assert_eq!(p.ranks[0][1], None);
        assert_eq!(p.ranks[1][0], None);
        assert_eq!(p.ranks[0][2].unwrap().to_string(), "(0F1;3B0)OVERLAP_F_B");
        assert_eq!(to_csv(&p), text);
    }

    #[test]
    fn composite_backward_half_names_a_stage_of_its_row() {
        // (0F1;1B0) on rank 0 puts stage 1 on rank 0, while row 1 holds it too.
        let text = "0F0,(0F1;1B0)OVERLAP_F_B\n1F0,1B0\n";
        let err = parse_csv(text, "t.csv").unwrap_err().to_string();
        assert_eq!(
            err,
            "t.csv: rank 1, step 0: `1F0`: stage 1 is placed on ranks 0 and 1"
        );
    }

    #[test]
    fn infers_placement_and_sizes() {
        let p = parse_csv("0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n", "t.csv").unwrap();
        assert_eq!(p.placement, Placement::Looped);
        assert_eq!(p.stage_rank, vec![0, 1, 0, 1]);
        let p = parse_csv("0F0,3F0\n1F0,2F0\n", "t.csv").unwrap();
        assert_eq!(p.placement, Placement::VShape);
        let p = parse_csv("0F0,1F0\n2F0,3F0\n", "t.csv").unwrap();
        assert_eq!(p.placement, Placement::Contiguous);
        let p = parse_csv("0F0,3F0\n1F0\n2F0\n", "t.csv").unwrap();
        assert_eq!(p.placement, Placement::Custom(vec![0, 1, 2, 0]));
    }

    #[test]
    fn errors_name_file_rank_step_and_text() {
        let err = parse_csv("0F0,0B0\n1F0,,1X0\n", "s.csv").unwrap_err();
        assert!(matches!(
            err,
            ScheduleError::Action {
                rank: 1,
                step: 2,
                ..
            }
        ));
        let msg = err.to_string();
        assert!(
            msg.starts_with("s.csv: rank 1, step 2: `1X0` is not an action"),
            "{msg}"
        );

        let msg = parse_csv("0F0,2F0\n1F0,2B0\n", "s.csv")
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "s.csv: rank 1, step 1: `2B0`: stage 2 is placed on ranks 0 and 1"
        );
        let msg = parse_csv("0F0,4000000000F0\n", "s.csv")
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with("s.csv: rank 0, step 1: `4000000000F0`: stage 4000000000 cannot exist"),
            "{msg}"
        );
        let msg = parse_csv("0F0,2F0,0B0\n", "s.csv").unwrap_err().to_string();
        assert!(
            msg.starts_with("s.csv: stage 1 appears in no rank's list"),
            "{msg}"
        );
        let msg = parse_csv("\n", "s.csv").unwrap_err().to_string();
        assert!(msg.starts_with("s.csv: no ranks"), "{msg}");
        let msg = parse_csv("0F0,1F0,2F0\n\n", "s.csv")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("rank 1 holds no stage"), "{msg}");
    }

    #[test]
    fn a_huge_bad_cell_is_quoted_cut_and_once() {
        let text = format!("0F0,{}\n", "x".repeat(10_000_000));
        let err = parse_csv(&text, "big.csv").unwrap_err();
        let msg = err.to_string();
        assert_eq!(
            msg,
            format!(
                "big.csv: rank 0, step 1: `{}… (10000000 characters)` is not an action: \
                 must start with the stage number",
                "x".repeat(40)
            )
        );
        // The parse error is part of the message, not a source a chain would print again.
        assert!(std::error::Error::source(&err).is_none());
    }

    #[test]
    fn accepts_crlf_and_a_missing_final_newline() {
        let p = parse_csv("0F0,0B0\r\n1F0,1B0", "t.csv").unwrap();
        assert_eq!(to_csv(&p), "0F0,0B0\n1F0,1B0\n");
    }
}
