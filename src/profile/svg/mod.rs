//! An SVG picture of a timeline: one lane per rank, each action a coloured box (F, I, W, B
//! and overlapped F+B in distinct colours), idle time left visibly empty, a time axis in the
//! timeline's units with ticks, and a legend.
//!
//! The file is self-contained (no scripts, no external fonts) so it can be opened in a
//! browser or embedded in a report. Each box carries a `<title>` (its action, rank and
//! interval) that browsers show on hover; the label is written inside the box only when the
//! box is wide enough to hold it. Extra work beside the compute ([`LaneSpan`]s, e.g. the
//! filler work the runtime runs inside bubbles) is drawn as a strip along the bottom of its
//! rank's lane, one colour per lane name, so a filled bubble is visibly filled. When a rank
//! holds several stages (chunks), its later
//! chunks are drawn in darker shades of the kind's colour, so an interleaved or V-shaped
//! schedule's chunks can be told apart at a glance.

use std::fmt::Write as _;

use pipefill_schedules::{ActionKind, Timeline};

use super::{LaneSpan, action_label, fmt_num, lane_names};

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
/// Height of one row of the legend.
const LEGEND_ROW: f64 = 18.0;
/// Approximate advance of one monospace character at [`FONT`] px.
const CHAR_W: f64 = FONT * 0.62;

/// Colours of extra lanes, by order of first appearance (cycled).
const EXTRA_COLOURS: [&str; 4] = ["#17becf", "#bcbd22", "#8c564b", "#7f7f7f"];

/// Draws `timeline` as an SVG document (see the module docs).
pub fn svg(timeline: &Timeline, opts: &SvgOptions) -> String {
    svg_with(timeline, &[], opts)
}

/// Draws `timeline` with `extra` spans (filler work, transfers, …) as strips along the
/// bottom of their ranks' lanes, one colour per lane name, listed in the legend.
pub fn svg_with(timeline: &Timeline, extra: &[LaneSpan], opts: &SvgOptions) -> String {
    let n_ranks = timeline.ranks.len();
    let lane_h = opts.lane_height.max(8.0);
    let lanes = lane_names(extra);
    let title_lines: Vec<&str> = opts
        .title
        .as_deref()
        .map_or(Vec::new(), |t| t.lines().collect());
    let legend = legend_items(timeline, &lanes, opts.show_stage);
    // The picture grows to fit its title's longest line; the legend wraps instead.
    let title_w = title_lines
        .iter()
        .map(|l| l.chars().count() as f64 * TITLE_FONT * 0.62 + 24.0)
        .fold(0.0, f64::max);
    let width = opts.width.max(LEFT + RIGHT + 100.0).max(title_w);
    let plot_w = width - LEFT - RIGHT;
    let t0 = timeline.start();
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
    // Legend entries flow left to right and wrap onto new rows at the right margin.
    let mut legend_at = Vec::with_capacity(legend.len());
    let (mut lx, mut ly) = (LEFT, legend_y);
    for (swatch, text) in &legend {
        let w = legend_item_width(swatch, text);
        if lx > LEFT && lx + w - 18.0 > width - RIGHT {
            (lx, ly) = (LEFT, ly + LEGEND_ROW);
        }
        legend_at.push((lx, ly));
        lx += w;
    }
    let height = ly + 24.0;

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
        // Extra spans: the bottom 40% of the lane, shared in bands by the extra lanes,
        // clipped to the plot.
        let strip_h = lane_h * 0.4 / lanes.len().max(1) as f64;
        for span in extra.iter().filter(|s| s.rank == rank) {
            let x0 = x(span.start).clamp(LEFT, LEFT + plot_w);
            let x1 = x(span.end).clamp(LEFT, LEFT + plot_w);
            let lane = lanes.iter().position(|l| *l == span.lane).unwrap_or(0);
            let _ = writeln!(
                out,
                r##"<rect class="extra {}" x="{}" y="{}" width="{}" height="{}" fill="{}" stroke="#ffffff" stroke-width="0.5"><title>{} on rank {rank} ({}): {} to {}</title></rect>"##,
                escape(&span.lane),
                fmt_num(x0, 2),
                fmt_num(y + lane_h - strip_h * (lanes.len() - lane) as f64, 2),
                fmt_num((x1 - x0).max(0.5), 2),
                fmt_num(strip_h, 2),
                EXTRA_COLOURS[lane % EXTRA_COLOURS.len()],
                escape(&span.label),
                escape(&span.lane),
                fmt_num(span.start, 3),
                fmt_num(span.end, 3),
            );
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
    for ((swatch, text), &(lx, ly)) in legend.iter().zip(&legend_at) {
        let (sx, sy) = (fmt_num(lx, 2), fmt_num(ly, 2));
        let _ = match swatch {
            Swatch::Box(colour) => writeln!(
                out,
                r#"<rect x="{sx}" y="{sy}" width="12" height="12" fill="{colour}"/>"#
            ),
            Swatch::Idle => writeln!(
                out,
                r##"<rect x="{sx}" y="{sy}" width="12" height="12" fill="#f6f6f6" stroke="#d0d0d0"/>"##
            ),
            Swatch::Strip(colour) => writeln!(
                out,
                r#"<rect x="{sx}" y="{}" width="12" height="6" fill="{colour}"/>"#,
                fmt_num(ly + 6.0, 2)
            ),
            Swatch::None => Ok(()),
        };
        let tx = if matches!(swatch, Swatch::None) {
            lx
        } else {
            lx + 16.0
        };
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}">{}</text>"#,
            fmt_num(tx, 2),
            fmt_num(ly + 10.0, 2),
            escape(text)
        );
    }
    out.push_str("</g>\n</svg>\n");
    out
}

/// How a legend entry is marked.
enum Swatch {
    /// A square in an action kind's colour.
    Box(&'static str),
    /// The idle lane background.
    Idle,
    /// A thin bar in an extra lane's colour.
    Strip(&'static str),
    /// Text only.
    None,
}

/// The legend: the kinds that occur (all of them for an empty timeline), idle, each extra
/// lane, and the chunk-shading note when stages are shown.
fn legend_items(timeline: &Timeline, lanes: &[&str], show_stage: bool) -> Vec<(Swatch, String)> {
    let present: Vec<_> = LEGEND
        .iter()
        .filter(|(k, _)| timeline.spans.iter().any(|s| s.action.kind == *k))
        .collect();
    let kinds = if present.is_empty() {
        LEGEND.iter().collect()
    } else {
        present
    };
    let mut items: Vec<(Swatch, String)> = kinds
        .into_iter()
        .map(|&(k, text)| (Swatch::Box(kind_colour(k)), text.to_string()))
        .collect();
    items.push((Swatch::Idle, "idle (bubble)".to_string()));
    for (k, lane) in lanes.iter().enumerate() {
        items.push((
            Swatch::Strip(EXTRA_COLOURS[k % EXTRA_COLOURS.len()]),
            lane.to_string(),
        ));
    }
    if show_stage {
        items.push((
            Swatch::None,
            "darker: later stage (chunk) of a rank".to_string(),
        ));
    }
    items
}

/// Horizontal room one legend entry takes, gap included.
fn legend_item_width(swatch: &Swatch, text: &str) -> f64 {
    let mark = if matches!(swatch, Swatch::None) {
        0.0
    } else {
        16.0
    };
    mark + text.chars().count() as f64 * CHAR_W + 18.0
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
mod tests;
