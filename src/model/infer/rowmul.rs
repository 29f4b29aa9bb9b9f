//! [`rowmul`]: `y = x·W` for a few rows `x`, streaming `W` once from a panel layout.
//!
//! Generation multiplies one to a few dozen rows (decode: one per sequence; verification:
//! K+1 per sequence) by weight matrices far larger than the cache. Such a product is bound
//! by reading `W`, yet the backend's general GEMM packs `W` into panels on every call,
//! which at `d_model` 256 made a 5-row product cost 3–4× a 1-row one. Here `W` is packed
//! once, when the stage is built ([`Packed`]: panels of 8 columns, contiguous over `k`),
//! and each pass streams the panels while up to 8 rows keep their sums in registers, so a
//! weight vector is loaded once and used by every row.
//!
//! Two things keep a few rows close to the cost of one (measured on the 2-core EPYC box,
//! `d_model` 256, 8 layers, 25 MB of weights): several panels are in flight at once, so a
//! lone row does not wait on one FMA chain's latency per weight vector; and each weight
//! stream is prefetched `PREFETCH_AHEAD` floats ahead, because the hardware prefetcher
//! alone fell behind once the loop did five rows of FMAs per weight vector (5 rows cost
//! 2.5× one row streaming from L3, against 2.3× when the weights sit in L2). Every output
//! element is one
//! multiply-add chain over `k` in order: a row's result does not depend on how many rows
//! share the call, so decoding one position and verifying several give bitwise the same
//! values for the same position.

use std::ops::Range;

use crate::tensor::{Backend, CpuBackend, DType};

/// Rows up to which [`InferStage`](super::InferStage) uses [`rowmul`] instead of the
/// backend's GEMM (beyond it the product is compute bound and the GEMM's blocking wins).
pub const ROWMUL_MAX_ROWS: usize = 32;

/// Rows sharing one pass over `W` (their sums stay in registers: 8 of 16 AVX registers).
const ROWS_PER_PASS: usize = 8;
/// Columns per panel (one AVX register of f32).
const PANEL: usize = 8;
/// Panels per block (divisible by every `P` of [`pass_fma`]): the weights one block of
/// rows reuses from the cache, 12·8·`din` floats (96 KB at `din` 256, 384 KB at 1024: L2).
const PANEL_BLOCK: usize = 12;
/// How far ahead (floats: 8 KB) each weight stream is prefetched, tuned on that box:
/// 256 or 1024 left the 5-row pass memory-stalled, 4096 and 8192 were no better.
const PREFETCH_AHEAD: usize = 2048;

/// `W: [din, dout]` as `ceil(dout / 8)` panels of `[din, 8]` (the last one zero-padded).
#[derive(Clone, Debug)]
pub struct Packed {
    din: usize,
    dout: usize,
    panels: Vec<f32>,
}

impl Packed {
    /// Packs the row-major `w: [din, dout]`.
    pub fn new(w: &[f32], din: usize, dout: usize) -> Self {
        assert_eq!(w.len(), din * dout, "Packed: w is [din, dout]");
        let n = dout.div_ceil(PANEL);
        let mut panels = vec![0.0f32; n * din * PANEL];
        for p in 0..n {
            for k in 0..din {
                for j in 0..PANEL.min(dout - p * PANEL) {
                    panels[(p * din + k) * PANEL + j] = w[k * dout + p * PANEL + j];
                }
            }
        }
        Packed { din, dout, panels }
    }
}

/// Whether few-row products on `be` should stream packed host weights through [`rowmul`]:
/// where the backend's buffers are host memory in f32 anyway (a device backend keeps its
/// own GEMM).
pub fn streams_host_weights<B: Backend>(be: &B) -> bool {
    (be as &dyn std::any::Any).is::<CpuBackend>() && be.storage_dtype() == DType::F32
}

