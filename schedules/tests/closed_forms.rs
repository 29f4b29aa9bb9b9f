//! The generators against DESIGN.md's closed forms, over a grid of pipeline shapes.
//!
//! Every figure here is the *steady* bubble of a simulated plan with uniform stage costs
//! and no link latency: idle on the worst rank = max span − that rank's busy time. The
//! closed forms (the zero-bubble paper's, per rank):
//! - GPipe, 1F1B: `(p − 1)(T_F + T_I + T_W)`;
//! - interleaved 1F1B: the same in chunk costs, i.e. `1/v` of 1F1B's for the same model;
//! - ZB-H1: `(p − 1)(T_F + T_I − T_W)`;
//! - ZB-H2: `max(0, (p − 1)(T_F + T_I − 2T_W))` once `m ≥ 2p`;
//! - ZB-V: zero when `T_F = T_I = T_W` and `m ≥ 2p`.

use pipefill_schedules::{
    ActionKind, CostModel, Plan, ScheduleError, ScheduleKind, Timeline, ValidateOptions, build,
    generate, lower, simulate, validate,
};

const RANKS: [usize; 5] = [2, 3, 4, 6, 8];
const EPS: f64 = 1e-9;

/// The micro-batch counts of the grid: p, 2p, 4p and 3p + 1.
fn microbatches(p: usize) -> [usize; 4] {
    [p, 2 * p, 4 * p, 3 * p + 1]
}

fn run(kind: ScheduleKind, p: usize, m: usize, v: usize, (f, i, w): (f64, f64, f64)) -> Timeline {
    let plan = generate(kind, p, m, v).unwrap_or_else(|e| panic!("{kind} p={p} m={m} v={v}: {e}"));
    simulate(&plan, &CostModel::uniform(f, i, w, 0.0))
        .unwrap_or_else(|e| panic!("{kind} p={p} m={m} v={v}: {e}"))
}

fn assert_idle(kind: ScheduleKind, p: usize, m: usize, v: usize, cost: (f64, f64, f64), want: f64) {
    let got = run(kind, p, m, v, cost).worst_idle();
    assert!(
        (got - want).abs() < EPS,
        "{kind} p={p} m={m} v={v} (T_F, T_I, T_W)={cost:?}: worst-rank idle {got}, closed form {want}"
    );
}

#[test]
fn gpipe_and_1f1b_idle_is_p_minus_1_full_steps() {
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for cost @ (f, i, w) in [(1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (1.0, 2.0, 0.5)] {
            for p in RANKS {
                for m in microbatches(p) {
                    assert_idle(kind, p, m, 1, cost, (p - 1) as f64 * (f + i + w));
                    // With a barrier or without, the same: every rank's span is the makespan.
                    let t = run(kind, p, m, 1, cost);
                    assert!(
                        (t.bubble_ratio - t.steady_bubble_ratio).abs() < EPS,
                        "{kind} p={p} m={m}"
                    );
                }
            }
        }
    }
}

#[test]
fn interleaved_idle_is_a_vth_of_1f1b() {
    for (f, i, w) in [(1.0, 1.0, 1.0), (2.0, 1.0, 0.5)] {
        for v in [2, 3] {
            for p in RANKS {
                for m in microbatches(p) {
                    if m % p != 0 {
                        let err = generate(ScheduleKind::Interleaved1F1B, p, m, v).unwrap_err();
                        assert!(matches!(err, ScheduleError::Unsupported { .. }), "{err}");
                        continue;
                    }
                    // Each chunk costs (T_F, T_I, T_W); 1F1B runs the same model as v-times
                    // larger stages.
                    let chunked =
                        run(ScheduleKind::Interleaved1F1B, p, m, v, (f, i, w)).worst_idle();
                    let vf = v as f64;
                    let whole =
                        run(ScheduleKind::OneFOneB, p, m, 1, (vf * f, vf * i, vf * w)).worst_idle();
                    assert!(
                        (chunked * vf - whole).abs() < EPS,
                        "p={p} m={m} v={v}: interleaved idle {chunked}, 1F1B idle {whole}"
                    );
                    assert!((chunked - (p - 1) as f64 * (f + i + w)).abs() < EPS);
                }
            }
        }
    }
}

#[test]
fn zb_h1_idle_is_p_minus_1_times_f_plus_i_minus_w() {
    for cost @ (f, i, w) in [
        (1.0, 1.0, 1.0),
        (2.0, 2.0, 1.0),
        (1.0, 1.0, 0.5),
        (2.0, 1.0, 0.5),
    ] {
        for p in RANKS {
            for m in microbatches(p) {
                assert_idle(
                    ScheduleKind::ZbH1,
                    p,
                    m,
                    1,
                    cost,
                    (p - 1) as f64 * (f + i - w),
                );
            }
        }
    }
    // A third of 1F1B's with equal costs.
    let h1 = run(ScheduleKind::ZbH1, 4, 16, 1, (1.0, 1.0, 1.0)).worst_idle();
    let base = run(ScheduleKind::OneFOneB, 4, 16, 1, (1.0, 1.0, 1.0)).worst_idle();
    assert_eq!(3.0 * h1, base);
}

