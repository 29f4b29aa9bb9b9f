//! Every CPU operation against a naive `f64` reference on small shapes. Backward operations
//! are checked against central finite differences of the `f64` reference forward, so a
//! wrong formula fails even if forward and backward share a mistake.

mod attention;
mod blocks;
mod fused_head_ops;
mod host_bytes;
mod llama_ops;

use super::*;
use crate::tensor::{
    Activation, AdamWStep, AttnShape, Backend, BatchedGemm, DType, Gemm, IGNORE_TARGET,
};

/// Deterministic pseudo-random values in [-1, 1).
fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn wide(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// Central finite differences of `f` at `x`.
fn fd(f: impl Fn(&[f64]) -> f64, x: &[f64]) -> Vec<f64> {
    let h = 1e-6;
    let mut x = x.to_vec();
    (0..x.len())
        .map(|i| {
            let x0 = x[i];
            x[i] = x0 + h;
            let up = f(&x);
            x[i] = x0 - h;
            let down = f(&x);
            x[i] = x0;
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// Asserts `|got − want| ≤ tol·(1 + |want|)` element by element.
fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w} (err {err:e})"
        );
    }
}

fn backends() -> Vec<CpuBackend> {
    vec![CpuBackend::new(1).unwrap(), CpuBackend::new(2).unwrap()]
}

fn buf(be: &CpuBackend, x: &[f32]) -> CpuBuf {
    be.from_host(x, DType::F32).unwrap()
}

fn host(be: &CpuBackend, b: &CpuBuf) -> Vec<f32> {
    be.to_host(b).unwrap()
}

/// Naive `op(A)·op(B)` in f64.
fn naive_matmul(a: &[f32], b: &[f32], g: Gemm) -> Vec<f64> {
    let Gemm {
        m,
        k,
        n,
        trans_a,
        trans_b,
        ..
    } = g;
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                let av = if trans_a { a[p * m + i] } else { a[i * k + p] };
                let bv = if trans_b { b[j * k + p] } else { b[p * n + j] };
                c[i * n + j] += f64::from(av) * f64::from(bv);
            }
        }
    }
    c
}

#[test]
fn matmul_all_transposes_and_accumulate() {
    for be in backends() {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let (m, k, n) = (5, 7, 3);
            let g = Gemm {
                m,
                k,
                n,
                trans_a: ta,
                trans_b: tb,
                accumulate: false,
            };
            let (a, b) = (rand_vec(1, m * k), rand_vec(2, k * n));
            let mut c = buf(&be, &rand_vec(3, m * n));
            be.matmul(&buf(&be, &a), &buf(&be, &b), &mut c, g).unwrap();
            assert_close("matmul", &host(&be, &c), &naive_matmul(&a, &b, g), 1e-5);
            // accumulate adds the product to what is there
            let before = rand_vec(4, m * n);
            let mut c = buf(&be, &before);
            be.matmul(&buf(&be, &a), &buf(&be, &b), &mut c, g.accumulate())
                .unwrap();
            let want: Vec<f64> = naive_matmul(&a, &b, g)
                .iter()
                .zip(&before)
                .map(|(p, &c)| p + f64::from(c))
                .collect();
            assert_close("matmul acc", &host(&be, &c), &want, 1e-5);
        }
    }
}

#[test]
fn matmul_larger_parallel_matches_serial() {
    let (m, k, n) = (96, 130, 70);
    let (a, b) = (rand_vec(5, m * k), rand_vec(6, k * n));
    let g = Gemm::nn(m, k, n);
    let want = naive_matmul(&a, &b, g);
    for be in backends() {
        let mut c = be.zeros(m * n, DType::F32).unwrap();
        be.matmul(&buf(&be, &a), &buf(&be, &b), &mut c, g).unwrap();
        assert_close("matmul big", &host(&be, &c), &want, 1e-4);
    }
}

