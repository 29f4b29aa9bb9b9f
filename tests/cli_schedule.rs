//! `pipefill schedule …` through the built binary: what a user types, what a user reads.
//!
//! Figures printed by the CLI are checked against the library's own `generate`/`simulate`,
//! so a CLI that reformats or recomputes a metric wrongly fails here.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use pipefill::schedules::{
    CostModel, Plan, ScheduleKind, generate, lower, parse_csv, parse_toml, read_plan, simulate,
};
use serde_json::Value;

fn pipefill(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipefill"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("the pipefill binary runs")
}

/// Runs `pipefill schedule ARGS`, expecting success; returns stdout.
fn ok(args: &[&str]) -> String {
    let mut all = vec!["schedule"];
    all.extend_from_slice(args);
    let out = pipefill(&all);
    assert!(
        out.status.success(),
        "pipefill {all:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("stdout is UTF-8")
}

/// Runs `pipefill schedule ARGS`, expecting failure with one `error: …` line naming
/// `needle`; returns that line.
fn fails(args: &[&str], needle: &str) -> String {
    let mut all = vec!["schedule"];
    all.extend_from_slice(args);
    let out = pipefill(&all);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "pipefill {all:?} succeeded");
    assert_ne!(
        out.status.code(),
        Some(101),
        "pipefill {all:?} panicked: {stderr}"
    );
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "pipefill {all:?}: not one line: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(
        lines[0].contains(needle),
        "{all:?}: {stderr} lacks {needle:?}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    lines[0].to_string()
}

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/schedules")
        .join(name)
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

#[test]
fn show_draws_one_row_per_rank() {
    let out = ok(&["show", "zb-h1", "--stages", "4", "--microbatches", "8"]);
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("rank ")).collect();
    assert_eq!(rows.len(), 4, "{out}");
    // One stage per rank: cells are `F3`, `I3`, `W3` without the stage.
    assert!(rows[0].contains("F0") && rows[0].contains("I7") && rows[0].contains("W7"));
    assert!(!rows[0].contains("0F0"), "{out}");
    // Rank 3 (the last stage) starts its first forward after 3 idle columns.
    let first_cell = rows[3].find("F0").unwrap();
    let rank0_cell = rows[0].find("F0").unwrap();
    assert!(first_cell > rank0_cell, "{out}");

    // Several stages per rank: the stage is shown.
    let out = ok(&["show", "interleaved-1f1b", "-p", "2", "-m", "4"]);
    assert_eq!(out.lines().filter(|l| l.starts_with("rank ")).count(), 2);
    assert!(out.contains("2F0") && out.contains("3B0"), "{out}");
}

#[test]
fn show_writes_the_plan_in_every_form() {
    let expected = generate(ScheduleKind::ZbH1, 3, 6, 1).unwrap();
    let args = ["show", "zb-h1", "-p", "3", "-m", "6", "--format"];
    let csv = ok(&[&args[..], &["csv"]].concat());
    assert_eq!(parse_csv(&csv, "stdout").unwrap().ranks, expected.ranks);
    let toml = ok(&[&args[..], &["toml"]].concat());
    assert_eq!(parse_toml(&toml, "stdout").unwrap().ranks, expected.ranks);
    let plan: Plan = serde_json::from_str(&ok(&[&args[..], &["json"]].concat())).unwrap();
    assert_eq!(plan, expected);
}

#[test]
fn lower_inserts_the_transfers_a_runtime_executes() {
    let plan = generate(ScheduleKind::OneFOneB, 2, 3, 1).unwrap();
    let lowered = lower(&plan).unwrap();
    let csv = ok(&[
        "show", "1f1b", "-p", "2", "-m", "3", "--lower", "--format", "csv",
    ]);
    assert!(csv.contains("SEND_F") && csv.contains("RECV_B"), "{csv}");
    assert_eq!(parse_csv(&csv, "stdout").unwrap().ranks, lowered.ranks);
    // Simulating the lowered plan is the library's figure for it, transfers included.
    let cost = "comm=0.5";
    let v = json(&ok(&[
        "simulate", "1f1b", "-p", "2", "-m", "3", "--lower", "--cost", cost, "--json",
    ]));
    let t = simulate(&lowered, &CostModel::uniform(1.0, 1.0, 1.0, 0.5)).unwrap();
    assert_eq!(v["makespan"].as_f64(), Some(t.makespan));
    // A lowered file validates and reports its transfers.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lowered.csv");
    std::fs::write(&path, &csv).unwrap();
    let out = ok(&["validate", path.to_str().unwrap()]);
    let comm = lowered.iter().filter(|(_, _, a)| a.kind.is_comm()).count();
    assert!(out.contains(&format!("{comm} send/recv")), "{out}");
}

