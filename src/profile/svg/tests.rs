//! Tests of the SVG writer, on hand-built timelines.

use super::*;
use crate::profile::LaneSpan;
use crate::profile::test_support::{fillers, two_rank_timeline};

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
    assert!(shaded.contains("darker: later stage (chunk) of a rank"));
    let flat = svg(&t, &SvgOptions::default());
    assert!(!flat.contains(&darken(f, 0.4)));
    assert_eq!(darken("#4e79a7", 0.0), "#4e79a7");
    assert_eq!(darken("#ffffff", 0.5), "#808080");
}

#[test]
fn extra_lanes_are_strips_in_their_ranks_lanes() {
    let t = two_rank_timeline();
    let s = svg_with(
        &t,
        &fillers(),
        &SvgOptions {
            width: LEFT + RIGHT + 800.0,
            ..SvgOptions::default()
        },
    );
    assert_eq!(s.matches(r#"class="extra filler""#).count(), 3);
    // Rank 1's [4, 5) slice: x = 70 + 400, at the bottom 40% of lane 1 (y 46..74).
    assert!(
        s.contains(r#"class="extra filler" x="470" y="62.8" width="100" height="11.2""#),
        "{s}"
    );
    assert!(s.contains("verify &lt;12&gt; &amp; co on rank 1 (filler)"));
    // The legend names the lane, in its colour.
    assert!(s.contains(&format!(r#"fill="{}"/>"#, EXTRA_COLOURS[0])));
    assert!(s.contains(">filler</text>"));
    // Two extra lanes share the bottom 40% in bands: `comm` below `filler`.
    let mut two = fillers();
    two.push(LaneSpan {
        rank: 0,
        lane: "comm".into(),
        start: 1.0,
        end: 3.5,
        label: "send".into(),
    });
    let s = svg_with(
        &t,
        &two,
        &SvgOptions {
            width: LEFT + RIGHT + 800.0,
            ..SvgOptions::default()
        },
    );
    assert!(
        s.contains(r#"class="extra filler" x="270" y="28.8" width="75" height="5.6""#),
        "{s}"
    );
    assert!(
        s.contains(r#"class="extra comm" x="170" y="34.4" width="250" height="5.6""#),
        "{s}"
    );
    assert!(s.contains(">comm</text>"));
    // Without extra spans the picture is the plain one.
    assert_eq!(
        svg_with(&t, &[], &SvgOptions::default()),
        svg(&t, &SvgOptions::default())
    );
}

#[test]
fn the_legend_wraps_inside_a_narrow_picture() {
    let t = two_rank_timeline();
    let s = svg(
        &t,
        &SvgOptions {
            width: 400.0,
            ..SvgOptions::default()
        },
    );
    assert!(s.starts_with(r#"<svg xmlns="http://www.w3.org/2000/svg" width="400""#));
    // Every legend swatch starts left of the right margin.
    let legend = &s[s.find(r#"<g class="legend">"#).unwrap()..];
    let xs: Vec<f64> = legend
        .match_indices(r#"<rect x=""#)
        .map(|(i, m)| {
            let rest = &legend[i + m.len()..];
            rest[..rest.find('"').unwrap()].parse().unwrap()
        })
        .collect();
    assert_eq!(xs.len(), 6);
    assert!(xs.iter().all(|&x| x + 12.0 <= 400.0 - RIGHT), "{xs:?}");
    assert!(
        xs.iter().filter(|&&x| x == LEFT).count() >= 2,
        "wrapped: {xs:?}"
    );
}

#[test]
fn tick_steps_are_nice() {
    assert_eq!(tick_step(8.0), 1.0);
    assert_eq!(tick_step(37.0), 5.0);
    assert_eq!(tick_step(150.0), 20.0);
    assert!((tick_step(0.9) - 0.1).abs() < 1e-12);
}