/// Products give the same bits on 1 and on 2 threads whatever computes them (gemm, faer
/// for a transposed right operand, or MKL in its strict reproducible mode, `blas.rs`): the
/// pipeline's stages and the reference trainer may run on different thread counts and must
/// agree bitwise. The odd shapes are ones at which MKL's products without that mode change
/// with the thread count (a K between one and two of its blocks). Each agrees with the
/// naive product.
#[test]
fn matmul_same_bits_on_any_thread_count() {
    for (m, k, n) in [(64, 600, 48), (37, 1001, 515), (128, 700, 300)] {
        assert!(m * k * n >= super::PARALLEL_WORK);
        let (a, b) = (rand_vec(7, m * k), rand_vec(8, k * n));
        let before = rand_vec(9, m * n);
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let g = Gemm {
                trans_a: ta,
                trans_b: tb,
                ..Gemm::nn(m, k, n)
            };
            for g in [g, g.accumulate()] {
                let got: Vec<Vec<f32>> = [1, 2]
                    .map(|threads| {
                        let be = CpuBackend::new(threads).unwrap();
                        let mut c = buf(&be, &before);
                        be.matmul(&buf(&be, &a), &buf(&be, &b), &mut c, g).unwrap();
                        host(&be, &c)
                    })
                    .into();
                assert_eq!(got[0], got[1], "{g:?}");
                let want: Vec<f64> = naive_matmul(&a, &b, g)
                    .iter()
                    .zip(&before)
                    .map(|(p, &c)| p + if g.accumulate { f64::from(c) } else { 0.0 })
                    .collect();
                assert_close("product", &got[0], &want, 1e-4);
            }
        }
    }
}

#[test]
fn matmul_batched_strided_and_broadcast() {
    let be = CpuBackend::new(1).unwrap();
    let (batch, m, k, n) = (3, 4, 5, 2);
    let a = rand_vec(7, batch * m * k);
    let b = rand_vec(8, k * n); // stride 0: shared by every product
    let g = BatchedGemm {
        gemm: Gemm::nn(m, k, n),
        batch,
        stride_a: m * k,
        stride_b: 0,
        stride_c: m * n,
    };
    let mut c = be.zeros(batch * m * n, DType::F32).unwrap();
    be.matmul_batched(&buf(&be, &a), &buf(&be, &b), &mut c, g)
        .unwrap();
    let got = host(&be, &c);
    for i in 0..batch {
        let want = naive_matmul(&a[i * m * k..(i + 1) * m * k], &b, g.gemm);
        assert_close("batched", &got[i * m * n..(i + 1) * m * n], &want, 1e-5);
    }
    // An output stride of 0 without accumulate is refused, not silently wrong.
    let g0 = BatchedGemm { stride_c: 0, ..g };
    let mut c0 = be.zeros(m * n, DType::F32).unwrap();
    assert!(
        be.matmul_batched(&buf(&be, &a), &buf(&be, &b), &mut c0, g0)
            .is_err()
    );
}

#[test]
fn shape_errors_name_the_operand() {
    let be = CpuBackend::new(1).unwrap();
    let a = be.zeros(6, DType::F32).unwrap();
    let b = be.zeros(5, DType::F32).unwrap();
    let mut c = be.zeros(4, DType::F32).unwrap();
    let err = be.matmul(&a, &b, &mut c, Gemm::nn(2, 3, 2)).unwrap_err();
    assert!(err.to_string().contains("operand `b`"), "{err}");
    let table = be.zeros(4 * 2, DType::F32).unwrap();
    let mut out = be.zeros(2 * 2, DType::F32).unwrap();
    let err = be.embedding_fwd(&table, &[1, 4], &mut out, 2).unwrap_err();
    assert!(err.to_string().contains("id 4 at position 1"), "{err}");
}