#[test]
fn simulate_json_matches_the_library() {
    let out = ok(&[
        "simulate",
        "zb-h1",
        "-p",
        "4",
        "-m",
        "8",
        "--cost",
        "w=0.5,comm=0.25",
        "--json",
    ]);
    let v = json(&out);
    let plan = generate(ScheduleKind::ZbH1, 4, 8, 1).unwrap();
    let t = simulate(&plan, &CostModel::uniform(1.0, 1.0, 0.5, 0.25)).unwrap();
    let close = |a: &Value, b: f64| (a.as_f64().unwrap() - b).abs() < 1e-9;
    assert!(close(&v["makespan"], t.makespan), "{v}");
    assert!(close(&v["bubble_ratio"], t.bubble_ratio));
    assert!(close(&v["steady_bubble_ratio"], t.steady_bubble_ratio));
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    for (r, s) in ranks.iter().zip(&t.ranks) {
        assert_eq!(r["rank"].as_u64(), Some(s.rank as u64));
        assert!(close(&r["busy"], s.busy) && close(&r["idle"], s.idle));
        assert!(close(&r["span"], s.span) && close(&r["bubble_ratio"], s.bubble_ratio));
        assert!(close(&r["peak_memory"], s.peak_memory));
    }
    let slots = v["slots"].as_array().unwrap();
    assert_eq!(slots.len(), t.slots.len());
    for (j, s) in slots.iter().zip(&t.slots) {
        assert_eq!(j["rank"].as_u64(), Some(s.rank as u64));
        assert!(close(&j["start"], s.start) && close(&j["length"], s.length));
        let text = |a: Option<pipefill_schedules::Action>| a.map(|a| a.to_string());
        assert_eq!(j["before"].as_str().map(String::from), text(s.before));
        assert_eq!(j["after"].as_str().map(String::from), text(s.after));
    }
}

#[test]
fn simulate_text_reports_both_ratios_and_memory_per_rank() {
    let out = ok(&["simulate", "1f1b", "-p", "4", "-m", "8"]);
    let t = simulate(
        &generate(ScheduleKind::OneFOneB, 4, 8, 1).unwrap(),
        &CostModel::default(),
    )
    .unwrap();
    assert!(
        out.contains(&format!("makespan             {}", t.makespan)),
        "{out}"
    );
    assert!(out.contains("steady bubble ratio"), "{out}");
    assert!(
        out.contains(&format!("{:.4}", t.ranks[0].bubble_ratio)),
        "{out}"
    );
    assert!(out.contains("peak memory"), "{out}");
    // --slots lists every bubble slot the library finds, one line each.
    let with_slots = ok(&["simulate", "1f1b", "-p", "4", "-m", "8", "--slots"]);
    let listed = with_slots
        .lines()
        .skip_while(|l| !l.starts_with("rank     start"))
        .skip(1)
        .count();
    assert_eq!(listed, t.slots.len(), "{with_slots}");
    assert!(with_slots.contains(" → "), "{with_slots}");
    // Per-stage costs: 4 stages, the third one slower.
    let slow = ok(&[
        "simulate",
        "1f1b",
        "-p",
        "4",
        "-m",
        "8",
        "--cost",
        "f=1:1:2:1,i=1:1:2:1",
    ]);
    let makespan = |s: &str| -> f64 {
        let line = s.lines().find(|l| l.starts_with("makespan")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    assert!(makespan(&slow) > makespan(&out), "{slow}");
}

#[test]
fn compare_lists_every_schedule() {
    let text = ok(&["compare", "--stages", "4", "--microbatches", "16"]);
    for kind in ScheduleKind::ALL {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("{} ", kind.name()))),
            "{} missing: {text}",
            kind.name()
        );
    }
    let v = json(&ok(&["compare", "-p", "4", "-m", "16", "--json"]));
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), ScheduleKind::ALL.len());
    let steady = |name: &str| {
        let row = rows.iter().find(|r| r["schedule"] == name).unwrap();
        row["steady_bubble_ratio"]
            .as_f64()
            .unwrap_or_else(|| panic!("{name}: {row}"))
    };
    assert!(steady("zb-h1") < steady("1f1b"), "{v}");
    assert!(steady("zb-h2") < 0.05, "{v}");
    assert!(steady("zb-v") < 0.05, "{v}");
    // Each row's figures are the library's, with a two-chunk schedule's stages costing
    // half of a rank's share each (times and activations).
    let mut half = CostModel::uniform(0.5, 0.5, 0.5, 0.0);
    (half.m_b, half.m_w) = (0.5, 0.25);
    let t = simulate(&generate(ScheduleKind::ZbV, 4, 16, 2).unwrap(), &half).unwrap();
    let zbv = rows.iter().find(|r| r["schedule"] == "zb-v").unwrap();
    assert!((steady("zb-v") - t.steady_bubble_ratio).abs() < 1e-9);
    assert_eq!(zbv["makespan"].as_f64(), Some(t.makespan));
    let peak = t.peak_memory();
    assert_eq!(zbv["peak_memory"].as_f64(), Some(peak));
    // Like for like, interleaving shortens 1F1B's iteration.
    let makespan = |name: &str| {
        let row = rows.iter().find(|r| r["schedule"] == name).unwrap();
        row["makespan"].as_f64().unwrap()
    };
    assert!(makespan("interleaved-1f1b") < makespan("1f1b"), "{v}");
}

