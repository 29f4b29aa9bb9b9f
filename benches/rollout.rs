//! Target-side cost of speculative decoding: one [`InferStage`] call over the whole model
//! (one stage, one thread) decoding one position per sequence against verifying K+1 = 5
//! positions per sequence, at batch 1, 2, 4 and 8, for a small (`d_model` 64) and a
//! weight-bound (`d_model` 256) target; and the drafter's proposal of K = 4 tokens. Every
//! call resumes at position 32 of a prefilled cache (the span rolls the cache back), so
//! each iteration does the same work. Afterwards a table of medians and the verify/decode
//! ratio is printed: speculation can only pay where the ratio is well under the acceptance
//! length.
//!
//! The pieces of one call at `d_model` 256, batch 1, one row (decode) against K+1 rows
//! (verification), to see where a verification's extra cost goes: the weight products
//! ([`rowmul`] through the model's 32 block matrices and the head) and the attention of the
//! new positions over a cache of `PAST` positions in every layer ([`attend`]); the rest of
//! a call (norms, activation, copies) is the difference to the whole call.
//!
//! `cargo bench -p pipefill --bench rollout`

use std::hint::black_box;

mod common;

use common::{median_ms, quick_criterion, timed};
use criterion::Criterion;
use pipefill::config::JobConfig;
use pipefill::data::SplitMix64;
use pipefill::model::drafter::{DraftContext, Drafter};
use pipefill::model::infer::attend::{Heads, attend};
use pipefill::model::infer::rowmul::{Packed, rowmul};
use pipefill::model::infer::{InferStage, Span, run_stages};
use pipefill::model::{Cut, Gpt, GptConfig};
use pipefill::tensor::CpuBackend;

const PAST: usize = 32;
const K: usize = 4;

fn config(d_model: usize) -> GptConfig {
    let mut c = JobConfig::default().model;
    c.d_model = d_model;
    c
}

/// Spans of `batch` sequences, each `len` new positions at `PAST`, and their token ids.
fn spans(batch: usize, len: usize) -> (Vec<Span>, Vec<u32>) {
    let spans = (0..batch)
        .map(|slot| Span {
            slot,
            start: PAST,
            len,
        })
        .collect();
    let ids = (0..batch * len).map(|i| 3 + (i % 40) as u32).collect();
    (spans, ids)
}

fn main() {
    let mut criterion = quick_criterion();
    let mut table = Vec::new();
    for d_model in [64, 256] {
        let cfg = config(d_model);
        let be = CpuBackend::new(1).expect("a one-thread backend");
        let gpt = Gpt::new(&cfg, be.clone(), &Cut::Even(1)).expect("the model");
        let mut stages = InferStage::stages_of(&gpt, &Cut::Even(1)).expect("the stage");
        let mut group = criterion.benchmark_group(format!("infer_d{d_model}"));
        for batch in [1, 2, 4, 8] {
            let (pre, pre_ids) = (
                (0..batch)
                    .map(|slot| Span {
                        slot,
                        start: 0,
                        len: PAST + K + 1,
                    })
                    .collect::<Vec<_>>(),
                vec![5u32; batch * (PAST + K + 1)],
            );
            run_stages(&mut stages, &pre, &pre_ids).expect("prefill");
            let mut ms = [0.0; 2];
            for (j, len) in [1, K + 1].into_iter().enumerate() {
                let (sp, ids) = spans(batch, len);
                let mut per = Vec::new();
                let name = if len == 1 { "decode" } else { "verify5" };
                group.bench_function(format!("{name}/batch{batch}"), |b| {
                    b.iter_custom(timed(&mut per, || {
                        black_box(run_stages(&mut stages, &sp, &ids).expect("a step"));
                    }))
                });
                ms[j] = median_ms(per);
            }
            table.push((d_model, batch, ms[0], ms[1]));
        }
        group.finish();
        // The drafter's proposal of K tokens per sequence over a full window of context.
        let job = JobConfig::default();
        let mut drafter = Drafter::new(&cfg, &job.drafter, be).expect("the drafter");
        let n = job.drafter.window;
        let hidden = vec![0.1f32; n * d_model];
        let tokens: Vec<u32> = (0..n).map(|i| 3 + (i % 40) as u32).collect();
        let mut rng = SplitMix64::new(1);
        for batch in [1, 4] {
            let ctx = vec![
                DraftContext {
                    hidden: &hidden,
                    tokens: &tokens,
                };
                batch
            ];
            let mut per = Vec::new();
            criterion.bench_function(&format!("propose_d{d_model}/k{K}/batch{batch}"), |b| {
                b.iter_custom(timed(&mut per, || {
                    black_box(drafter.propose(&ctx, K, 0.0, &mut rng).expect("a draft"));
                }))
            });
            println!(
                "d_model {d_model}: drafter proposal of K={K} at batch {batch} (window {n}): median {:.3} ms",
                median_ms(per)
            );
        }
    }
    let pieces = pieces(&mut criterion);
    criterion.final_summary();
    println!("d_model batch  decode ms  verify(K+1={}) ms  ratio", K + 1);
    for (d, b, dec, ver) in table {
        println!("{d:>7} {b:>5} {dec:>10.3} {ver:>18.3} {:>6.2}", ver / dec);
    }
    println!(
        "piece (d_model 256, batch 1)  1 row ms  {} rows ms  ratio",
        K + 1
    );
    for (name, one, many) in pieces {
        println!("{name:<28} {one:>9.3} {many:>10.3} {:>6.2}", many / one);
    }
}

