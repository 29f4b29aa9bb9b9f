//! The drafter's proposal ([`Drafter::propose`], K = 4 tokens per sequence over a full
//! window of context) on a random drafter at `d_model` 256 and 512, for 1 and 4 contexts,
//! and the drafter's matrices one by one ([`rowmul_on`], each instruction set), so that a
//! proposal's cost and where it goes are reproducible.
//!
//! Each case runs in two cache states: `hot`, calls back to back (the drafter's weights,
//! 15 MB at `d_model` 512, stay in the 32 MB L3), and `cold`, 64 MB of other data read
//! between calls (untimed), as a rollout's verification streams the target's weights
//! between two proposals. And with two contexts: `memo`, the same contexts every call (the
//! context pairs' keys and values come from the memo, only each sequence's last pair runs
//! the block), and `fresh`, contexts never seen (the first proposal of a sequence: its
//! whole window runs through fc and the key/value product).
//!
//! Afterwards a table of medians. `cargo bench --bench propose`.

use std::hint::black_box;
use std::time::Duration;

mod common;

use common::{median_ms, model_config, quick_criterion, timed, timed_after};
use criterion::Bencher;
use pipefill::config::JobConfig;
use pipefill::data::SplitMix64;
use pipefill::model::drafter::{DraftContext, Drafter};
use pipefill::model::infer::rowmul::{Isa, Packed, Precision, rowmul_on};
use pipefill::tensor::CpuBackend;

const K: usize = 4;
/// Bytes read between two `cold` calls: twice the L3.
const EVICT_BYTES: usize = 64 << 20;

fn random(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next_f64() as f32 - 0.5) * 2.0 * scale)
        .collect()
}

/// Reads `buf` a line at a time, so that what was cached before is gone.
fn evict(buf: &[u8]) {
    black_box(buf.iter().step_by(64).fold(0u8, |a, &b| a ^ b));
}

/// Times `f` into `per`, after evicting the caches (untimed) when `cold`.
fn bench(b: &mut Bencher<'_>, per: &mut Vec<Duration>, cold: Option<&[u8]>, f: impl FnMut()) {
    match cold {
        Some(buf) => b.iter_custom(timed_after(per, || evict(buf), f)),
        None => b.iter_custom(timed(per, f)),
    }
}

/// `(precision, fresh, cold)` of each proposal case.
fn cases() -> Vec<(Precision, bool, bool)> {
    let mut out = Vec::new();
    for precision in [Precision::F32, Precision::F16] {
        for fresh in [false, true] {
            for cold in [false, true] {
                out.push((precision, fresh, cold));
            }
        }
    }
    out
}

fn main() {
    let mut criterion = quick_criterion();
    let evict_buf = vec![1u8; EVICT_BYTES];
    let job = JobConfig::default();
    let n = job.drafter.window;
    // (case, ms)
    let mut table: Vec<(String, f64)> = Vec::new();
    for d in [256, 512] {
        let cfg = model_config(d);
        let be = CpuBackend::new(1).expect("a one-thread backend");
        let mut drafter = Drafter::new(&cfg, &job.drafter, be).expect("the drafter");
        let mut rng = SplitMix64::new(3);
        let mut group = criterion.benchmark_group(format!("propose_d{d}"));
        for batch in [1, 4] {
            let hidden: Vec<Vec<f32>> = (0..batch).map(|_| random(&mut rng, n * d, 1.0)).collect();
            let tokens: Vec<Vec<u32>> = (0..batch)
                .map(|b| {
                    (0..n)
                        .map(|i| ((3 + 7 * b + i) % cfg.vocab) as u32)
                        .collect()
                })
                .collect();
            for (precision, fresh, cold) in cases() {
                drafter.set_proposal_precision(precision);
                let name = format!(
                    "k{K}/batch{batch}/{precision:?}/{}/{}",
                    if fresh { "fresh" } else { "memo" },
                    state(cold)
                );
                let mut per = Vec::new();
                let mut hidden = hidden.clone();
                let mut draw = SplitMix64::new(1);
                let mut calls = 0u32;
                let mut body = || {
                    if fresh {
                        // A new value in every pair: no pair was seen before.
                        calls += 1;
                        for h in &mut hidden {
                            for pair in h.chunks_exact_mut(d) {
                                pair[0] = calls as f32 * 1e-3;
                            }
                        }
                    }
                    let ctx: Vec<DraftContext<'_>> = hidden
                        .iter()
                        .zip(&tokens)
                        .map(|(h, t)| DraftContext {
                            hidden: h,
                            tokens: t,
                        })
                        .collect();
                    black_box(drafter.propose(&ctx, K, 0.0, &mut draw).expect("a draft"));
                };
                group.bench_function(&name, |b| {
                    bench(b, &mut per, cold.then_some(&evict_buf), &mut body)
                });
                table.push((format!("propose d{d} {name}"), median_ms(per)));
            }
        }
        group.finish();
    }
    matrices(&mut criterion, &evict_buf, &mut table);
    criterion.final_summary();
    println!("{:<44} {:>9}", "case (medians)", "ms");
    // Cases a filter left out have no time.
    for (name, ms) in table.iter().filter(|(_, ms)| ms.is_finite()) {
        println!("{name:<44} {ms:>9.4}");
    }
}