#[test]
fn zb_h2_idle_vanishes_when_two_w_cover_f_plus_i() {
    for cost @ (f, i, w) in [
        (1.0, 1.0, 1.0),
        (1.0, 1.0, 2.0),
        (2.0, 2.0, 1.0),
        (2.0, 1.0, 0.5),
    ] {
        for p in RANKS {
            for m in [2 * p, 4 * p, 3 * p + 1] {
                let want = ((p - 1) as f64 * (f + i - 2.0 * w)).max(0.0);
                assert_idle(ScheduleKind::ZbH2, p, m, 1, cost, want);
            }
        }
    }
}

#[test]
fn zb_v_idle_is_zero_with_equal_costs() {
    for p in RANKS {
        for m in [2 * p, 4 * p, 3 * p + 1] {
            for c in [1.0, 2.5] {
                assert_idle(ScheduleKind::ZbV, p, m, 2, (c, c, c), 0.0);
            }
        }
    }
}

/// Every kind over the whole grid (with the chunk counts it supports).
fn grid() -> impl Iterator<Item = (ScheduleKind, usize, usize, usize)> {
    ScheduleKind::ALL.into_iter().flat_map(|kind| {
        let chunks: &'static [usize] = match kind {
            ScheduleKind::Interleaved1F1B | ScheduleKind::LoopedBfs => &[2, 3],
            ScheduleKind::ZbV | ScheduleKind::DualPipeV => &[2],
            _ => &[1],
        };
        chunks.iter().flat_map(move |&v| {
            RANKS
                .into_iter()
                .flat_map(move |p| microbatches(p).map(move |m| (kind, p, m, v)))
                .filter(|&(kind, p, m, _)| kind != ScheduleKind::Interleaved1F1B || m % p == 0)
                .filter(|&(kind, p, m, _)| kind != ScheduleKind::DualPipeV || m >= 2 * p)
        })
    })
}

/// One F and one backward (I + W when split, else B) per (stage, micro-batch).
fn assert_exactly_once(plan: &Plan, what: &str) {
    let cells = plan.stages * plan.microbatches;
    let mut count = vec![[0u32; 4]; cells];
    for (_, _, a) in plan.iter() {
        for part in a.parts() {
            let slot = match part.kind {
                ActionKind::F => 0,
                ActionKind::I => 1,
                ActionKind::W => 2,
                ActionKind::B => 3,
                _ => continue,
            };
            count[part.stage as usize * plan.microbatches + part.microbatch as usize][slot] += 1;
        }
    }
    for (cell, c) in count.iter().enumerate() {
        let ok = c[0] == 1 && (c[1..] == [1, 1, 0] || c[1..] == [0, 0, 1]);
        assert!(
            ok,
            "{what}: stage {}, micro-batch {}: F/I/W/B counts {c:?}",
            cell / plan.microbatches,
            cell % plan.microbatches
        );
    }
}