#[test]
fn elementwise_ops() {
    let be = CpuBackend::new(1).unwrap();
    let (x, y) = (rand_vec(9, 10), rand_vec(10, 10));
    let mut out = be.zeros(10, DType::F32).unwrap();
    be.add(&buf(&be, &x), &buf(&be, &y), &mut out).unwrap();
    let want: Vec<f64> = x.iter().zip(&y).map(|(a, b)| f64::from(a + b)).collect();
    assert_close("add", &host(&be, &out), &want, 1e-7);
    be.axpy(-2.0, &buf(&be, &x), &mut out).unwrap();
    let want: Vec<f64> = x.iter().zip(&y).map(|(a, b)| f64::from(b - a)).collect();
    assert_close("axpy", &host(&be, &out), &want, 1e-6);
    be.scale(&mut out, 3.0).unwrap();
    let want: Vec<f64> = want.iter().map(|v| 3.0 * v).collect();
    assert_close("scale", &host(&be, &out), &want, 1e-6);
    be.fill(&mut out, 0.5).unwrap();
    assert!(host(&be, &out).iter().all(|&v| v == 0.5));
    assert_eq!(be.sum_squares(&buf(&be, &[3.0, 4.0])).unwrap(), 25.0);
}

fn act_ref(act: Activation, x: f64) -> f64 {
    match act {
        Activation::Gelu => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x.powi(3))).tanh())
        }
        Activation::Silu | Activation::Swiglu => x / (1.0 + (-x).exp()),
    }
}

#[test]
fn activations_forward_and_gradient() {
    let be = CpuBackend::new(1).unwrap();
    let x: Vec<f32> = rand_vec(11, 16).iter().map(|v| v * 3.0).collect();
    let dy = rand_vec(12, 16);
    for act in [Activation::Gelu, Activation::Silu, Activation::Swiglu] {
        let mut out = be.zeros(16, DType::F32).unwrap();
        be.activation_fwd(act, &buf(&be, &x), &mut out).unwrap();
        let want: Vec<f64> = x.iter().map(|&v| act_ref(act, f64::from(v))).collect();
        assert_close("act fwd", &host(&be, &out), &want, 1e-6);
        let mut dx = be.zeros(16, DType::F32).unwrap();
        be.activation_bwd(act, &buf(&be, &x), &buf(&be, &dy), &mut dx)
            .unwrap();
        let dyw = wide(&dy);
        let loss = |x: &[f64]| x.iter().zip(&dyw).map(|(&x, d)| d * act_ref(act, x)).sum();
        assert_close("act bwd", &host(&be, &dx), &fd(loss, &wide(&x)), 1e-5);
    }
}

#[test]
fn softmax_rows_matches_reference() {
    let be = CpuBackend::new(2).unwrap();
    let x: Vec<f32> = rand_vec(13, 3 * 5).iter().map(|v| v * 10.0).collect();
    let mut out = be.zeros(15, DType::F32).unwrap();
    be.softmax_rows(&buf(&be, &x), &mut out, 3, 5).unwrap();
    let mut want = vec![0.0; 15];
    for r in 0..3 {
        let row = &x[r * 5..(r + 1) * 5];
        let z: f64 = row.iter().map(|&v| f64::from(v).exp()).sum();
        for j in 0..5 {
            want[r * 5 + j] = f64::from(row[j]).exp() / z;
        }
    }
    assert_close("softmax", &host(&be, &out), &want, 1e-6);
}

