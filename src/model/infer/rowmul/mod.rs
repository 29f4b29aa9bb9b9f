//! [`rowmul`]: `y = x·W` for a few rows `x`, streaming `W` once from a panel layout.
//!
//! Generation multiplies one to a few dozen rows (decode: one per sequence; verification:
//! K+1 per sequence) by weight matrices far larger than the cache. Such a product is bound
//! by reading `W`, yet the backend's general GEMM packs `W` into panels on every call,
//! which at `d_model` 256 made a 5-row product cost 3–4× a 1-row one. Here `W` is packed
//! once, when the stage is built ([`Packed`]: panels of 16 columns, contiguous over `k`,
//! one 64-byte line per `k`), and each pass streams the panels while several rows keep
//! their sums in registers, so a weight vector is loaded once and used by every row.
//!
//! One kernel per instruction set ([`Isa`]), picked at run time: [`avx512`] (16 lanes, 32
//! registers: up to 14 rows per pass), [`avx2`] (8 lanes, 16 registers: up to 6 rows, each
//! panel as two halves) and a plain one. What keeps a few rows close to the cost of one:
//! several panels are in flight at once, so a lone row does not wait on one FMA chain's
//! latency per weight vector; each weight stream is prefetched ahead, because the hardware
//! prefetcher alone fell behind once the loop did several rows of FMAs per weight vector;
//! and beyond one pass the rows go over the panels block by block, so a block comes from
//! memory once and from the cache for the other passes.
//!
//! Measured (`cargo bench --bench rowmul`, the 2-core EPYC box at 2.6 GHz, shared, medians
//! of one run): the 33 matrices of the `d_model` 512 target (100 MB, from memory) cost 4.6
//! ms for one row on AVX-512, and 5, 8, 10 and 20 rows cost 1.04, 1.19, 1.45 and 2.45×
//! that; AVX2 took 5.2 ms and 1.07, 1.50, 1.62 and 2.63×. This CPU (Zen 4) runs a
//! 512-bit FMA as two 256-bit halves, so AVX-512 does not double the FMA rate; it wins by
//! its 32 registers (10 rows in one pass, fewer loads per FMA). From about 8 rows on the
//! product is bound by the FMAs, not the weights: 20 rows are 31 M 16-lane FMAs, at most
//! one per cycle, 12 ms at the nominal 2.6 GHz (11.4 measured: the clock boosts), against
//! under 5 ms to stream the weights once.
//!
//! Every output element is one multiply-add chain over `k` in order, on every path: a
//! row's result does not depend on how many rows share the call nor on the instruction set,
//! so decoding one position and verifying several give bitwise the same values for the
//! same position.

#[cfg(target_arch = "x86_64")]
mod avx2;
// Its intrinsics are stable since Rust 1.89: the workspace's rust-version.
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;

use std::ops::Range;

use crate::tensor::{Backend, CpuBackend, DType};

/// Rows up to which [`InferStage`](super::InferStage) uses [`rowmul`] instead of the
/// backend's GEMM (beyond it the product is compute bound and the GEMM's blocking wins).
pub const ROWMUL_MAX_ROWS: usize = 32;

/// Columns per panel (one AVX-512 register of f32, one cache line).
const PANEL: usize = 16;

/// One `k` of one panel: its 16 weights, aligned so that a panel row is one cache line.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
struct Line([f32; PANEL]);

/// `W: [din, dout]` as `ceil(dout / 16)` panels of `[din, 16]` (the last one zero-padded).
#[derive(Clone, Debug)]
pub struct Packed {
    din: usize,
    dout: usize,
    /// Panel `p`, row `k` at `p · din + k`.
    lines: Vec<Line>,
}

impl Packed {
    /// Packs the row-major `w: [din, dout]`.
    pub fn new(w: &[f32], din: usize, dout: usize) -> Self {
        assert_eq!(w.len(), din * dout, "Packed: w is [din, dout]");
        let n = dout.div_ceil(PANEL);
        let mut lines = vec![Line::default(); n * din];
        for p in 0..n {
            let (c, width) = (p * PANEL, PANEL.min(dout - p * PANEL));
            for k in 0..din {
                lines[p * din + k].0[..width].copy_from_slice(&w[k * dout + c..][..width]);
            }
        }
        Packed { din, dout, lines }
    }

    fn panels(&self) -> usize {
        self.dout.div_ceil(PANEL)
    }
}

/// The kernels [`rowmul`] can run on; [`Isa::best`] is the one it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F: 16 lanes, 32 registers.
    Avx512,
    /// AVX2 and FMA: 8 lanes, 16 registers.
    Avx2,
    /// Scalar `mul_add`, anywhere.
    Plain,
}

