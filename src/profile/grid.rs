//! The text grid people draw pipeline schedules with: one row per rank, one column per time
//! step, a cell per action (`F3`, `I3`, `W3`, `B3`, or `2F3` with the stage when a rank holds
//! several), blank where the rank idles.
//!
//! A column is one `unit` of time (a unit-cost timeline — every F, I and W costing 1 — makes
//! each column one action, the usual drawing). An action longer than one unit (a full
//! backward B = I + W, an overlapped F+B) writes its label in its first column and `-` in
//! the columns it continues over, so the picture keeps true proportions.

use pipefill_schedules::Timeline;

use super::action_label;

/// How to draw the grid.
#[derive(Clone, Debug)]
pub struct GridOptions {
    /// Time one column stands for, in the timeline's units (1 for a unit-cost timeline).
    pub unit: f64,
    /// Prefix each label with its stage (`2F3`): needed when a rank holds more than one stage.
    pub show_stage: bool,
}

impl Default for GridOptions {
    fn default() -> Self {
        GridOptions {
            unit: 1.0,
            show_stage: false,
        }
    }
}

/// Draws `timeline` as a text grid (see the module docs). Every line ends in `\n`.
///
/// Spans are placed at the column nearest to their start and cover at least one column; on
/// a timeline whose costs are multiples of `unit` this is exact.
pub fn grid(timeline: &Timeline, opts: &GridOptions) -> String {
    let unit = if opts.unit > 0.0 { opts.unit } else { 1.0 };
    let t0 = timeline.start();
    let steps = (timeline.makespan / unit).round().max(0.0) as usize;
    let n_ranks = timeline.ranks.len();

    // One cell per (rank, step): Some((label, is_first)) when busy.
    let mut cells: Vec<Vec<Option<(String, bool)>>> = vec![vec![None; steps]; n_ranks];
    let mut width = 3;
    for span in &timeline.spans {
        let first = ((span.start - t0) / unit).round() as usize;
        let last = (((span.end - t0) / unit).round() as usize).max(first + 1);
        let label = action_label(&span.action, opts.show_stage);
        width = width.max(label.chars().count() + 1);
        let Some(row) = cells.get_mut(span.rank) else {
            continue;
        };
        if row.len() < last {
            row.resize(last, None);
        }
        row[first] = Some((label, true));
        for cell in &mut row[first + 1..last] {
            *cell = Some((String::new(), false));
        }
    }
    let columns = cells.iter().map(Vec::len).max().unwrap_or(0);

    let row_head = |r: usize| format!("rank {r}");
    let head_width = row_head(n_ranks.saturating_sub(1)).len() + 2;
    let mut out = String::new();

    // Header: the step index over each column (every 5th when the indices do not fit).
    let digits = columns.saturating_sub(1).to_string().len();
    let every = if digits < width { 1 } else { 5 };
    let mut header = format!("{:head_width$}", "step");
    for c in 0..columns {
        let cell = if c % every == 0 {
            c.to_string()
        } else {
            String::new()
        };
        header.push_str(&format!("{cell:width$}"));
    }
    out.push_str(header.trim_end());
    out.push('\n');

    for (r, row) in cells.iter().enumerate() {
        let mut line = format!("{:head_width$}", row_head(r));
        for cell in row {
            match cell {
                Some((label, true)) => line.push_str(&format!("{label:width$}")),
                // A continuation column: dashes, leaving one space before the next cell.
                Some((_, false)) => {
                    line.push_str(&"-".repeat(width - 1));
                    line.push(' ');
                }
                None => line.push_str(&" ".repeat(width)),
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::test_support::two_rank_timeline;

    #[test]
    fn draws_one_row_per_rank_with_idle_blank() {
        let g = grid(&two_rank_timeline(), &GridOptions::default());
        let lines: Vec<&str> = g.lines().collect();
        assert_eq!(lines.len(), 3, "{g}");
        // Cell width: the widest label `F2+B1` plus one space.
        assert_eq!(
            lines[0],
            "step    0     1     2     3     4     5     6     7"
        );
        assert_eq!(
            lines[1],
            "rank 0  F0    F1          I0    W0    F2+B1 ----- -----"
        );
        assert_eq!(
            lines[2],
            "rank 1        F0    B0    -----             B1    -----"
        );
    }

    #[test]
    fn shows_stage_when_asked() {
        let g = grid(
            &two_rank_timeline(),
            &GridOptions {
                unit: 1.0,
                show_stage: true,
            },
        );
        assert!(g.contains("0F0"), "{g}");
        assert!(g.contains("1B0"), "{g}");
        assert!(g.contains("0F2+0B1"), "{g}");
    }

    #[test]
    fn a_coarser_unit_halves_the_columns() {
        let g = grid(
            &two_rank_timeline(),
            &GridOptions {
                unit: 2.0,
                show_stage: false,
            },
        );
        let header = g.lines().next().unwrap();
        assert!(header.ends_with('3'), "{g}");
    }

    #[test]
    fn empty_timeline_gives_a_header_and_rows() {
        let t = Timeline::from_spans(2, Vec::new(), &[]);
        let g = grid(&t, &GridOptions::default());
        assert_eq!(g, "step\nrank 0\nrank 1\n");
    }
}