/// Row `r` of the result is row `r` of each of `parts` in turn (`[rows, cols]` each):
/// matrices fused side by side (`[wq | wk | wv]`), so one product computes all of them.
pub fn side_by_side(parts: &[&[f32]], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(parts.len() * rows * cols);
    for r in 0..rows {
        for p in parts {
            out.extend_from_slice(&p[r * cols..(r + 1) * cols]);
        }
    }
    out
}

/// `y[r] = Σ_k x[r,k]·W[k]` for `x: [rows, din]`.
pub fn rowmul(x: &[f32], w: &Packed, rows: usize) -> Vec<f32> {
    assert_eq!(x.len(), rows * w.din, "rowmul: x is [rows, din]");
    let mut y = vec![0.0f32; rows * w.dout];
    let n = w.dout.div_ceil(PANEL);
    // Panel blocks outside, row chunks inside: a block of weights comes from memory once
    // for the first chunk of 8 rows and from the cache for the others, so verifying K+1
    // positions of several sequences streams `W` once, not once per 8 rows.
    for block in (0..n).step_by(PANEL_BLOCK) {
        let panels = block..(block + PANEL_BLOCK).min(n);
        for (xs, ys) in x
            .chunks(ROWS_PER_PASS * w.din)
            .zip(y.chunks_mut(ROWS_PER_PASS * w.dout))
        {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                let p = panels.clone();
                // SAFETY: the CPU has the features these functions are compiled for.
                unsafe {
                    match xs.len() / w.din {
                        1 => pass_fma::<1, 4>(xs, w, p, ys),
                        2 => pass_fma::<2, 4>(xs, w, p, ys),
                        3 => pass_fma::<3, 3>(xs, w, p, ys),
                        4 => pass_fma::<4, 2>(xs, w, p, ys),
                        5 => pass_fma::<5, 2>(xs, w, p, ys),
                        6 => pass_fma::<6, 2>(xs, w, p, ys),
                        7 => pass_fma::<7, 1>(xs, w, p, ys),
                        _ => pass_fma::<8, 1>(xs, w, p, ys),
                    }
                }
                continue;
            }
            pass_plain(xs, w, panels.clone(), ys);
        }
    }
    y
}

/// One pass over `panels` for exactly `R` rows, `P` panels at a time: `R·P` independent
/// accumulator chains (at most 12, so that they, the `P` weight vectors and a broadcast fit
/// the 16 AVX registers). A single row alone would wait on one FMA's latency per weight
/// vector; several panels in flight keep the FMA units and the loads busy, so that the
/// loop runs at the speed weights stream in rather than at the speed of one chain.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn pass_fma<const R: usize, const P: usize>(
    x: &[f32],
    w: &Packed,
    panels: Range<usize>,
    y: &mut [f32],
) {
    let (din, dout) = (w.din, w.dout);
    assert!(x.len() == R * din && y.len() == R * dout);
    assert!(panels.end <= dout.div_ceil(PANEL));
    let mut p = panels.start;
    while p + P <= panels.end {
        // SAFETY: panels `p..p + P` exist, each `din · PANEL` floats; x holds R rows.
        let acc = unsafe { panels_fma::<R, P>(x, w, p) };
        store::<R, P>(&acc, p, dout, y);
        p += P;
    }
    while p < panels.end {
        // SAFETY: as above, for one panel.
        let acc = unsafe { panels_fma::<R, 1>(x, w, p) };
        store::<R, 1>(&acc, p, dout, y);
        p += 1;
    }
}