/// The weight products and the attention of one call at `d_model` 256, batch 1, for one
/// row and for K+1 rows: `(piece, ms for 1, ms for K+1)`.
fn pieces(criterion: &mut Criterion) -> Vec<(&'static str, f64, f64)> {
    let cfg = config(256);
    let (d, h, v) = (cfg.d_model, cfg.mlp_hidden(), cfg.vocab);
    let mut rng = SplitMix64::new(7);
    let mut random = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| (rng.next_f64() as f32 - 0.5) * 0.1)
            .collect()
    };
    // Distinct matrices per layer, as in the model: 25 MB streamed per call.
    let mut mats = Vec::new();
    for _ in 0..cfg.layers {
        for (din, dout) in [(d, 3 * d), (d, d), (d, h), (h, d)] {
            mats.push((din, Packed::new(&random(din * dout), din, dout)));
        }
    }
    mats.push((d, Packed::new(&random(d * v), d, v)));
    let x = random((K + 1) * h);
    let (keys, values) = (random((PAST + K + 1) * d), random((PAST + K + 1) * d));
    let mut out = Vec::new();
    let mut group = criterion.benchmark_group("pieces_d256");
    let mut weights = [0.0; 2];
    for (j, rows) in [1, K + 1].into_iter().enumerate() {
        let mut per = Vec::new();
        group.bench_function(format!("weights/rows{rows}"), |b| {
            b.iter_custom(timed(&mut per, || {
                for (din, w) in &mats {
                    black_box(rowmul(&x[..rows * din], w, rows));
                }
            }))
        });
        weights[j] = median_ms(per);
    }
    out.push(("weight products (rowmul)", weights[0], weights[1]));
    let mut attn = [0.0; 2];
    for (j, rows) in [1, K + 1].into_iter().enumerate() {
        let mut per = Vec::new();
        let mut scores = Vec::new();
        let mut o = vec![0.0f32; d];
        group.bench_function(format!("attention/rows{rows}"), |b| {
            b.iter_custom(timed(&mut per, || {
                for _ in 0..cfg.layers {
                    for r in 0..rows {
                        let q = &x[r * d..(r + 1) * d];
                        attend(
                            q,
                            &keys,
                            &values,
                            PAST + r + 1,
                            Heads::mha(cfg.heads),
                            &mut scores,
                            &mut o,
                        );
                    }
                }
                black_box(&o);
            }))
        });
        attn[j] = median_ms(per);
    }
    out.push(("attention (attend)", attn[0], attn[1]));
    group.finish();
    out
}