#[test]
fn compare_reports_unsupported_shapes_in_their_row() {
    let row_of = |text: &str, name: &str| -> String {
        let prefix = format!("{name} ");
        let row = text.lines().find(|l| l.starts_with(&prefix));
        row.unwrap_or_else(|| panic!("{name} missing: {text}"))
            .to_string()
    };
    let text = ok(&["compare", "-p", "4", "-m", "2"]);
    assert!(
        row_of(&text, "interleaved-1f1b").contains("unsupported: "),
        "{text}"
    );
    assert!(!row_of(&text, "gpipe").contains("unsupported"), "{text}");

    // Peak memory, in one rank's share of activations: gpipe and looped-bfs stash all
    // 8 micro-batches, zb-h2 7, interleaved 5.5; 1f1b, zb-h1 and zb-v stay at p = 4.
    let text = ok(&["compare", "-p", "4", "-m", "8", "--memory-limit", "5"]);
    for over in ["gpipe", "looped-bfs", "zb-h2", "interleaved-1f1b"] {
        assert!(
            row_of(&text, over).contains("over --memory-limit"),
            "{text}"
        );
    }
    for within in ["1f1b", "zb-h1", "zb-v"] {
        assert!(!row_of(&text, within).contains("over"), "{text}");
    }
    // The summary picks among the rows that run within the limit only.
    let summary = text.lines().last().unwrap();
    assert!(
        summary.starts_with("lowest steady bubble: zb-v ("),
        "{text}"
    );
}