/// The sums of panels `p..p + P` for the `R` rows of `x`, `acc[r][q]` for row `r`, panel
/// `p + q`.
///
/// # Safety
/// Needs AVX2 and FMA, `p + P` at most the number of panels and `x` of `R · din` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn panels_fma<const R: usize, const P: usize>(
    x: &[f32],
    w: &Packed,
    p: usize,
) -> [[std::arch::x86_64::__m256; P]; R] {
    use std::arch::x86_64::{
        _MM_HINT_T0, _mm_prefetch, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_ps,
        _mm256_setzero_ps,
    };
    let din = w.din;
    let stride = din * PANEL;
    debug_assert!(x.len() == R * din && (p + P) * stride <= w.panels.len());
    let mut acc = [[_mm256_setzero_ps(); P]; R];
    // SAFETY: the caller guarantees panels `p..p + P` and `R` rows of `din` floats, so
    // every offset below is in bounds (no bounds checks in the hot loop).
    unsafe {
        let base = w.panels.as_ptr().add(p * stride);
        let xp = x.as_ptr();
        for k in 0..din {
            if k % 2 == 0 {
                for q in 0..P {
                    let ahead = base.wrapping_add(q * stride + k * PANEL + PREFETCH_AHEAD);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast::<i8>());
                }
            }
            let mut wv = [_mm256_setzero_ps(); P];
            for (q, v) in wv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(base.add(q * stride + k * PANEL));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let xr = _mm256_set1_ps(*xp.add(r * din + k));
                for (a, v) in row.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(xr, *v, *a);
                }
            }
        }
    }
    acc
}

/// Writes `acc` (panels `p..p + P`) into `y: [R, dout]`, dropping the last panel's padding.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn store<const R: usize, const P: usize>(
    acc: &[[std::arch::x86_64::__m256; P]; R],
    p: usize,
    dout: usize,
    y: &mut [f32],
) {
    use std::arch::x86_64::_mm256_storeu_ps;
    let mut out = [0.0f32; PANEL];
    for (r, row) in acc.iter().enumerate() {
        for (q, a) in row.iter().enumerate() {
            let c = (p + q) * PANEL;
            let width = PANEL.min(dout - c);
            // SAFETY: `out` holds 8 floats.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), *a) };
            y[r * dout + c..][..width].copy_from_slice(&out[..width]);
        }
    }
}

/// The same chains without AVX: `mul_add` keeps one rounding per step, as the FMA does.
fn pass_plain(x: &[f32], w: &Packed, panels: Range<usize>, y: &mut [f32]) {
    let (din, dout) = (w.din, w.dout);
    for (xr, yr) in x.chunks_exact(din).zip(y.chunks_exact_mut(dout)) {
        for p in panels.clone() {
            let panel = &w.panels[p * din * PANEL..(p + 1) * din * PANEL];
            let mut acc = [0.0f32; PANEL];
            for (k, wk) in panel.chunks_exact(PANEL).enumerate() {
                acc.iter_mut()
                    .zip(wk)
                    .for_each(|(a, &w)| *a = xr[k].mul_add(w, *a));
            }
            let (c, width) = (p * PANEL, PANEL.min(dout - p * PANEL));
            yr[c..c + width].copy_from_slice(&acc[..width]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_match_a_naive_product_and_do_not_depend_on_the_batch() {
        let (rows, din, dout) = (11, 13, 107);
        let val = |i: usize| ((i * 7919 % 101) as f32 - 50.0) / 37.0;
        let x: Vec<f32> = (0..rows * din).map(val).collect();
        let w: Vec<f32> = (0..din * dout).map(|i| val(i + 5)).collect();
        let packed = Packed::new(&w, din, dout);
        let y = rowmul(&x, &packed, rows);
        for r in 0..rows {
            for c in 0..dout {
                let want: f64 = (0..din)
                    .map(|k| f64::from(x[r * din + k]) * f64::from(w[k * dout + c]))
                    .sum();
                assert!((f64::from(y[r * dout + c]) - want).abs() < 1e-4);
            }
        }
        // Every pass shape (1 to 8 rows, several panels at a time plus the remainder)
        // gives each row bitwise what the 11-row call gave it.
        for n in 1..=rows {
            for r0 in [0, rows - n] {
                let part = rowmul(&x[r0 * din..(r0 + n) * din], &packed, n);
                assert_eq!(part, y[r0 * dout..(r0 + n) * dout], "rows {r0}..{}", r0 + n);
            }
        }
    }
}