impl Isa {
    /// Whether this CPU can run the kernel.
    pub fn is_available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
            }
            Isa::Plain => true,
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The widest kernel this CPU runs.
    pub fn best() -> Isa {
        [Isa::Avx512, Isa::Avx2]
            .into_iter()
            .find(|i| i.is_available())
            .unwrap_or(Isa::Plain)
    }
}

/// Why [`rowmul_on`] could not run.
#[derive(Debug, thiserror::Error)]
pub enum RowmulError {
    #[error("rowmul: the {0:?} kernel needs CPU features this machine lacks")]
    Unavailable(Isa),
    #[error("rowmul: x has {got} floats, not rows {rows} × din {din}")]
    Shape { got: usize, rows: usize, din: usize },
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

/// `y[r] = Σ_k x[r,k]·W[k]` for `x: [rows, din]`, on [`Isa::best`].
pub fn rowmul(x: &[f32], w: &Packed, rows: usize) -> Vec<f32> {
    assert_eq!(x.len(), rows * w.din, "rowmul: x is [rows, din]");
    run(Isa::best(), x, w, rows)
}

/// [`rowmul`] on a chosen kernel (to compare them; the results are bitwise the same).
pub fn rowmul_on(isa: Isa, x: &[f32], w: &Packed, rows: usize) -> Result<Vec<f32>, RowmulError> {
    if !isa.is_available() {
        return Err(RowmulError::Unavailable(isa));
    }
    if x.len() != rows * w.din {
        return Err(RowmulError::Shape {
            got: x.len(),
            rows,
            din: w.din,
        });
    }
    Ok(run(isa, x, w, rows))
}

/// Rows per pass and panels per block of a kernel.
struct Tiling {
    /// Most rows one pass keeps in registers.
    max_rows: usize,
    /// Panels one block of passes shares (see [`run`]).
    block: usize,
}

/// The product on `isa`, which the caller has checked is available.
fn run(isa: Isa, x: &[f32], w: &Packed, rows: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; rows * w.dout];
    if rows == 0 || w.din == 0 || w.dout == 0 {
        return y;
    }
    let tiling = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512::TILING,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::TILING,
        _ => Tiling {
            max_rows: 8,
            block: usize::MAX,
        },
    };
    // As even passes as fit (20 rows: 10 + 10, not 14 + 6): fewer rows per pass cost more
    // loads per FMA.
    let passes = rows.div_ceil(tiling.max_rows);
    let per_pass = rows.div_ceil(passes);
    let n = w.panels();
    // One pass streams all panels; several go over them block by block, so that a block
    // comes from memory for the first pass and from the cache for the others (verifying
    // K+1 positions of several sequences streams `W` once, not once per pass).
    let block = if passes == 1 { n } else { tiling.block };
    for start in (0..n).step_by(block) {
        let panels = start..start.saturating_add(block).min(n);
        for (xs, ys) in x
            .chunks(per_pass * w.din)
            .zip(y.chunks_mut(per_pass * w.dout))
        {
            let r = xs.len() / w.din;
            match isa {
                // SAFETY: the caller checked that the CPU has the kernel's features.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { avx512::pass(r, xs, w, panels.clone(), ys) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2::pass(r, xs, w, panels.clone(), ys) },
                _ => pass_plain(xs, w, panels.clone(), ys),
            }
        }
    }
    y
}

/// Copies the first `dout - p·16` (at most 16) of `sums` into columns of panel `p` of
/// `y: [rows, dout]` row `r`.
fn put(y: &mut [f32], dout: usize, r: usize, p: usize, sums: &[f32; PANEL]) {
    let (c, width) = (p * PANEL, PANEL.min(dout - p * PANEL));
    y[r * dout + c..][..width].copy_from_slice(&sums[..width]);
}

/// The same chains without SIMD: `mul_add` keeps one rounding per step, as the FMA does.
fn pass_plain(x: &[f32], w: &Packed, panels: Range<usize>, y: &mut [f32]) {
    let (din, dout) = (w.din, w.dout);
    for (r, xr) in x.chunks_exact(din).enumerate() {
        for p in panels.clone() {
            let mut acc = [0.0f32; PANEL];
            for (xk, line) in xr.iter().zip(&w.lines[p * din..(p + 1) * din]) {
                acc.iter_mut()
                    .zip(&line.0)
                    .for_each(|(a, &w)| *a = xk.mul_add(w, *a));
            }
            put(y, dout, r, p, &acc);
        }
    }
}