#[test]
fn export_svg_draws_one_lane_per_rank_with_a_legend() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("zbv.svg");
    let p = path.to_str().unwrap();
    let out = ok(&[
        "export", "zb-v", "-p", "4", "-m", "8", "--format", "svg", "-o", p,
    ]);
    assert!(out.starts_with("wrote "), "{out}");
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.starts_with("<svg"), "{svg}");
    assert!(svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches(r#"<g class="lane""#).count(), 4);
    assert!(svg.contains(r#"<g class="legend">"#) && svg.contains("idle (bubble)"));
    assert!(svg.contains(r#"<g class="axis">"#));
    let plan = generate(ScheduleKind::ZbV, 4, 8, 2).unwrap();
    assert_eq!(svg.matches(r#"class="action "#).count(), plan.num_actions());
    // Two stages per rank: labels carry the stage.
    assert!(svg.contains(">7F0<"), "labels missing");
    assert_eq!(svg.matches('<').count(), svg.matches('>').count());
}

#[test]
fn export_chrome_trace_opens_in_perfetto() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    let p = path.to_str().unwrap();
    let cost = "f=1,i=1.5,w=0.5,comm=0.1";
    ok(&[
        "export", "zb-h2", "-p", "4", "-m", "8", "--cost", cost, "--format", "chrome", "-o", p,
    ]);
    let v = json(&std::fs::read_to_string(&path).unwrap());
    assert_eq!(v["displayTimeUnit"], "ms");
    let events = v["traceEvents"].as_array().unwrap();
    let processes: Vec<_> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .map(|e| {
            (
                e["pid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        processes,
        vec![(0, "rank 0"), (1, "rank 1"), (2, "rank 2"), (3, "rank 3")]
    );
    let mut xs: Vec<(u64, u64, f64, f64)> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            assert!(
                e["name"]
                    .as_str()
                    .unwrap()
                    .parse::<pipefill_schedules::Action>()
                    .is_ok()
            );
            (
                e["pid"].as_u64().unwrap(),
                e["tid"].as_u64().unwrap(),
                e["ts"].as_f64().unwrap(),
                e["dur"].as_f64().unwrap(),
            )
        })
        .collect();
    let plan = generate(ScheduleKind::ZbH2, 4, 8, 1).unwrap();
    assert_eq!(xs.len(), plan.num_actions());
    xs.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)).then(a.2.total_cmp(&b.2)));
    for w in xs.windows(2) {
        if (w[0].0, w[0].1) == (w[1].0, w[1].1) {
            assert!(w[0].2 + w[0].3 <= w[1].2 + 1e-6, "overlap: {w:?}");
        }
    }
    // One cost unit = 1000 µs: the last event ends at makespan × 1000.
    let t = simulate(&plan, &CostModel::uniform(1.0, 1.5, 0.5, 0.1)).unwrap();
    let end = xs.iter().map(|x| x.2 + x.3).fold(0.0, f64::max);
    assert!(
        (end - t.makespan * 1000.0).abs() <= 1e-3,
        "{end} vs {}",
        t.makespan
    );
}

#[test]
fn export_chrome_bubbles_lane_holds_every_slot() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    let p = path.to_str().unwrap();
    ok(&[
        "export",
        "1f1b",
        "-p",
        "3",
        "-m",
        "4",
        "--format",
        "chrome",
        "--bubbles",
        "-o",
        p,
    ]);
    let v = json(&std::fs::read_to_string(&path).unwrap());
    let bubbles: Vec<&Value> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == "bubble")
        .collect();
    let t = simulate(
        &generate(ScheduleKind::OneFOneB, 3, 4, 1).unwrap(),
        &CostModel::default(),
    )
    .unwrap();
    assert_eq!(bubbles.len(), t.slots.len());
    assert!(bubbles.iter().all(|e| e["tid"] == 1));
    let idle: f64 = bubbles.iter().map(|e| e["dur"].as_f64().unwrap()).sum();
    assert!((idle - t.bubble_time() * 1000.0).abs() < 1e-6);
}

#[test]
fn export_plan_files_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let expected = generate(ScheduleKind::Interleaved1F1B, 2, 4, 2).unwrap();
    for ext in ["csv", "toml"] {
        let path = dir.path().join(format!("plan.{ext}"));
        let p = path.to_str().unwrap();
        ok(&[
            "export",
            "interleaved-1f1b",
            "-p",
            "2",
            "-m",
            "4",
            "--format",
            ext,
            "-o",
            p,
        ]);
        let back = read_plan(&path).unwrap();
        assert_eq!(back.ranks, expected.ranks, "{ext}");
        assert_eq!(back.stage_rank, expected.stage_rank, "{ext}");
        // The written file is itself a valid schedule for every subcommand.
        let shown = ok(&["show", p]);
        assert_eq!(shown.lines().filter(|l| l.starts_with("rank ")).count(), 2);
    }
}

/// DualPipe-V is built in: `schedule export dualpipe-v` for 4 ranks and 10 micro-batches
/// writes PyTorch's own CSV of it byte for byte, and `show` draws it.
#[test]
fn dualpipe_v_is_built_in_and_exports_pytorchs_csv() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dualpipev.csv");
    let p = path.to_str().unwrap();
    ok(&[
        "export",
        "dualpipe-v",
        "-p",
        "4",
        "-m",
        "10",
        "--format",
        "csv",
        "-o",
        p,
    ]);
    let torch =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch/dualpipev_4rank_10mb.csv");
    assert_eq!(
        std::fs::read_to_string(&path).unwrap().trim_end(),
        std::fs::read_to_string(torch).unwrap().trim_end()
    );
    let shown = ok(&["show", "dualpipe-v", "-p", "4", "-m", "10"]);
    assert_eq!(shown.lines().filter(|l| l.starts_with("rank ")).count(), 4);
    assert!(
        shown.contains("OVERLAP_F_B") || shown.contains(';'),
        "{shown}"
    );
}

