//! An SVG picture of a timeline: one lane per rank, each action a coloured box (F, I, W, B
//! and overlapped F+B in distinct colours), idle time left visibly empty, a time axis in the
//! timeline's units with ticks, and a legend.
//!
//! The file is self-contained (no scripts, no external fonts) so it can be opened in a
//! browser or embedded in a report. Each box carries a `<title>` (its action, rank and
//! interval) that browsers show on hover; the label is written inside the box only when the
//! box is wide enough to hold it. When a rank holds several stages (chunks), its later
//! chunks are drawn in darker shades of the kind's colour, so an interleaved or V-shaped
//! schedule's chunks can be told apart at a glance.

use std::fmt::Write as _;

use pipefill_schedules::{ActionKind, Timeline};

use super::{action_label, fmt_num};

/// How to draw the picture.
#[derive(Clone, Debug)]
pub struct SvgOptions {
    /// Total width of the picture in pixels.
    pub width: f64,
    /// Height of one rank's lane in pixels.
    pub lane_height: f64,
    /// A title written above the lanes (e.g. the schedule and its parameters); each `\n`
    /// starts a new line.
    pub title: Option<String>,
    /// Prefix labels with the stage (`2F3`) and shade a rank's later stages darker: for
    /// plans in which a rank holds more than one stage.
    pub show_stage: bool,
}

impl Default for SvgOptions {
    fn default() -> Self {
        SvgOptions {
            width: 1200.0,
            lane_height: 28.0,
            title: None,
            show_stage: false,
        }
    }
}

/// Fill colour of each kind of action; SEND/RECV are not compute and never get a box, but
/// have a colour so a lowered timeline can be drawn one day without a special case.
pub fn kind_colour(kind: ActionKind) -> &'static str {
    match kind {
        ActionKind::F => "#4e79a7",
        ActionKind::I => "#f28e2b",
        ActionKind::W => "#59a14f",
        ActionKind::B => "#e15759",
        ActionKind::OverlapFB => "#b07aa1",
        _ => "#9c9c9c",
    }
}

/// The legend's entries, in the order drawn.
const LEGEND: [(ActionKind, &str); 5] = [
    (ActionKind::F, "F forward"),
    (ActionKind::I, "I input-grad backward"),
    (ActionKind::W, "W weight-grad backward"),
    (ActionKind::B, "B full backward"),
    (ActionKind::OverlapFB, "F+B overlapped"),
];

const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const LANE_GAP: f64 = 6.0;
const FONT: f64 = 11.0;
const TITLE_FONT: f64 = 13.0;
/// Approximate advance of one monospace character at [`FONT`] px.
const CHAR_W: f64 = FONT * 0.62;