fn rmsnorm_ref(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let dim = w.len();
    x.chunks(dim)
        .flat_map(|row| {
            let s = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / dim as f64 + eps).sqrt();
            row.iter()
                .zip(w)
                .map(move |(v, w)| v * s * w)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn rmsnorm_forward_and_both_gradients() {
    let (rows, dim, eps) = (3, 6, 1e-5);
    let x = rand_vec(14, rows * dim);
    let w: Vec<f32> = rand_vec(15, dim).iter().map(|v| 1.0 + 0.5 * v).collect();
    let dy = rand_vec(16, rows * dim);
    let (xw, ww, dyw) = (wide(&x), wide(&w), wide(&dy));
    for be in backends() {
        let (mut y, mut rstd) = (
            be.zeros(rows * dim, DType::F32).unwrap(),
            be.zeros(rows, DType::F32).unwrap(),
        );
        let (xb, wb) = (buf(&be, &x), buf(&be, &w));
        be.rmsnorm_fwd(&xb, &wb, &mut y, &mut rstd, rows, dim, eps as f32)
            .unwrap();
        assert_close(
            "rmsnorm fwd",
            &host(&be, &y),
            &rmsnorm_ref(&xw, &ww, eps),
            1e-5,
        );
        let mut dx = be.zeros(rows * dim, DType::F32).unwrap();
        be.rmsnorm_bwd_input(&xb, &wb, &rstd, &buf(&be, &dy), &mut dx, rows, dim)
            .unwrap();
        let lx = |x: &[f64]| {
            rmsnorm_ref(x, &ww, eps)
                .iter()
                .zip(&dyw)
                .map(|(a, b)| a * b)
                .sum()
        };
        assert_close("rmsnorm dx", &host(&be, &dx), &fd(lx, &xw), 1e-4);
        let mut dw = buf(&be, &vec![1.0; dim]); // accumulates onto 1
        be.rmsnorm_bwd_weight(&xb, &rstd, &buf(&be, &dy), &mut dw, rows, dim)
            .unwrap();
        let lw = |w: &[f64]| {
            rmsnorm_ref(&xw, w, eps)
                .iter()
                .zip(&dyw)
                .map(|(a, b)| a * b)
                .sum()
        };
        let want: Vec<f64> = fd(lw, &ww).iter().map(|g| g + 1.0).collect();
        assert_close("rmsnorm dw", &host(&be, &dw), &want, 1e-4);
    }
}

#[test]
fn embedding_gather_and_scatter_add() {
    let be = CpuBackend::new(1).unwrap();
    let (vocab, dim) = (4, 3);
    let table = rand_vec(21, vocab * dim);
    let ids = [2u32, 0, 2, 3];
    let mut out = be.zeros(ids.len() * dim, DType::F32).unwrap();
    be.embedding_fwd(&buf(&be, &table), &ids, &mut out, dim)
        .unwrap();
    let got = host(&be, &out);
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(
            got[i * dim..(i + 1) * dim],
            table[id as usize * dim..][..dim]
        );
    }
    // A bf16 table gives its rounded rows, gathered without widening the rest of it.
    let half = be.from_host(&table, DType::Bf16).unwrap();
    let mut out16 = be.zeros(ids.len() * dim, DType::F32).unwrap();
    be.embedding_fwd(&half, &ids, &mut out16, dim).unwrap();
    let rounded = host(&be, &half);
    let got16 = host(&be, &out16);
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(
            got16[i * dim..(i + 1) * dim],
            rounded[id as usize * dim..][..dim]
        );
    }
    let dy = rand_vec(22, ids.len() * dim);
    let mut dt = buf(&be, &vec![1.0; vocab * dim]);
    be.embedding_bwd(&ids, &buf(&be, &dy), &mut dt, dim)
        .unwrap();
    let mut want = vec![1.0f64; vocab * dim];
    for (i, &id) in ids.iter().enumerate() {
        for e in 0..dim {
            want[id as usize * dim + e] += f64::from(dy[i * dim + e]);
        }
    }
    assert_close("embedding bwd", &host(&be, &dt), &want, 1e-6);
}