#[test]
fn example_schedules_are_valid() {
    for (name, ranks) in [("zb1p_2x2.toml", 2), ("overlap_1f1b_2x4.csv", 2)] {
        let path = example(name);
        let p = path.to_str().unwrap();
        let out = ok(&["validate", p]);
        assert!(out.lines().any(|l| l == "valid"), "{out}");
        assert!(out.contains(&format!("ranks          {ranks}")), "{out}");
        let peaks = out.lines().find(|l| l.starts_with("peak memory")).unwrap();
        assert_eq!(peaks.matches("rank ").count(), ranks, "{out}");
        let v = json(&ok(&["simulate", p, "--json"]));
        assert_eq!(v["ranks"].as_array().unwrap().len(), ranks);
    }
}

#[test]
fn bad_input_is_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let malformed = dir.path().join("bad.csv");
    std::fs::write(&malformed, "0F0,0X1\n,1F0\n").unwrap();
    let bad = malformed.to_str().unwrap();
    // Parses, but stage 1's micro-batch 0 never runs its backward: the validator's
    // reason, prefixed by the file name.
    let invalid = dir.path().join("invalid.csv");
    std::fs::write(&invalid, "0F0,0B0\n,1F0\n").unwrap();
    let inv = invalid.to_str().unwrap();

    fails(
        &["show", "zb-h9", "-p", "4", "-m", "8"],
        "unknown schedule `zb-h9`",
    );
    fails(&["show", "1f1b", "-p", "0", "-m", "8"], "p = 0");
    fails(
        &["simulate", "interleaved-1f1b", "-p", "4", "-m", "2"],
        "interleaved-1f1b",
    );
    fails(&["show", "zb-h1", "-m", "8"], "--stages");
    fails(&["show", bad], "bad.csv");
    fails(&["validate", bad], "0X1");
    fails(&["validate", inv], "invalid.csv");
    fails(&["show", "missing.toml"], "missing.toml");
    fails(
        &["simulate", "zb-h1", "-p", "4", "-m", "8", "--cost", "f=abc"],
        "`f=abc`",
    );
    fails(
        &["simulate", "zb-h1", "-p", "4", "-m", "8", "--cost", "x=1"],
        "unknown key `x`",
    );
    fails(
        &["simulate", "zb-h1", "-p", "4", "-m", "8", "--cost", "f=1:2"],
        "`f` has 2",
    );
    fails(
        &[
            "simulate",
            "gpipe",
            "-p",
            "4",
            "-m",
            "8",
            "--memory-limit",
            "4",
        ],
        "limit of 4",
    );
    let zb1p = example("zb1p_2x2.toml");
    fails(
        &["show", zb1p.to_str().unwrap(), "-p", "3"],
        "--stages says 3",
    );
    fails(
        &["compare", "-p", "4", "-m", "8", "--cost", "mw=2"],
        "mw (2) exceeds mb (1)",
    );
    let nowhere = dir.path().join("no/such/dir/t.svg");
    let args = [
        "export", "zb-h1", "-p", "2", "-m", "4", "--format", "svg", "-o",
    ];
    fails(
        &[&args[..], &[nowhere.to_str().unwrap()]].concat(),
        "cannot write",
    );
}

#[test]
fn every_subcommand_has_help() {
    for sub in ["show", "validate", "simulate", "compare", "export"] {
        let out = ok(&[sub, "--help"]);
        assert!(out.contains("Usage:"), "{sub}: {out}");
    }
    assert!(ok(&["simulate", "--help"]).contains("f=1:1:1.5:1"));
    assert!(ok(&["export", "--help"]).contains("perfetto"));
}