/// Draws `timeline` as an SVG document (see the module docs).
pub fn svg(timeline: &Timeline, opts: &SvgOptions) -> String {
    let n_ranks = timeline.ranks.len();
    let lane_h = opts.lane_height.max(8.0);
    let title_lines: Vec<&str> = opts
        .title
        .as_deref()
        .map_or(Vec::new(), |t| t.lines().collect());
    // The picture grows to fit its title's longest line.
    let title_w = title_lines
        .iter()
        .map(|l| l.chars().count() as f64 * TITLE_FONT * 0.62 + 24.0)
        .fold(0.0, f64::max);
    let width = opts.width.max(LEFT + RIGHT + 100.0).max(title_w);
    let plot_w = width - LEFT - RIGHT;
    let t0 = timeline
        .spans
        .iter()
        .map(|s| s.start)
        .fold(f64::INFINITY, f64::min);
    let t0 = if t0.is_finite() { t0 } else { 0.0 };
    let makespan = if timeline.makespan > 0.0 {
        timeline.makespan
    } else {
        1.0
    };
    let x = |t: f64| LEFT + (t - t0) / makespan * plot_w;

    let top =
        12.0 + 18.0 * title_lines.len() as f64 + if title_lines.is_empty() { 0.0 } else { 4.0 };
    let lanes_bottom = top + n_ranks as f64 * (lane_h + LANE_GAP);
    let axis_y = lanes_bottom + 2.0;
    let legend_y = axis_y + 40.0;
    let height = legend_y + 24.0;

    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="monospace" font-size="{FONT}">"#,
        w = fmt_num(width, 1),
        h = fmt_num(height, 1),
    );
    let _ = writeln!(
        out,
        r#"<rect class="background" x="0" y="0" width="{}" height="{}" fill="white"/>"#,
        fmt_num(width, 1),
        fmt_num(height, 1)
    );
    for (k, line) in title_lines.iter().enumerate() {
        let _ = writeln!(
            out,
            r#"<text class="title" x="{}" y="{}" font-size="{TITLE_FONT}">{}</text>"#,
            fmt_num(LEFT.min(12.0), 1),
            fmt_num(24.0 + 18.0 * k as f64, 1),
            escape(line)
        );
    }

    // Lanes: a pale background (what stays visible is idle time) and the rank's boxes.
    for rank in 0..n_ranks {
        let y = top + rank as f64 * (lane_h + LANE_GAP);
        let _ = writeln!(out, r#"<g class="lane" data-rank="{rank}">"#);
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" text-anchor="end">rank {rank}</text>"#,
            fmt_num(LEFT - 8.0, 1),
            fmt_num(y + lane_h / 2.0 + FONT / 3.0, 1)
        );
        let _ = writeln!(
            out,
            r##"<rect class="idle" x="{LEFT}" y="{}" width="{}" height="{}" fill="#f6f6f6" stroke="#d0d0d0" stroke-width="0.5"/>"##,
            fmt_num(y, 2),
            fmt_num(plot_w, 2),
            fmt_num(lane_h, 2)
        );
        // The rank's stages in ascending order: a stage's position is its chunk.
        let mut own_stages: Vec<u32> = timeline
            .spans
            .iter()
            .filter(|s| s.rank == rank)
            .map(|s| s.action.stage)
            .collect();
        own_stages.sort_unstable();
        own_stages.dedup();
        for span in timeline.spans.iter().filter(|s| s.rank == rank) {
            let chunk = own_stages
                .iter()
                .position(|&st| st == span.action.stage)
                .unwrap_or(0);
            let fill = if opts.show_stage && own_stages.len() > 1 {
                darken(
                    kind_colour(span.action.kind),
                    0.4 * chunk as f64 / (own_stages.len() - 1) as f64,
                )
            } else {
                kind_colour(span.action.kind).to_string()
            };
            let (x0, x1) = (x(span.start), x(span.end));
            let w = (x1 - x0).max(0.5);
            let label = action_label(&span.action, opts.show_stage);
            let _ = writeln!(
                out,
                r##"<rect class="action {cls}" x="{}" y="{}" width="{}" height="{}" fill="{}" stroke="#ffffff" stroke-width="0.5"><title>{} on rank {rank}: {} to {}</title></rect>"##,
                fmt_num(x0, 2),
                fmt_num(y, 2),
                fmt_num(w, 2),
                fmt_num(lane_h, 2),
                fill,
                escape(&span.action.to_string()),
                fmt_num(span.start, 3),
                fmt_num(span.end, 3),
                cls = span.action.kind.as_str(),
            );
            if w >= label.chars().count() as f64 * CHAR_W + 4.0 {
                let _ = writeln!(
                    out,
                    r#"<text class="label" x="{}" y="{}" text-anchor="middle" fill="white">{}</text>"#,
                    fmt_num(x0 + w / 2.0, 2),
                    fmt_num(y + lane_h / 2.0 + FONT / 3.0, 2),
                    escape(&label)
                );
            }
        }
        out.push_str("</g>\n");
    }

    // Time axis in the timeline's units.
    let _ = writeln!(out, r#"<g class="axis">"#);
    let _ = writeln!(
        out,
        r#"<line x1="{LEFT}" y1="{y}" x2="{}" y2="{y}" stroke="black"/>"#,
        fmt_num(LEFT + plot_w, 2),
        y = fmt_num(axis_y, 2)
    );
    let step = tick_step(makespan);
    let mut k = 0u64;
    loop {
        let t = k as f64 * step;
        if t > makespan * (1.0 + 1e-9) {
            break;
        }
        let tx = fmt_num(x(t0 + t), 2);
        let _ = writeln!(
            out,
            r#"<line class="tick" x1="{tx}" y1="{}" x2="{tx}" y2="{}" stroke="black"/>"#,
            fmt_num(axis_y, 2),
            fmt_num(axis_y + 5.0, 2)
        );
        let _ = writeln!(
            out,
            r#"<text x="{tx}" y="{}" text-anchor="middle">{}</text>"#,
            fmt_num(axis_y + 17.0, 2),
            fmt_num(t, 3)
        );
        k += 1;
    }
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="end">time (cost units)</text>"#,
        fmt_num(LEFT + plot_w, 2),
        fmt_num(axis_y + 31.0, 2)
    );
    out.push_str("</g>\n");

    // Legend.
    let _ = writeln!(out, r#"<g class="legend">"#);
    // Only the kinds that occur (all of them for an empty timeline), then idle.
    let present: Vec<_> = LEGEND
        .iter()
        .filter(|(k, _)| timeline.spans.iter().any(|s| s.action.kind == *k))
        .collect();
    let entries = if present.is_empty() {
        LEGEND.iter().collect()
    } else {
        present
    };
    let mut lx = LEFT;
    for &&(kind, text) in &entries {
        let _ = writeln!(
            out,
            r#"<rect x="{}" y="{}" width="12" height="12" fill="{}"/>"#,
            fmt_num(lx, 2),
            fmt_num(legend_y, 2),
            kind_colour(kind)
        );
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}">{}</text>"#,
            fmt_num(lx + 16.0, 2),
            fmt_num(legend_y + 10.0, 2),
            escape(text)
        );
        lx += 16.0 + text.len() as f64 * CHAR_W + 18.0;
    }
    let _ = writeln!(
        out,
        r##"<rect x="{}" y="{}" width="12" height="12" fill="#f6f6f6" stroke="#d0d0d0"/>"##,
        fmt_num(lx, 2),
        fmt_num(legend_y, 2)
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}">idle (bubble)</text>"#,
        fmt_num(lx + 16.0, 2),
        fmt_num(legend_y + 10.0, 2)
    );
    if opts.show_stage {
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}">darker: a rank's later stage (chunk)</text>"#,
            fmt_num(lx + 16.0 + 13.0 * CHAR_W + 18.0, 2),
            fmt_num(legend_y + 10.0, 2)
        );
    }
    out.push_str("</g>\n</svg>\n");
    out
}

