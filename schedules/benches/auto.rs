//! The auto-scheduler's targets (issue 8):
//! - the zero-bubble paper's four models, costs from its FLOP formulas (per `sbh`:
//!   F = 24h + 4s, I = 24h + 8s, W = 24h; s = 1024; comm 5% of T_F): auto's steady bubble
//!   ratio at memory limit `p·M_B` against ZB-H1's, and at `2p·M_B` against ZB-H2's, printed
//!   as a table before the timings;
//! - one stage 1.5× slower: auto against every built-in at the built-in's own peak memory
//!   (printed);
//! - the time `auto` takes for p = 32, m = 256 (criterion; target under 5 s).
//!
//! Run with `cargo bench -p pipefill-schedules --bench auto`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use pipefill_schedules::{
    CostModel, Placement, ScheduleKind, StageCost, auto_plan, generate, simulate,
};

/// (name, h, s, b, p, m) of the zero-bubble paper's models (its table 3).
const MODELS: [(&str, f64, f64, usize, usize, usize); 4] = [
    ("1.5B", 2304.0, 1024.0, 6, 8, 24),
    ("6.2B", 4096.0, 1024.0, 3, 8, 24),
    ("14.6B", 5120.0, 1024.0, 1, 16, 48),
    ("28.3B", 6144.0, 1024.0, 1, 32, 96),
];

/// The paper's FLOP-based costs for hidden size `h` and sequence `s`, in units of T_F.
fn zb_cost(h: f64, s: f64) -> CostModel {
    let f = 24.0 * h + 4.0 * s;
    let i = 24.0 * h + 8.0 * s;
    let w = 24.0 * h;
    CostModel::uniform(1.0, i / f, w / f, 0.05)
}

/// A built-in's steady bubble ratio and peak memory under `cost`.
fn steady(kind: ScheduleKind, p: usize, m: usize, cost: &CostModel) -> (f64, f64) {
    let plan = generate(kind, p, m, 1).expect("built-in");
    let t = simulate(&plan, cost).expect("simulates");
    let peak = t.peak_memory();
    (t.steady_bubble_ratio, peak)
}

fn table() {
    println!("\nzero-bubble paper models (steady bubble ratio; M_B = 1, M_W = 0.5, comm 5% T_F)");
    println!(
        "{:<6} {:>3} {:>3}  {:>8} {:>8} {:>6}  {:>8} {:>8} {:>6}",
        "model", "p", "m", "zb-h1", "auto@p", "evals", "zb-h2", "auto@2p", "evals"
    );
    for (name, h, s, _b, p, m) in MODELS {
        let cost = zb_cost(h, s);
        let (h1, h1_peak) = steady(ScheduleKind::ZbH1, p, m, &cost);
        let (h2, h2_peak) = steady(ScheduleKind::ZbH2, p, m, &cost);
        let a1 = auto_plan(&cost, p, m, 1, Placement::Contiguous, p as f64).expect("auto");
        let a2 = auto_plan(&cost, p, m, 1, Placement::Contiguous, 2.0 * p as f64).expect("auto");
        println!(
            "{name:<6} {p:>3} {m:>3}  {h1:>8.4} {:>8.4} {:>6}  {h2:>8.4} {:>8.4} {:>6}   \
             (peaks: zb-h1 {h1_peak}, zb-h2 {h2_peak}; auto from {:?} / {:?})",
            a1.timeline.steady_bubble_ratio,
            a1.evaluated,
            a2.timeline.steady_bubble_ratio,
            a2.evaluated,
            a1.origin,
            a2.origin,
        );
    }
}

fn uneven() {
    println!(
        "\nuneven stages (one stage 1.5× slower, comm 0.05): auto at each built-in's own \
         peak memory; steady / synchronous bubble ratio"
    );
    println!(
        "{:>2} {:>3} {:>4}  {:<8} {:>5}  {:>15}  {:>15}",
        "p", "m", "slow", "built-in", "peak", "built-in", "auto"
    );
    for (p, m) in [(4, 16), (8, 32)] {
        for slow in [0, p / 2, p - 1] {
            let mut stage = vec![
                StageCost {
                    f: 1.0,
                    i: 1.0,
                    w: 1.0
                };
                p
            ];
            stage[slow] = StageCost {
                f: 1.5,
                i: 1.5,
                w: 1.5,
            };
            let cost = CostModel {
                stage,
                ..CostModel::uniform(1.0, 1.0, 1.0, 0.05)
            };
            for kind in [
                ScheduleKind::GPipe,
                ScheduleKind::OneFOneB,
                ScheduleKind::ZbH1,
                ScheduleKind::ZbH2,
            ] {
                let plan = generate(kind, p, m, 1).expect("built-in");
                let t = simulate(&plan, &cost).expect("simulates");
                let peak = t.peak_memory();
                let a = auto_plan(&cost, p, m, 1, Placement::Contiguous, peak).expect("auto");
                println!(
                    "{p:>2} {m:>3} {slow:>4}  {:<8} {peak:>5}  {:>7.4} {:>7.4}  {:>7.4} {:>7.4}",
                    kind.name(),
                    t.steady_bubble_ratio,
                    t.bubble_ratio,
                    a.timeline.steady_bubble_ratio,
                    a.timeline.bubble_ratio,
                );
            }
        }
    }
}

fn timing(c: &mut Criterion) {
    table();
    uneven();
    let (p, m) = (32, 256);
    let cost = zb_cost(4096.0, 1024.0);
    let mut group = c.benchmark_group("auto");
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(20));
    for limit in [p as f64, 2.0 * p as f64] {
        group.bench_function(format!("p={p} m={m} limit={limit}"), |b| {
            b.iter(|| {
                auto_plan(
                    black_box(&cost),
                    p,
                    m,
                    1,
                    Placement::Contiguous,
                    black_box(limit),
                )
                .expect("auto")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, timing);
criterion_main!(benches);
