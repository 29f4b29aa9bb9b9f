//! [`rowmul`]: `y = x·W` for a few rows `x`, streaming `W` once from a panel layout.
//!
//! Generation multiplies one to a few dozen rows (decode: one per sequence; verification:
//! K+1 per sequence) by weight matrices far larger than the cache. Such a product is bound
//! by reading `W`, yet the backend's general GEMM packs `W` into panels on every call,
//! which made a product of a few rows cost several times a 1-row one. Here `W` is packed
//! once, when the stage is built ([`Packed`]: panels of 16 columns, contiguous over `k`,
//! one 64-byte line per `k`), and each pass streams the panels while several rows keep
//! their sums in registers, so a weight vector is loaded once and used by every row.
//!
//! One kernel per instruction set ([`Isa`]), picked at run time: `avx512` (16 lanes, 32
//! registers: up to 14 rows per pass), `avx2` (8 lanes, 16 registers: up to 6 rows, each
//! panel as two halves) and a plain one. What keeps a few rows close to the cost of one:
//! several panels are in flight at once, so a lone row does not wait on one FMA chain's
//! latency per weight vector; each weight stream is prefetched ahead, because the hardware
//! prefetcher alone fell behind once the loop did several rows of FMAs per weight vector;
//! and beyond one pass the rows go over the panels block by block, so a block comes from
//! memory once and from the cache for the other passes.
//!
//! On a CPU that runs a 512-bit FMA as two 256-bit halves (Zen 4) AVX-512 does not double
//! the FMA rate; it wins by its 32 registers (more rows in one pass, fewer loads per FMA).
//! Beyond several rows the product is bound by the FMAs, not the weights. Figures
//! (`cargo bench --bench rowmul`): docs/benchmarks.md, "Row products (rowmul)".
//!
//! Every output element is one multiply-add chain over `k` in order, on every path: a
//! row's result does not depend on how many rows share the call nor on the instruction set,
//! so decoding one position and verifying several give bitwise the same values for the
//! same position.
//!
//! A matrix may be packed in half precision ([`Precision::F16`]): every kernel widens a
//! line to f32 as it loads it, so the product is bitwise the f32 product of the rounded
//! weights, and a weight-bound product streams half the bytes. The drafter's proposals use
//! it (their numerics only move the acceptance rate); the target stays in f32, the
//! numerics its training and its sampled log-probabilities share.

#[cfg(target_arch = "x86_64")]
mod avx2;
// Its intrinsics are stable since Rust 1.89: the workspace's rust-version.
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;

use std::ops::Range;

use super::denormals::Flushed;
use crate::model::ModelError;
use crate::tensor::{Backend, CpuBackend, DType};

/// Rows up to which [`InferStage`](super::InferStage) uses [`rowmul`] instead of the
/// backend's GEMM. On one thread the packed weights beat the GEMM, which packs them on
/// every call, up to about this many rows (at `d_model` 512: 40 rows 24 against 34 ms,
/// 160 rows even). Beyond 32 rows the GEMM on the backend's pool is faster for a step
/// alone (40 rows on two threads: 21 ms), but steps that wide come while several groups
/// are in flight, whose stage threads already keep the cores busy: there the cheaper
/// product per core wins (docs/benchmarks.md, "Row products (rowmul)").
pub const ROWMUL_MAX_ROWS: usize = 128;

/// Columns per panel (one AVX-512 register of f32, one cache line).
const PANEL: usize = 16;

/// One `k` of one panel: its 16 weights, aligned so that a panel row is one cache line.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
struct Line([f32; PANEL]);

/// [`Line`] in half precision: the bits of 16 IEEE `f16` weights, half a cache line.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(32))]
struct HalfLine([u16; PANEL]);

/// How [`Packed`] stores its weights. A product is f32 arithmetic either way (every weight
/// is widened exactly to f32 before its multiply-add), so half precision changes only the
/// weights' values (rounded once, when packed), not the kernels' order of operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    F32,
    /// IEEE binary16: half the bytes to stream, 11 significant bits (a weight's relative
    /// rounding error at most 2⁻¹¹), magnitudes up to 65504.
    F16,
}

#[derive(Clone, Debug)]
enum Lines {
    F32(Vec<Line>),
    F16(Vec<HalfLine>),
}

/// `W: [din, dout]` as `ceil(dout / 16)` panels of `[din, 16]` (the last one zero-padded).
#[derive(Clone, Debug)]
pub struct Packed {
    din: usize,
    dout: usize,
    /// Panel `p`, row `k` at `p · din + k`.
    lines: Lines,
}

impl Packed {
    /// Packs the row-major `w: [din, dout]` in f32.
    pub fn new(w: &[f32], din: usize, dout: usize) -> Self {
        assert_eq!(w.len(), din * dout, "Packed: w is [din, dout]");
        Packed {
            din,
            dout,
            lines: Lines::F32(panels(w, din, dout, false, Line)),
        }
    }