/// The drafter's matrices at `d_model` 512 (one draft step's products, 14 MB in f32), on
/// each kernel the CPU has, in f32 and f16: all of them for 1 and 4 rows, hot and cold, and
/// each alone for 1 row, cold.
fn matrices(
    criterion: &mut criterion::Criterion,
    evict_buf: &[u8],
    table: &mut Vec<(String, f64)>,
) {
    let cfg = model_config(512);
    let (d, h, v) = (cfg.d_model, cfg.mlp_hidden(), cfg.vocab);
    let mut rng = SplitMix64::new(9);
    let shapes = [
        ("fc", 2 * d, d),
        ("wq", d, d),
        ("wkv", d, 2 * d),
        ("wo", d, d),
        ("w1", d, h),
        ("w2", h, d),
        ("head", d, v),
    ];
    let weights: Vec<Vec<f32>> = shapes
        .iter()
        .map(|&(_, din, dout)| random(&mut rng, din * dout, 0.05))
        .collect();
    let x = random(&mut rng, 4 * h, 1.0);
    let isas: Vec<Isa> = [Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|i| i.is_available())
        .collect();
    let mut group = criterion.benchmark_group("drafter_matrices_d512");
    for precision in [Precision::F32, Precision::F16] {
        let mats: Vec<(&str, usize, Packed)> = shapes
            .iter()
            .zip(&weights)
            .map(|(&(name, din, dout), w)| {
                let p = Packed::with_precision(w, din, dout, precision).expect("in range");
                (name, din, p)
            })
            .collect();
        for rows in [1, 4] {
            for cold in [false, true] {
                for &isa in &isas {
                    let at = format!("{isa:?}/{precision:?}/rows{rows}/{}", state(cold));
                    let mut per = Vec::new();
                    group.bench_function(format!("all/{at}"), |b| {
                        bench(b, &mut per, cold.then_some(evict_buf), || {
                            for (_, din, w) in &mats {
                                let y = rowmul_on(isa, &x[..rows * din], w, rows);
                                black_box(y.expect("rowmul"));
                            }
                        })
                    });
                    table.push((format!("step d512 {at}"), median_ms(per)));
                    if rows > 1 || !cold {
                        continue;
                    }
                    for (name, din, w) in &mats {
                        let mut per = Vec::new();
                        group.bench_function(format!("{name}/{at}"), |b| {
                            bench(b, &mut per, cold.then_some(evict_buf), || {
                                black_box(rowmul_on(isa, &x[..rows * din], w, 1).expect("rowmul"));
                            })
                        });
                        table.push((format!("  {name} {at}"), median_ms(per)));
                    }
                }
            }
        }
    }
    group.finish();
}

fn state(cold: bool) -> &'static str {
    if cold { "cold" } else { "hot" }
}
