//! bf16 operands widened a block of rows at a time (`buf::zip_rows`, the blocked products):
//! the values of widening every operand whole, computing in f32 and rounding each output
//! once, on buffers that span several blocks and end in a partial one.

use super::*;
use crate::tensor::cpu::buf::WIDEN_BLOCK;

/// Rows of `dim` values spanning three blocks and part of a fourth.
fn rows(dim: usize) -> usize {
    3 * WIDEN_BLOCK / dim + 7
}

fn bf(be: &CpuBackend, x: &[f32]) -> CpuBuf {
    be.from_host(x, DType::Bf16).unwrap()
}

/// `x` as bf16 holds it, in an f32 buffer.
fn widened(be: &CpuBackend, x: &[f32]) -> CpuBuf {
    buf(be, &rounded(x))
}

fn rounded(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect()
}

#[test]
fn elementwise_and_row_operations_on_bf16_blocks_equal_the_whole_f32_rounded() {
    let (dim, heads) = (96, 2);
    let n = rows(dim);
    let len = n * dim;
    let (x, y, w) = (rand_vec(1, len), rand_vec(2, len), rand_vec(3, dim));
    for be in backends() {
        let (bx, by, bw) = (bf(&be, &x), bf(&be, &y), bf(&be, &w));
        let (fx, fy, fw) = (widened(&be, &x), widened(&be, &y), widened(&be, &w));
        let same = |what: &str, blocked: &CpuBuf, whole: &CpuBuf| {
            assert_eq!(host(&be, blocked), rounded(&host(&be, whole)), "{what}");
        };
        // Element-wise, output bf16.
        let mut out = be.zeros(len, DType::Bf16).unwrap();
        let mut want = be.zeros(len, DType::F32).unwrap();
        be.add(&bx, &by, &mut out).unwrap();
        be.add(&fx, &fy, &mut want).unwrap();
        same("add", &out, &want);
        be.mul(&bx, &by, &mut out).unwrap();
        be.mul(&fx, &fy, &mut want).unwrap();
        same("mul", &out, &want);
        // Accumulating into a bf16 destination reads its rounded values.
        let mut want = widened(&be, &host(&be, &out));
        be.axpy(0.75, &by, &mut out).unwrap();
        be.axpy(0.75, &fy, &mut want).unwrap();
        same("axpy", &out, &want);
        be.scale(&mut out, -1.5).unwrap();
        let mut want = widened(&be, &host(&be, &want));
        be.scale(&mut want, -1.5).unwrap();
        same("scale", &out, &want);
        let mut want = be.zeros(len, DType::F32).unwrap();
        be.activation_fwd(Activation::Gelu, &bx, &mut out).unwrap();
        be.activation_fwd(Activation::Gelu, &fx, &mut want).unwrap();
        same("gelu", &out, &want);
        be.activation_bwd(Activation::Silu, &bx, &by, &mut out)
            .unwrap();
        be.activation_bwd(Activation::Silu, &fx, &fy, &mut want)
            .unwrap();
        same("silu backward", &out, &want);
        // Mixed copies round or widen value by value.
        be.copy(&fx, &mut out).unwrap();
        assert_eq!(host(&be, &out), host(&be, &fx));
        be.copy(&bx, &mut want).unwrap();
        assert_eq!(host(&be, &want), host(&be, &fx));
        // Row-wise: the norm forward (output and rstd bf16) and its input gradient.
        let mut rstd = be.zeros(n, DType::Bf16).unwrap();
        let mut want_rstd = be.zeros(n, DType::F32).unwrap();
        be.rmsnorm_fwd(&bx, &bw, &mut out, &mut rstd, n, dim, 1e-5)
            .unwrap();
        be.rmsnorm_fwd(&fx, &fw, &mut want, &mut want_rstd, n, dim, 1e-5)
            .unwrap();
        same("rmsnorm output", &out, &want);
        same("rmsnorm rstd", &rstd, &want_rstd);
        let fr = widened(&be, &host(&be, &rstd));
        be.rmsnorm_bwd_input(&bx, &bw, &rstd, &by, &mut out, n, dim)
            .unwrap();
        be.rmsnorm_bwd_input(&fx, &fw, &fr, &fy, &mut want, n, dim)
            .unwrap();
        same("rmsnorm input gradient", &out, &want);
        // Row sums into f32 (the norm's weight gradient, a bias's): the same order, so the
        // same bits.
        let (mut dw, mut want_dw) = (buf(&be, &w), buf(&be, &w));
        be.rmsnorm_bwd_weight(&bx, &rstd, &by, &mut dw, n, dim)
            .unwrap();
        be.rmsnorm_bwd_weight(&fx, &fr, &fy, &mut want_dw, n, dim)
            .unwrap();
        assert_eq!(
            host(&be, &dw),
            host(&be, &want_dw),
            "rmsnorm weight gradient"
        );
        be.sum_rows(&bx, &mut dw, n, dim).unwrap();
        be.sum_rows(&fx, &mut want_dw, n, dim).unwrap();
        assert_eq!(host(&be, &dw), host(&be, &want_dw), "sum_rows");
        // RoPE: each block of rows at its own positions.
        let positions: Vec<u32> = (0..n as u32).map(|p| p % 61).collect();
        let head_dim = dim / heads;
        let inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|i| 10000f32.powf(-2.0 * i as f32 / head_dim as f32))
            .collect();
        be.rope(&bx, &mut out, &positions, heads, head_dim, &inv_freq, false)
            .unwrap();
        be.rope(
            &fx, &mut want, &positions, heads, head_dim, &inv_freq, false,
        )
        .unwrap();
        same("rope", &out, &want);
    }
}

#[test]
fn products_of_bf16_blocks_equal_the_whole_f32_product() {
    let (k, n) = (160, 48);
    let m = rows(k);
    let (a, b) = (rand_vec(4, m * k), rand_vec(5, k * n));
    for be in backends() {
        // `a·b` into bf16, `a` bf16: blocks of rows of `a` and of the output.
        let (ba, bb) = (bf(&be, &a), bf(&be, &b));
        let (fa, fb) = (widened(&be, &a), widened(&be, &b));
        let mut c = be.zeros(m * n, DType::Bf16).unwrap();
        let mut want = be.zeros(m * n, DType::F32).unwrap();
        be.matmul(&ba, &bb, &mut c, Gemm::nn(m, k, n)).unwrap();
        be.matmul(&fa, &fb, &mut want, Gemm::nn(m, k, n)).unwrap();
        let (got, want) = (host(&be, &c), host(&be, &want));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // One rounding to bf16 (8 bits of mantissa) from an f32 sum that may be taken in
            // another order by a product of fewer rows.
            assert!(
                (g - w).abs() <= w.abs() / 128.0 + 1e-6,
                "row {}: {g} against {w}",
                i / n
            );
        }
        // `aᵀ·b` over the rows into f32 (a weight gradient): blocks of the reduction.
        let dy = rand_vec(6, m * n);
        let (bdy, fdy) = (bf(&be, &dy), widened(&be, &dy));
        let mut dw = buf(&be, &rand_vec(7, k * n));
        let mut want = dw.clone();
        let g = Gemm::nn(k, m, n).trans_a().accumulate();
        be.matmul(&ba, &bdy, &mut dw, g).unwrap();
        be.matmul(&fa, &fdy, &mut want, g).unwrap();
        let (got, want) = (host(&be, &dw), host(&be, &want));
        let scale = (m as f32).sqrt();
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-5 * scale * (1.0 + w.abs()),
                "{g} against {w}"
            );
        }
    }
}