#[test]
fn broadcast_rows_and_sum_rows() {
    let be = CpuBackend::new(1).unwrap();
    let row = rand_vec(23, 8); // longer than the 6 used
    let mut dst = buf(&be, &[1.0; 2 * 6]);
    be.add_broadcast_rows(&buf(&be, &row), &mut dst, 2, 6)
        .unwrap();
    let want: Vec<f64> = (0..12).map(|i| 1.0 + f64::from(row[i % 6])).collect();
    assert_close("broadcast", &host(&be, &dst), &want, 1e-6);
    let mut out = be.zeros(8, DType::F32).unwrap();
    be.sum_rows(&dst, &mut out, 2, 6).unwrap();
    let mut want: Vec<f64> = (0..6).map(|i| 2.0 * (1.0 + f64::from(row[i]))).collect();
    want.extend([0.0, 0.0]);
    assert_close("sum_rows", &host(&be, &out), &want, 1e-6);
}

fn ce_ref(logits: &[f64], targets: &[u32], vocab: usize) -> f64 {
    let mut sum = 0.0;
    for (r, &t) in targets.iter().enumerate() {
        if t == IGNORE_TARGET {
            continue;
        }
        let row = &logits[r * vocab..(r + 1) * vocab];
        let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
        sum += lse - row[t as usize];
    }
    sum
}

#[test]
fn cross_entropy_loss_gradient_and_ignored_targets() {
    let (rows, vocab) = (4, 5);
    let logits: Vec<f32> = rand_vec(24, rows * vocab).iter().map(|v| v * 4.0).collect();
    let targets = [1u32, IGNORE_TARGET, 4, 0];
    for be in backends() {
        let lb = buf(&be, &logits);
        let mut probs = be.zeros(rows * vocab, DType::F32).unwrap();
        let (sum, count) = be
            .cross_entropy_fwd(&lb, &targets, &mut probs, vocab)
            .unwrap();
        assert_eq!(count, 3);
        let want = ce_ref(&wide(&logits), &targets, vocab);
        assert!((f64::from(sum) - want).abs() < 1e-5, "{sum} vs {want}");
        let mut dl = be.zeros(rows * vocab, DType::F32).unwrap();
        be.cross_entropy_bwd(&probs, &targets, &mut dl, vocab, 0.5)
            .unwrap();
        let fdv = fd(|l| 0.5 * ce_ref(l, &targets, vocab), &wide(&logits));
        assert_close("ce bwd", &host(&be, &dl), &fdv, 1e-5);
        let err = be
            .cross_entropy_fwd(&lb, &[1, 2, 5, 0], &mut probs, vocab)
            .unwrap_err();
        assert!(err.to_string().contains("id 5 at position 2"), "{err}");
    }
}

#[test]
fn adamw_matches_hand_computed_update() {
    let be = CpuBackend::new(1).unwrap();
    let hp = AdamWStep {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.01,
        step: 1,
        grad_scale: 0.5,
    };
    let mut p = buf(&be, &[1.0, -2.0]);
    let (mut m, mut v) = (
        be.zeros(2, DType::F32).unwrap(),
        be.zeros(2, DType::F32).unwrap(),
    );
    be.adamw_step(&mut p, None, &buf(&be, &[0.4, -0.2]), &mut m, &mut v, hp)
        .unwrap();
    // step 1: m̂ = g, v̂ = g², so the Adam direction is sign(g) (up to eps).
    // g = 0.5·[0.4, -0.2] = [0.2, -0.1]; p -= 0.1·(sign(g) + 0.01·p).
    let want = [1.0 - 0.1 * (1.0 + 0.01), -2.0 - 0.1 * (-1.0 + 0.01 * -2.0)];
    assert_close("adamw p", &host(&be, &p), &want, 1e-6);
    assert_close("adamw m", &host(&be, &m), &[0.1 * 0.2, 0.1 * -0.1], 1e-7);
    assert_close("adamw v", &host(&be, &v), &[0.01 * 0.04, 0.01 * 0.01], 1e-7);
}

