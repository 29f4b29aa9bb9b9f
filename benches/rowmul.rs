//! [`rowmul`] at the shapes of the `d_model` 512 target that `pipefill bench rollout`
//! decodes with: the fused `[wq | wk | wv]` (512 → 1536), the attention output (512 → 512),
//! the MLP (512 → 2048, 2048 → 512), the LM head (512 → vocab) and the whole model (8 such
//! layers and the head, 100 MB), for 1, 2, 5, 8, 10 and 20 rows (decode of one sequence,
//! verification of K+1 = 5 positions of 1, 2 and 4 sequences), on each instruction set the
//! CPU has.
//!
//! Weights come from memory, as in a model call (which streams 100 MB, far beyond the L3):
//! each shape has enough distinct copies to fill 64 MB and every call takes the next one.
//! Afterwards a table of medians: ms per call, the ratio to one row (how close verifying
//! several rows comes to the cost of one memory-bound decode), and AVX-512 against AVX2.
//!
//! `cargo bench --bench rowmul` (`-- --measurement-time 2` for steadier figures).

use std::hint::black_box;

mod common;

use common::{median_ms, quick_criterion, timed};
use pipefill::data::SplitMix64;
use pipefill::model::GptConfig;
use pipefill::model::infer::rowmul::{Isa, Packed, rowmul_on};

const ROWS: [usize; 6] = [1, 2, 5, 8, 10, 20];
/// Bytes of distinct weights each case cycles through: twice the 32 MB L3.
const STREAM_BYTES: usize = 64 << 20;

/// One timed call: the matrices multiplied in turn, `(din, packed)`.
type Set = Vec<(usize, Packed)>;

fn random(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next_f64() as f32 - 0.5) * 0.1)
        .collect()
}

/// The cases: a name and the sets one cycles through (each set one call).
fn cases() -> Vec<(String, Vec<Set>)> {
    let cfg = GptConfig {
        d_model: 512,
        ..GptConfig::default()
    };
    let (d, h, v) = (cfg.d_model, cfg.mlp_hidden(), cfg.vocab);
    let mut rng = SplitMix64::new(11);
    let mut pack =
        |din: usize, dout: usize| (din, Packed::new(&random(&mut rng, din * dout), din, dout));
    let mut out = Vec::new();
    for (name, din, dout) in [
        ("qkv", d, 3 * d),
        ("wo", d, d),
        ("w1", d, h),
        ("w2", h, d),
        ("head", d, v),
    ] {
        let copies = STREAM_BYTES.div_ceil(din * dout * 4);
        let sets = (0..copies).map(|_| vec![pack(din, dout)]).collect();
        out.push((format!("{name} {din}->{dout}"), sets));
    }
    let mut model = Vec::new();
    for _ in 0..cfg.layers {
        for (din, dout) in [(d, 3 * d), (d, d), (d, h), (h, d)] {
            model.push(pack(din, dout));
        }
    }
    model.push(pack(d, v));
    out.push((format!("model ({} layers + head)", cfg.layers), vec![model]));
    out
}

fn main() {
    let mut criterion = quick_criterion();
    let isas: Vec<Isa> = [Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|i| i.is_available())
        .collect();
    let mut rng = SplitMix64::new(5);
    // Widest row: the MLP's hidden.
    let x = random(&mut rng, ROWS[ROWS.len() - 1] * 4 * 512);
    // (case, rows, ms per isa)
    let mut table: Vec<(String, usize, Vec<f64>)> = Vec::new();
    for (name, sets) in cases() {
        let mut group = criterion.benchmark_group(name.replace([' ', '>', '(', ')', '+'], "_"));
        for rows in ROWS {
            let mut ms = Vec::new();
            for &isa in &isas {
                let mut per = Vec::new();
                let mut next = 0;
                group.bench_function(format!("{isa:?}/rows{rows}"), |b| {
                    b.iter_custom(timed(&mut per, || {
                        let set = &sets[next % sets.len()];
                        next += 1;
                        for (din, w) in set {
                            let y = rowmul_on(isa, &x[..rows * din], w, rows);
                            black_box(y.expect("rowmul"));
                        }
                    }))
                });
                ms.push(median_ms(per));
            }
            table.push((name.clone(), rows, ms));
        }
        group.finish();
    }
    criterion.final_summary();
    print!("{:<26} {:>4}", "shape (medians)", "rows");
    for isa in &isas {
        print!(" {:>12} {:>7}", format!("{isa:?} ms"), "x1row");
    }
    if isas.len() == 2 {
        print!(" {:>11}", "512/avx2");
    }
    println!();
    for (i, (name, rows, ms)) in table.iter().enumerate() {
        // The one-row figure of the same case and instruction set.
        let one = &table[i - ROWS.iter().position(|r| r == rows).unwrap_or(0)].2;
        print!("{name:<26} {rows:>4}");
        for (m, o) in ms.iter().zip(one) {
            print!(" {m:>12.4} {:>7.2}", m / o);
        }
        if ms.len() == 2 {
            print!(" {:>11.2}", ms[1] / ms[0]);
        }
        println!();
    }
}