#[test]
fn every_generated_plan_is_valid_complete_and_simulates() {
    let cost = CostModel::uniform(1.0, 1.0, 1.0, 0.5);
    for (kind, p, m, v) in grid() {
        let what = format!("{kind} p={p} m={m} v={v}");
        let plan = generate(kind, p, m, v).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(plan.num_ranks(), p, "{what}");
        assert_eq!(plan.stages, p * v, "{what}");
        assert!(plan.is_compute_only(), "{what}");
        assert_exactly_once(&plan, &what);
        let checked =
            validate(&plan, &ValidateOptions::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
        let t = simulate(&plan, &cost).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(
            t.ranks.iter().map(|r| r.peak_memory).collect::<Vec<_>>(),
            checked.peak_memory
        );
        assert_eq!(t.spans.len(), plan.num_actions(), "{what}");
        // The lowered plan is valid too, and simulates to the same busy time.
        let lowered = build(kind, p, m, v).unwrap_or_else(|e| panic!("{what}: {e}"));
        validate(&lowered, &ValidateOptions::default())
            .unwrap_or_else(|e| panic!("{what} lowered: {e}"));
        assert_eq!(
            lowered.compute_only(),
            plan,
            "{what}: lowering changed the compute order"
        );
        let tl = simulate(&lowered, &cost).unwrap_or_else(|e| panic!("{what} lowered: {e}"));
        let busy = |t: &Timeline| t.ranks.iter().map(|r| r.busy).sum::<f64>();
        assert!((busy(&tl) - busy(&t)).abs() < EPS, "{what}");
    }
}

#[test]
fn zb_h1_needs_no_more_memory_than_1f1b() {
    let cost = CostModel::default(); // M_B = 1, M_W = 0.5
    let peak = |plan: &Plan| {
        validate(
            plan,
            &ValidateOptions {
                cost: cost.clone(),
                memory_limit: None,
            },
        )
        .unwrap()
        .peak_memory
    };
    for p in RANKS {
        for m in microbatches(p) {
            let h1 = peak(&generate(ScheduleKind::ZbH1, p, m, 1).unwrap());
            let base = peak(&generate(ScheduleKind::OneFOneB, p, m, 1).unwrap());
            let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
            assert!(
                max(&h1) <= max(&base),
                "p={p} m={m}: ZB-H1 {h1:?} vs 1F1B {base:?}"
            );
            // Rank 0 holds exactly 1F1B's p micro-batches (fewer when m < p).
            assert_eq!(h1[0], base[0], "p={p} m={m}");
        }
    }
}

#[test]
fn zb_h2_and_zb_v_memory() {
    let cost = CostModel::default();
    for p in RANKS {
        let m = 4 * p;
        let h2 = simulate(&generate(ScheduleKind::ZbH2, p, m, 1).unwrap(), &cost).unwrap();
        // About 2p M_B on rank 0: 2p − 1 micro-batches in flight.
        assert_eq!(h2.ranks[0].peak_memory, (2 * p - 1) as f64, "p={p}");
        // ZB-V's chunks are half-stages: 2p chunk activations is 1F1B's p M_B.
        let zbv = simulate(&generate(ScheduleKind::ZbV, p, m, 2).unwrap(), &cost).unwrap();
        let worst = zbv.peak_memory();
        assert!(worst <= (2 * p) as f64, "p={p}: ZB-V peak {worst}");
    }
}

#[test]
fn lowered_plans_time_exactly_like_their_compute_only_form() {
    // Each RECV sits where its compute action would wait anyway, so lowering adds no delay,
    // whatever the costs and the link latency.
    for cost in [
        CostModel::uniform(1.0, 1.0, 1.0, 0.0),
        CostModel::uniform(1.0, 2.0, 0.5, 0.25),
        CostModel::uniform(3.0, 1.0, 2.0, 1.5),
    ] {
        for (kind, p, m, v) in grid().filter(|&(_, p, _, _)| p <= 4) {
            let plan = generate(kind, p, m, v).unwrap();
            let a = simulate(&plan, &cost).unwrap();
            let b = simulate(&lower(&plan).unwrap(), &cost).unwrap();
            assert_eq!(a.spans, b.spans, "{kind} p={p} m={m} v={v} cost={cost:?}");
        }
    }
}

/// The simulator's timing rules, checked span by span under uneven costs: no rank runs two
/// actions at once, and every action starts after its inputs arrived.
#[test]
fn simulated_spans_respect_dependencies_under_uneven_costs() {
    use pipefill_schedules::{Action, StageCost};
    use std::collections::HashMap;

    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        0.25 + (seed % 1000) as f64 / 250.0 // 0.25 ..= 4.25
    };
    for (kind, p, m, v) in grid().filter(|&(_, p, _, _)| p <= 4) {
        let plan = generate(kind, p, m, v).unwrap();
        let cost = CostModel {
            stage: (0..plan.stages)
                .map(|_| StageCost {
                    f: next(),
                    i: next(),
                    w: next(),
                })
                .collect(),
            comm: next() / 4.0,
            rank_speed: (0..p).map(|_| next() / 2.0).collect(),
            m_b: 1.0,
            m_w: 0.5,
        };
        let t = simulate(&plan, &cost).unwrap();
        let what = format!("{kind} p={p} m={m} v={v}");
        let mut f_end = HashMap::new();
        let mut b_end = HashMap::new();
        for s in &t.spans {
            for part in s.action.parts() {
                let key = (part.stage, part.microbatch);
                match part.kind {
                    ActionKind::F => f_end.insert(key, (s.end, s.rank)),
                    ActionKind::I | ActionKind::B => b_end.insert(key, (s.end, s.rank)),
                    _ => None,
                };
            }
        }
        let arrival = |table: &HashMap<(u32, u32), (f64, usize)>, key, rank| {
            let (end, from) = table[&key];
            if from == rank { end } else { end + cost.comm }
        };
        for (i, s) in t.spans.iter().enumerate() {
            if let Some(prev) = t.spans.get(i.wrapping_sub(1)).filter(|p| p.rank == s.rank) {
                assert!(
                    s.start >= prev.end - EPS,
                    "{what}: rank {} overlaps {} and {}",
                    s.rank,
                    prev.action,
                    s.action
                );
            }
            assert!(
                (s.duration() - cost.duration(s.rank, &s.action)).abs() < EPS,
                "{what}: {}",
                s.action
            );
            for part in s.action.parts() {
                let (st, mb) = (part.stage, part.microbatch);
                let mut ready = Vec::new();
                match part.kind {
                    ActionKind::F if st > 0 => ready.push(arrival(&f_end, (st - 1, mb), s.rank)),
                    ActionKind::I | ActionKind::B => {
                        ready.push(f_end[&(st, mb)].0);
                        if (st as usize) + 1 < plan.stages {
                            ready.push(arrival(&b_end, (st + 1, mb), s.rank));
                        }
                    }
                    ActionKind::W => ready.push(b_end[&(st, mb)].0),
                    _ => {}
                }
                for r in ready {
                    assert!(
                        s.start >= r - EPS,
                        "{what}: {} starts at {} before its input at {r}",
                        Action::to_string(&s.action),
                        s.start
                    );
                }
            }
        }
    }
}