#[test]
fn bf16_storage_rounds_and_master_keeps_precision() {
    let be = CpuBackend::new(1).unwrap().with_storage(DType::Bf16);
    assert_eq!(be.storage_dtype(), DType::Bf16);
    let x = [1.0f32, 1.001, -3.3];
    let b = be.from_host(&x, DType::Bf16).unwrap();
    assert_eq!(be.dtype(&b), DType::Bf16);
    let back = host(&be, &b);
    assert_eq!(back[0], 1.0);
    assert_eq!(back[1], 1.0); // 1.001 is below bf16's resolution at 1
    assert_eq!(back[2], -3.296875); // 7-bit mantissa: 211/128 · 2
    // An update too small for bf16 is kept by the f32 master and shows up once it adds up.
    let mut p = be.from_host(&[1.0], DType::Bf16).unwrap();
    let mut master = be.from_host(&[1.0], DType::F32).unwrap();
    let (mut m, mut v) = (
        be.zeros(1, DType::F32).unwrap(),
        be.zeros(1, DType::F32).unwrap(),
    );
    let g = buf(&be, &[1.0]);
    for step in 1..=4 {
        let hp = AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            step,
            grad_scale: 1.0,
        };
        be.adamw_step(&mut p, Some(&mut master), &g, &mut m, &mut v, hp)
            .unwrap();
    }
    let mval = host(&be, &master)[0];
    assert!((mval - 0.996).abs() < 1e-5, "master {mval}");
    assert_eq!(host(&be, &p)[0], half::bf16::from_f32(mval).to_f32());
    // Mixed-storage operations widen and round transparently.
    let mut out = be.zeros(3, DType::Bf16).unwrap();
    be.add(&b, &buf(&be, &[0.5, 0.5, 0.5]), &mut out).unwrap();
    assert_eq!(host(&be, &out)[0], 1.5);
}

#[test]
fn single_thread_backend_has_no_pool() {
    let one = CpuBackend::new(1).unwrap();
    assert!(one.pool.is_none());
    assert!(one.name().starts_with("cpu (1 thread"), "{}", one.name());
    let two = CpuBackend::new(2).unwrap();
    assert_eq!(two.threads(), 2);
    // Big operations of the 2-thread backend run on its own pool's threads, small ones stay
    // on the caller's.
    let on = |work| {
        two.run(work, |par| {
            (par, std::thread::current().name().map(str::to_string))
        })
    };
    let (par, name) = on(super::PARALLEL_WORK);
    assert!(par && name.unwrap_or_default().starts_with("pipefill-cpu-"));
    let (par, name) = on(10);
    assert!(!par && name == std::thread::current().name().map(str::to_string));
    assert!(!one.run(usize::MAX, |par| par));
}

/// With `k = 0` each product is an empty sum: its `[m, n]` block of `c` becomes 0 (or keeps
/// its values when accumulating), and the elements between blocks are left alone.
#[test]
fn matmul_batched_with_k_0_zeroes_only_the_output_blocks() {
    let be = CpuBackend::new(1).unwrap();
    let (batch, m, n, stride_c) = (3, 2, 2, 6);
    let g = BatchedGemm {
        gemm: Gemm::nn(m, 0, n),
        batch,
        stride_a: 0,
        stride_b: 0,
        stride_c,
    };
    let before: Vec<f32> = (1..=(batch - 1) * stride_c + m * n)
        .map(|i| i as f32)
        .collect();
    let (a, b) = (buf(&be, &[]), buf(&be, &[]));
    let mut c = buf(&be, &before);
    be.matmul_batched(&a, &b, &mut c, g).unwrap();
    let got = host(&be, &c);
    for (i, (&g, &x)) in got.iter().zip(&before).enumerate() {
        let in_block = i % stride_c < m * n;
        assert_eq!(g, if in_block { 0.0 } else { x }, "element {i}: {got:?}");
    }
    let mut c = buf(&be, &before);
    let acc = BatchedGemm {
        gemm: g.gemm.accumulate(),
        ..g
    };
    be.matmul_batched(&a, &b, &mut c, acc).unwrap();
    assert_eq!(host(&be, &c), before);
}
