//! The target's verification cost per row: one [`InferStage`] call over the whole model
//! (one stage, one thread) decoding one position per sequence against verifying several
//! positions per sequence, as chains and as draft trees, at `d_model` 256 and 512 (8
//! layers, 4 heads: 25 MB and 100 MB of weights). Every call resumes at position `PAST`
//! of a prefilled cache (its span rolls the cache back, a tree's compaction is not
//! needed), so each iteration does the same work.
//!
//! Cases: 1 sequence × 1 (decode), 5 (K+1 = 5 chain), 13 and 20 rows (chains and trees);
//! 4, 8, 16 and 32 sequences × 1 and × 5 (up to 160 rows: either side of
//! `ROWMUL_MAX_ROWS`, where the products leave the packed row kernel for the GEMM). Afterwards a table of medians and each case's ratio to the
//! decode step of as many sequences: speculation pays only while that ratio stays well
//! under the tokens a step accepts.
//!
//! `cargo bench --bench verify` (a criterion filter such as `-- d512/tree13` runs one case,
//! e.g. under `perf record`; `VERIFY_D=512` builds only that model, so that building the
//! other one does not fill the profile; `VERIFY_THREADS=2` gives the backend a pool of
//! two threads, which the GEMM uses and the row kernel does not).

use std::hint::black_box;

mod common;

use common::{median_ms, model_config, quick_criterion, timed};
use pipefill::model::infer::{InferStage, Span, StageInput, StageOutput, TreeStep};
use pipefill::model::{Cut, Gpt};
use pipefill::tensor::CpuBackend;

/// Positions in each sequence's cache when a timed call starts.
const PAST: usize = 32;

/// A draft tree of `rows` rows (root included): three branches under the root, each
/// continued as a chain, nodes breadth first.
fn tree_parents(rows: usize) -> Vec<usize> {
    // Rows 1..=3 are the root's children; every later row extends the row three before it,
    // so the tree is three chains of about (rows - 1) / 3 nodes.
    (0..rows).map(|r| r.saturating_sub(3)).collect()
}

/// One case: name, sequences, rows per sequence, whether the rows form a tree.
struct Case {
    name: String,
    seqs: usize,
    rows: usize,
    tree: bool,
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for (seqs, rows, tree) in [
        (1, 1, false),
        (1, 5, false),
        (1, 13, false),
        (1, 13, true),
        (1, 20, false),
        (1, 20, true),
        (4, 1, false),
        (4, 5, false),
        (8, 1, false),
        (8, 5, false),
        (16, 1, false),
        (16, 5, false),
        (32, 1, false),
        (32, 5, false),
    ] {
        let kind = if tree { "tree" } else { "chain" };
        let name = if rows == 1 {
            format!("decode/seqs{seqs}")
        } else {
            format!("{kind}{rows}/seqs{seqs}")
        };
        out.push(Case {
            name,
            seqs,
            rows,
            tree,
        });
    }
    out
}

fn main() {
    let mut criterion = quick_criterion();
    // (d_model, case, median ms, decode ms of as many sequences)
    let mut table: Vec<(usize, String, usize, f64)> = Vec::new();
    let widths: Vec<usize> = match std::env::var("VERIFY_D") {
        Ok(v) => vec![v.parse().expect("VERIFY_D: a d_model such as 512")],
        Err(_) => vec![256, 512],
    };
    for d_model in widths {
        let cfg = model_config(d_model);
        let threads: usize = std::env::var("VERIFY_THREADS").map_or(1, |v| {
            v.parse()
                .expect("VERIFY_THREADS: the backend's thread count, such as 2")
        });
        let be = CpuBackend::new(threads).expect("the backend");
        let gpt = Gpt::new(&cfg, be, &Cut::Even(1)).expect("the model");
        let mut stages = InferStage::stages_of(&gpt, &Cut::Even(1)).expect("the stage");
        let stage = &mut stages[0];
        let most = cases().iter().map(|c| c.rows).max().unwrap_or(1);
        let slots = cases().iter().map(|c| c.seqs).max().unwrap_or(1);
        let prefill: Vec<Span> = (0..slots)
            .map(|slot| Span {
                slot,
                start: 0,
                len: PAST + most,
            })
            .collect();
        let ids = vec![5u32; slots * (PAST + most)];
        stage
            .forward(&prefill, StageInput::Tokens(&ids))
            .expect("prefill");
        let mut group = criterion.benchmark_group(format!("d{d_model}"));
        for case in cases() {
            let spans: Vec<Span> = (0..case.seqs)
                .map(|slot| Span {
                    slot,
                    start: PAST,
                    len: case.rows,
                })
                .collect();
            let step = TreeStep {
                parents: if case.tree {
                    vec![Some(tree_parents(case.rows)); case.seqs]
                } else {
                    Vec::new()
                },
                compact: Vec::new(),
            };
            let ids: Vec<u32> = (0..case.seqs * case.rows)
                .map(|i| 3 + (i % 40) as u32)
                .collect();
            let mut per = Vec::new();
            group.bench_function(&case.name, |b| {
                b.iter_custom(timed(&mut per, || {
                    let out = stage
                        .forward_with(&spans, Some(&step), StageInput::Tokens(&ids))
                        .expect("a step");
                    match out {
                        StageOutput::Final { logits, .. } => black_box(logits),
                        StageOutput::Hidden(_) => unreachable!("one stage holds the head"),
                    };
                }))
            });
            table.push((d_model, case.name, case.seqs, median_ms(per)));
        }
        group.finish();
    }
    criterion.final_summary();
    println!(
        "{:>7} {:<16} {:>10} {:>9}",
        "d_model", "case (medians)", "ms", "x decode"
    );
    for (d, name, seqs, ms) in &table {
        let decode = table
            .iter()
            .find(|(d2, n, s, _)| d2 == d && s == seqs && n.starts_with("decode"))
            .map_or(f64::NAN, |t| t.3);
        println!("{d:>7} {name:<16} {ms:>10.3} {:>9.2}", ms / decode);
    }
}