/// `#rrggbb` mixed with black: `amount` 0 keeps the colour, 1 gives black.
fn darken(hex: &str, amount: f64) -> String {
    let channel =
        |i: usize| u8::from_str_radix(hex.get(i..i + 2).unwrap_or("80"), 16).unwrap_or(128);
    let k = 1.0 - amount.clamp(0.0, 1.0);
    let [r, g, b] = [1, 3, 5].map(|i| (f64::from(channel(i)) * k).round() as u8);
    format!("#{r:02x}{g:02x}{b:02x}")
}

/// A picture width (pixels) at which every box of `timeline` is wide enough for its label,
/// clamped to `[min, max]`: long timelines stay readable by scrolling, short ones compact.
pub fn fitting_width(timeline: &Timeline, show_stage: bool, min: f64, max: f64) -> f64 {
    let need = timeline
        .spans
        .iter()
        .filter(|s| s.duration() > 0.0)
        .map(|s| {
            let chars = action_label(&s.action, show_stage).chars().count() as f64;
            (chars * CHAR_W + 6.0) / s.duration()
        })
        .fold(0.0, f64::max);
    (LEFT + RIGHT + need * timeline.makespan).clamp(min, max.max(min))
}

/// A "nice" tick spacing (1, 2 or 5 × 10^k) giving about ten ticks over `extent`.
fn tick_step(extent: f64) -> f64 {
    let raw = extent / 10.0;
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let nice = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// Escapes text for XML content and attribute values.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::test_support::two_rank_timeline;

    #[test]
    fn draws_lanes_boxes_axis_and_legend() {
        let t = two_rank_timeline();
        let s = svg(
            &t,
            &SvgOptions {
                title: Some("test <plan> & co".into()),
                ..SvgOptions::default()
            },
        );
        assert!(s.starts_with("<svg "), "{s}");
        assert!(s.trim_end().ends_with("</svg>"));
        assert_eq!(s.matches(r#"<g class="lane""#).count(), 2);
        // One box per compute span, coloured by kind.
        assert_eq!(s.matches(r#"class="action "#).count(), t.spans.len());
        assert_eq!(s.matches(r#"class="action I""#).count(), 1);
        assert_eq!(s.matches(r#"class="action B""#).count(), 2);
        assert_eq!(s.matches(r#"class="action OVERLAP_F_B""#).count(), 1);
        assert!(s.contains(kind_colour(ActionKind::W)));
        assert!(s.contains(r#"<g class="legend">"#));
        assert!(s.contains("idle (bubble)"));
        // Ticks 0, 1, ..., 8 (makespan 8, step 1).
        assert_eq!(s.matches(r#"class="tick""#).count(), 9);
        assert!(s.contains("test &lt;plan&gt; &amp; co"));
        // Every element that is opened is closed (no stray `<` from unescaped text).
        assert_eq!(s.matches("<g ").count(), s.matches("</g>").count());
        assert_eq!(s.matches("<title>").count(), s.matches("</title>").count());
    }

    #[test]
    fn labels_only_boxes_wide_enough() {
        let t = two_rank_timeline();
        let wide = svg(&t, &SvgOptions::default());
        assert_eq!(wide.matches(r#"class="label""#).count(), t.spans.len());
        let narrow = svg(
            &t,
            &SvgOptions {
                width: LEFT + RIGHT + 100.0,
                ..SvgOptions::default()
            },
        );
        // 12.5 px per unit: a 1-unit box holds no label, a 2-unit B holds `B0`/`B1`, and
        // the 3-unit overlap box (37.5 px) is too narrow for `F2+B1`.
        assert_eq!(narrow.matches(r#"class="label""#).count(), 2);
        assert_eq!(narrow.matches(r#"class="action "#).count(), t.spans.len());
    }

    #[test]
    fn boxes_sit_at_their_times() {
        let t = two_rank_timeline();
        let s = svg(
            &t,
            &SvgOptions {
                width: LEFT + RIGHT + 800.0,
                ..SvgOptions::default()
            },
        );
        // 100 px per unit: rank 1's B0 runs [2, 4) → x = 70 + 200, width 200.
        assert!(s.contains(r#"x="270" y="46" width="200""#), "{s}");
    }

    #[test]
    fn fitting_width_leaves_room_for_every_label() {
        let t = two_rank_timeline();
        let w = fitting_width(&t, false, 100.0, 10_000.0);
        let s = svg(
            &t,
            &SvgOptions {
                width: w,
                ..SvgOptions::default()
            },
        );
        assert_eq!(s.matches(r#"class="label""#).count(), t.spans.len());
        assert_eq!(fitting_width(&t, false, 100.0, 150.0), 150.0);
        assert_eq!(fitting_width(&t, false, 5000.0, 10_000.0), 5000.0);
    }

    #[test]
    fn legend_lists_the_kinds_present_and_idle() {
        let t = two_rank_timeline();
        let s = svg(&t, &SvgOptions::default());
        for text in [
            "F forward",
            "I input-grad",
            "W weight-grad",
            "B full",
            "F+B overlapped",
        ] {
            assert!(s.contains(text), "{text}");
        }
        let only_f = Timeline::from_spans(
            1,
            vec![pipefill_schedules::Span {
                rank: 0,
                start: 0.0,
                end: 1.0,
                action: pipefill_schedules::Action::f(0, 0),
            }],
            &[],
        );
        let s = svg(&only_f, &SvgOptions::default());
        assert!(s.contains("F forward") && s.contains("idle (bubble)"));
        assert!(!s.contains("W weight-grad"));
    }

    #[test]
    fn a_ranks_later_chunks_are_darker() {
        use pipefill_schedules::{Action, Span};
        // Rank 0 holds stages 0 and 2 (looped): F of stage 0, then F of stage 2.
        let span = |start, end, action| Span {
            rank: 0,
            start,
            end,
            action,
        };
        let t = Timeline::from_spans(
            1,
            vec![
                span(0.0, 1.0, Action::f(0, 0)),
                span(1.0, 2.0, Action::f(2, 0)),
            ],
            &[],
        );
        let shaded = svg(
            &t,
            &SvgOptions {
                show_stage: true,
                ..SvgOptions::default()
            },
        );
        let f = kind_colour(ActionKind::F);
        assert!(shaded.contains(&format!(r#"fill="{f}""#)));
        assert!(shaded.contains(&format!(r#"fill="{}""#, darken(f, 0.4))));
        assert!(shaded.contains(">0F0<") && shaded.contains(">2F0<"));
        assert!(shaded.contains("darker: a rank's later stage"));
        let flat = svg(&t, &SvgOptions::default());
        assert!(!flat.contains(&darken(f, 0.4)));
        assert_eq!(darken("#4e79a7", 0.0), "#4e79a7");
        assert_eq!(darken("#ffffff", 0.5), "#808080");
    }

    #[test]
    fn tick_steps_are_nice() {
        assert_eq!(tick_step(8.0), 1.0);
        assert_eq!(tick_step(37.0), 5.0);
        assert_eq!(tick_step(150.0), 20.0);
        assert!((tick_step(0.9) - 0.1).abs() < 1e-12);
    }
}
