//! The AVX-512 kernel of [`rowmul`](super::rowmul): one 16-column panel per register and
//! 32 registers, so a pass keeps up to 14 rows, or fewer rows over more panels in flight.
//! Half-precision lines are widened to f32 as they are loaded (`vcvtph2ps`, AVX-512F).

use std::arch::x86_64::{
    __m256i, __m512, _MM_HINT_T0, _mm_prefetch, _mm256_load_si256, _mm512_cvtph_ps,
    _mm512_fmadd_ps, _mm512_load_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps,
};
use std::ops::Range;

use super::{PANEL, Packed, Precision, Tiling, put};

/// Up to 14 rows (28 sums, 2 weight vectors); the block, 6 panels (divisible by every `P`
/// of a pass of 7 to 14 rows, the only ones that share blocks), is 6·16·`din` floats
/// (192 KB at `din` 512: L2).
pub(super) const TILING: Tiling = Tiling {
    max_rows: 14,
    block: 6,
};
/// How far ahead (bytes: 128 f32 lines) each weight stream is prefetched: as the AVX2
/// kernel's, shorter and longer distances being no better on the reference machine
/// (docs/benchmarks.md, "Row products (rowmul)").
const PREFETCH_AHEAD: usize = 8 << 10;

/// One pass over `panels` for the `rows` (1 to 14) rows of `x`, into `y: [rows, dout]`.
///
/// # Safety
/// Needs AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pass(rows: usize, x: &[f32], w: &Packed, panels: Range<usize>, y: &mut [f32]) {
    // `R·P` chains and `P` weight vectors within the 32 registers (the row's broadcast is
    // folded into the FMA's memory operand): few rows take many panels, so that the FMA
    // latency is hidden and each weight stream feeds many FMAs per load.
    match w.precision() {
        Precision::F32 => by_rows::<false>(rows, x, w, panels, y),
        Precision::F16 => by_rows::<true>(rows, x, w, panels, y),
    }
}

/// [`pass`] for f32 lines, or half-precision ones (`H`).
#[target_feature(enable = "avx512f")]
fn by_rows<const H: bool>(rows: usize, x: &[f32], w: &Packed, panels: Range<usize>, y: &mut [f32]) {
    match rows {
        1 => panels_fma::<1, 8, H>(x, w, panels, y),
        2 => panels_fma::<2, 8, H>(x, w, panels, y),
        3 => panels_fma::<3, 6, H>(x, w, panels, y),
        4 => panels_fma::<4, 6, H>(x, w, panels, y),
        5 => panels_fma::<5, 5, H>(x, w, panels, y),
        6 => panels_fma::<6, 4, H>(x, w, panels, y),
        7 => panels_fma::<7, 3, H>(x, w, panels, y),
        8 => panels_fma::<8, 3, H>(x, w, panels, y),
        9 => panels_fma::<9, 3, H>(x, w, panels, y),
        10 => panels_fma::<10, 2, H>(x, w, panels, y),
        11 => panels_fma::<11, 2, H>(x, w, panels, y),
        12 => panels_fma::<12, 2, H>(x, w, panels, y),
        13 => panels_fma::<13, 2, H>(x, w, panels, y),
        _ => panels_fma::<14, 2, H>(x, w, panels, y),
    }
}

/// `panels` for exactly `R` rows, `P` at a time (then one at a time).
#[target_feature(enable = "avx512f")]
fn panels_fma<const R: usize, const P: usize, const H: bool>(
    x: &[f32],
    w: &Packed,
    panels: Range<usize>,
    y: &mut [f32],
) {
    assert!(x.len() == R * w.din && y.len() == R * w.dout);
    assert!(panels.end <= w.panels());
    let mut p = panels.start;
    while p < panels.end {
        if p + P <= panels.end {
            // SAFETY: panels `p..p + P` exist; x holds R rows.
            let acc = unsafe { sums::<R, P, H>(x, w, p) };
            store::<R, P>(&acc, p, w.dout, y);
            p += P;
        } else {
            // SAFETY: as above, for one panel.
            let acc = unsafe { sums::<R, 1, H>(x, w, p) };
            store::<R, 1>(&acc, p, w.dout, y);
            p += 1;
        }
    }
}

/// The sums of panels `p..p + P` for the `R` rows of `x`, `acc[r][q]` for row `r`, panel
/// `p + q`.
///
/// # Safety
/// Needs AVX-512F, `p + P` at most the number of panels, `x` of `R · din` floats, and
/// `w`'s lines in half precision exactly when `H`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn sums<const R: usize, const P: usize, const H: bool>(
    x: &[f32],
    w: &Packed,
    p: usize,
) -> [[__m512; P]; R] {
    let din = w.din;
    // Bytes per line: 16 f32 or 16 f16.
    let line = if H { 2 * PANEL } else { 4 * PANEL };
    let (lines, count) = w.raw_lines();
    debug_assert!(x.len() == R * din && (p + P) * din <= count);
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    // SAFETY: the caller guarantees panels `p..p + P` and `R` rows of `din` floats, so
    // every offset below is in bounds (no bounds checks in the hot loop), and each line is
    // aligned to its size (64 or 32 bytes); prefetches may point past the end, which is
    // harmless.
    unsafe {
        let base = lines.add(p * din * line);
        let xp = x.as_ptr();
        for k in 0..din {
            let mut wv = [_mm512_setzero_ps(); P];
            for (q, v) in wv.iter_mut().enumerate() {
                let at = base.add((q * din + k) * line);
                // Once per 64-byte cache line: every other half-precision line.
                if !H || k % 2 == 0 {
                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_AHEAD).cast());
                }
                *v = if H {
                    _mm512_cvtph_ps(_mm256_load_si256(at.cast::<__m256i>()))
                } else {
                    _mm512_load_ps(at.cast())
                };
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let xr = _mm512_set1_ps(*xp.add(r * din + k));
                for (a, v) in row.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(xr, *v, *a);
                }
            }
        }
    }
    acc
}

/// Writes `acc` (panels `p..p + P`) into `y: [R, dout]`, dropping the last panel's padding.
#[target_feature(enable = "avx512f")]
fn store<const R: usize, const P: usize>(
    acc: &[[__m512; P]; R],
    p: usize,
    dout: usize,
    y: &mut [f32],
) {
    let mut out = [0.0f32; PANEL];
    for (r, row) in acc.iter().enumerate() {
        for (q, a) in row.iter().enumerate() {
            // SAFETY: `out` holds 16 floats.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), *a) };
            put(y, dout, r, p + q, &out);
        }
    }
}
