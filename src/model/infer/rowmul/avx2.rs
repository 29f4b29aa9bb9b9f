//! The AVX2 kernel of [`rowmul`](super::rowmul): 8 lanes and 16 registers, so each 16-column
//! panel is two halves of 8 columns, and a pass keeps up to 6 rows. Half-precision lines
//! are widened to f32 as they are loaded (`vcvtph2ps`, F16C).

use std::arch::x86_64::{
    __m128i, __m256, _MM_HINT_T0, _mm_loadu_si128, _mm_prefetch, _mm256_cvtph_ps, _mm256_fmadd_ps,
    _mm256_loadu_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_storeu_ps,
};
use std::ops::Range;

use super::{PANEL, Packed, Precision, Tiling};

/// Columns per register.
const HALF: usize = 8;
/// Up to 6 rows (12 sums, 2 weight vectors: with 8 rows only one half would fit, and a
/// stream of half lines made 8 rows dearer than 8-column panels did, docs/benchmarks.md);
/// the block is 12 halves, divisible by every `P` of [`pass`], 6·16·`din` floats (192 KB
/// at `din` 512: L2).
pub(super) const TILING: Tiling = Tiling {
    max_rows: 6,
    block: 6,
};
/// How far ahead (bytes: 128 f32 lines) each weight stream is prefetched: the shortest
/// distance that did as well as any longer one on the reference machine (docs/benchmarks.md,
/// "Row products (rowmul)").
const PREFETCH_AHEAD: usize = 8 << 10;

/// One pass over `panels` for the `rows` (1 to 6) rows of `x`, into `y: [rows, dout]`.
///
/// # Safety
/// Needs AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pass(rows: usize, x: &[f32], w: &Packed, panels: Range<usize>, y: &mut [f32]) {
    // The 8-column halves inside `panels` that hold columns (the last panel's second
    // half may be all padding).
    let halves = 2 * panels.start..(2 * panels.end).min(w.dout.div_ceil(HALF));
    // `R·P` chains (at most 12, so that they, the `P` weight vectors and a broadcast fit
    // the 16 registers): a single row alone would wait on one FMA's latency per weight
    // vector; several halves in flight keep the FMA units and the loads busy. `P` even,
    // so that a pass reads whole lines.
    match w.precision() {
        Precision::F32 => by_rows::<false>(rows, x, w, halves, y),
        Precision::F16 => by_rows::<true>(rows, x, w, halves, y),
    }
}

/// [`pass`] for f32 lines, or half-precision ones (`H`).
#[target_feature(enable = "avx2,fma,f16c")]
fn by_rows<const H: bool>(rows: usize, x: &[f32], w: &Packed, halves: Range<usize>, y: &mut [f32]) {
    match rows {
        1 => halves_fma::<1, 4, H>(x, w, halves, y),
        2 => halves_fma::<2, 4, H>(x, w, halves, y),
        3 => halves_fma::<3, 2, H>(x, w, halves, y),
        4 => halves_fma::<4, 2, H>(x, w, halves, y),
        5 => halves_fma::<5, 2, H>(x, w, halves, y),
        _ => halves_fma::<6, 2, H>(x, w, halves, y),
    }
}

/// Halves `halves` for exactly `R` rows, `P` at a time (then one at a time).
#[target_feature(enable = "avx2,fma,f16c")]
fn halves_fma<const R: usize, const P: usize, const H: bool>(
    x: &[f32],
    w: &Packed,
    halves: Range<usize>,
    y: &mut [f32],
) {
    assert!(x.len() == R * w.din && y.len() == R * w.dout);
    assert!(halves.end <= 2 * w.panels());
    let mut h = halves.start;
    while h < halves.end {
        if h + P <= halves.end {
            // SAFETY: halves `h..h + P` exist; x holds R rows.
            let acc = unsafe { sums::<R, P, H>(x, w, h) };
            store::<R, P>(&acc, h, w.dout, y);
            h += P;
        } else {
            // SAFETY: as above, for one half.
            let acc = unsafe { sums::<R, 1, H>(x, w, h) };
            store::<R, 1>(&acc, h, w.dout, y);
            h += 1;
        }
    }
}

/// The sums of halves `h..h + P` for the `R` rows of `x`, `acc[r][q]` for row `r`, half
/// `h + q`.
///
/// # Safety
/// Needs AVX2, FMA and F16C, `h + P` at most twice the number of panels, `x` of `R · din`
/// floats, and `w`'s lines in half precision exactly when `H`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn sums<const R: usize, const P: usize, const H: bool>(
    x: &[f32],
    w: &Packed,
    h: usize,
) -> [[__m256; P]; R] {
    let din = w.din;
    // Bytes per weight.
    let size = if H { 2 } else { 4 };
    let (lines, count) = w.raw_lines();
    debug_assert!(x.len() == R * din && (h + P).div_ceil(2) * din <= count);
    let mut acc = [[_mm256_setzero_ps(); P]; R];
    // SAFETY: the caller guarantees halves `h..h + P` and `R` rows of `din` floats, so
    // every offset below is in bounds (no bounds checks in the hot loop); prefetches may
    // point past the end, which is harmless.
    unsafe {
        let mut streams = [lines; P];
        for (q, s) in streams.iter_mut().enumerate() {
            let j = h + q;
            *s = lines.add(((j / 2) * din * PANEL + (j % 2) * HALF) * size);
        }
        let xp = x.as_ptr();
        for k in 0..din {
            let mut wv = [_mm256_setzero_ps(); P];
            for (v, s) in wv.iter_mut().zip(&streams) {
                let at = s.add(k * PANEL * size);
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_AHEAD).cast());
                *v = if H {
                    _mm256_cvtph_ps(_mm_loadu_si128(at.cast::<__m128i>()))
                } else {
                    _mm256_loadu_ps(at.cast())
                };
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

/// Writes `acc` (halves `h..h + P`) into `y: [R, dout]`, dropping the padding.
#[target_feature(enable = "avx2,fma,f16c")]
fn store<const R: usize, const P: usize>(
    acc: &[[__m256; P]; R],
    h: usize,
    dout: usize,
    y: &mut [f32],
) {
    let mut out = [0.0f32; HALF];
    for (r, row) in acc.iter().enumerate() {
        for (q, a) in row.iter().enumerate() {
            let (c, width) = ((h + q) * HALF, HALF.min(dout - (h + q) * HALF));
            // SAFETY: `out` holds 8 floats.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), *a) };
            y[r * dout + c..][..width].copy_from_slice(&out[..width]);
        }
    }
}