    /// Packs the row-major `w: [din, dout]` in `precision`. Half precision refuses a
    /// finite weight beyond its range (it would become infinite).
    pub fn with_precision(
        w: &[f32],
        din: usize,
        dout: usize,
        precision: Precision,
    ) -> Result<Self, ModelError> {
        Packed::build(w, din, dout, false, precision)
    }

    /// [`Packed::with_precision`] of `W: [din, dout]` given as its transpose, the row-major
    /// `wt: [dout, din]` (a tied LM head read from its embedding table): the same panels,
    /// without a transposed copy first.
    pub fn with_precision_transposed(
        wt: &[f32],
        din: usize,
        dout: usize,
        precision: Precision,
    ) -> Result<Self, ModelError> {
        Packed::build(wt, din, dout, true, precision)
    }

    fn build(
        w: &[f32],
        din: usize,
        dout: usize,
        transposed: bool,
        precision: Precision,
    ) -> Result<Self, ModelError> {
        if w.len() != din * dout {
            return Err(ModelError::RowmulWeights {
                got: w.len(),
                din,
                dout,
            });
        }
        let lines = match precision {
            Precision::F32 => Lines::F32(panels(w, din, dout, transposed, Line)),
            Precision::F16 => {
                let max = f32::from(half::f16::MAX);
                if let Some(&v) = w.iter().find(|v| v.is_finite() && v.abs() > max) {
                    return Err(ModelError::HalfRange(v));
                }
                Lines::F16(panels(w, din, dout, transposed, |v| {
                    HalfLine(v.map(|x| half::f16::from_f32(x).to_bits()))
                }))
            }
        };
        Ok(Packed { din, dout, lines })
    }

    pub fn precision(&self) -> Precision {
        match self.lines {
            Lines::F32(_) => Precision::F32,
            Lines::F16(_) => Precision::F16,
        }
    }

    /// Bytes of packed weights (padding included): what one product streams.
    pub fn bytes(&self) -> usize {
        match &self.lines {
            Lines::F32(l) => std::mem::size_of_val(l.as_slice()),
            Lines::F16(l) => std::mem::size_of_val(l.as_slice()),
        }
    }

    fn panels(&self) -> usize {
        self.dout.div_ceil(PANEL)
    }

    /// For the kernels: the first line's address and the number of lines.
    fn raw_lines(&self) -> (*const u8, usize) {
        match &self.lines {
            Lines::F32(l) => (l.as_ptr().cast(), l.len()),
            Lines::F16(l) => (l.as_ptr().cast(), l.len()),
        }
    }

    /// Weight `j` (0 to 15) of panel `p`, row `k`, widened to f32.
    fn weight(&self, p: usize, k: usize, j: usize) -> f32 {
        let at = p * self.din + k;
        match &self.lines {
            Lines::F32(l) => l[at].0[j],
            Lines::F16(l) => half::f16::from_bits(l[at].0[j]).to_f32(),
        }
    }
}

/// The panels of `w: [din, dout]` (given as `[dout, din]` when `transposed`), each row of
/// 16 columns (zero-padded) made a line by `line`.
fn panels<L>(
    w: &[f32],
    din: usize,
    dout: usize,
    transposed: bool,
    line: impl Fn([f32; PANEL]) -> L,
) -> Vec<L> {
    let n = dout.div_ceil(PANEL);
    let mut lines = Vec::with_capacity(n * din);
    for p in 0..n {
        let (c, width) = (p * PANEL, PANEL.min(dout - p * PANEL));
        for k in 0..din {
            let mut v = [0.0f32; PANEL];
            match transposed {
                // Column `c + j` of `W` is row `c + j` of `wt`.
                true => (0..width).for_each(|j| v[j] = w[(c + j) * din + k]),
                false => v[..width].copy_from_slice(&w[k * dout + c..][..width]),
            }
            lines.push(line(v));
        }
    }
    lines
}

/// The kernels [`rowmul`] can run on; [`Isa::best`] is the one it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F: 16 lanes, 32 registers.
    Avx512,
    /// AVX2, FMA and F16C (to widen half-precision weights): 8 lanes, 16 registers.
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
                std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma")
                    && std::is_x86_feature_detected!("f16c")
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

/// [`side_by_side`] of parts of any widths (`[rows, len / rows]` each): `[wq | wk | wv]`
/// where grouped-query attention makes `wk`, `wv` narrower than `wq`.
pub fn concat_cols(parts: &[&[f32]], rows: usize) -> Vec<f32> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(total);
    for r in 0..rows {
        for p in parts {
            let cols = p.len() / rows.max(1);
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
pub fn rowmul_on(isa: Isa, x: &[f32], w: &Packed, rows: usize) -> Result<Vec<f32>, ModelError> {
    if !isa.is_available() {
        return Err(ModelError::RowmulUnavailable(isa));
    }
    if x.len() != rows * w.din {
        return Err(ModelError::RowmulShape {
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
    let _flushed = Flushed::subnormals();
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
            for (k, xk) in xr.iter().enumerate() {
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = xk.mul_add(w.weight(p, k, j), *a);
                }
            }
            put(y, dout, r, p, &acc);
        }
    }
}
