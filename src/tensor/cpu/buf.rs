//! The CPU buffer type and the row-major matrix product on slices (the one `unsafe` call).
//! The operand checks every operation starts with live in `crate::tensor::check`.

use std::borrow::Cow;

use gemm::Parallelism;
use half::bf16;

use super::blas::{self, Blas, Operand};
use crate::tensor::{DType, Gemm};

/// A CPU buffer: a vector of `f32`, or of `bf16` widened on read.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuBuf(pub(super) Storage);

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Storage {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl CpuBuf {
    pub(super) fn len(&self) -> usize {
        match &self.0 {
            Storage::F32(v) => v.len(),
            Storage::Bf16(v) => v.len(),
        }
    }

    /// The values as `f32`: borrowed for `f32` storage, widened for `bf16`.
    pub(super) fn read(&self) -> Cow<'_, [f32]> {
        self.read_range(0..self.len())
    }

    /// The values `range` as `f32`: borrowed for `f32` storage, only those widened for
    /// `bf16` (a gather of a few rows need not widen a whole table).
    pub(super) fn read_range(&self, range: std::ops::Range<usize>) -> Cow<'_, [f32]> {
        match &self.0 {
            Storage::F32(v) => Block::F32(&v[range]),
            Storage::Bf16(v) => Block::Bf16(&v[range]),
        }
        .read()
    }

    /// Runs `f` on the values as a mutable `f32` slice, rounding back for `bf16` storage.
    pub(super) fn write<R>(&mut self, f: impl FnOnce(&mut [f32]) -> R) -> R {
        match &mut self.0 {
            Storage::F32(v) => BlockMut::F32(v),
            Storage::Bf16(v) => BlockMut::Bf16(v),
        }
        .write(f)
    }
}

/// One block of a buffer's values (see [`CpuBuf::blocks`]).
pub(super) enum Block<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl<'a> Block<'a> {
    /// The block as `f32`: borrowed, or widened (only this block).
    pub(super) fn read(self) -> Cow<'a, [f32]> {
        match self {
            Block::F32(v) => Cow::Borrowed(v),
            Block::Bf16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        }
    }
}

/// One block of a buffer's values, to write (see [`CpuBuf::blocks_mut`]).
pub(super) enum BlockMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
}

impl BlockMut<'_> {
    /// As [`CpuBuf::write`], on this block only.
    pub(super) fn write<R>(self, f: impl FnOnce(&mut [f32]) -> R) -> R {
        match self {
            BlockMut::F32(v) => f(v),
            BlockMut::Bf16(v) => {
                let mut wide: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
                let r = f(&mut wide);
                v.iter_mut()
                    .zip(&wide)
                    .for_each(|(d, &s)| *d = bf16::from_f32(s));
                r
            }
        }
    }
}

impl CpuBuf {
    /// The values in consecutive blocks of `len` (the last may be shorter), each widened
    /// only while a task reads it: a kernel that works block by block (attention, one
    /// sequence and head at a time) holds one block's `f32` copy per task, not the whole
    /// buffer's.
    pub(super) fn blocks(&self, len: usize) -> Vec<Block<'_>> {
        match &self.0 {
            Storage::F32(v) => v.chunks(len.max(1)).map(Block::F32).collect(),
            Storage::Bf16(v) => v.chunks(len.max(1)).map(Block::Bf16).collect(),
        }
    }

    /// As [`CpuBuf::blocks`], to write.
    pub(super) fn blocks_mut(&mut self, len: usize) -> Vec<BlockMut<'_>> {
        match &mut self.0 {
            Storage::F32(v) => v.chunks_mut(len.max(1)).map(BlockMut::F32).collect(),
            Storage::Bf16(v) => v.chunks_mut(len.max(1)).map(BlockMut::Bf16).collect(),
        }
    }
}

/// Values of a `bf16` operand widened at a time where a kernel can work block by block
/// (256 KiB as `f32`; a product's blocks may be larger, [`product_block_rows`]): the
/// transient a bf16 buffer costs while read or written is a block, not the whole buffer's
/// `f32` copy.
pub(super) const WIDEN_BLOCK: usize = 1 << 16;

/// The fewest rows a blocked product takes at a time: each block packs `b` again (and a
/// weight gradient's blocks read and write `c` again), which costs little against 256 rows
/// of multiply-adds.
const MIN_BLOCK_ROWS: usize = 256;

/// Rows a product with a bf16 operand takes at a time, its widest operand rows of `width`
/// values: [`WIDEN_BLOCK`] values, or [`MIN_BLOCK_ROWS`] where rows are wider than a
/// 256th of that (the memory estimate counts these blocks too).
pub(crate) fn product_block_rows(width: usize) -> usize {
    (WIDEN_BLOCK / width.max(1)).max(MIN_BLOCK_ROWS)
}

impl CpuBuf {
    /// The storage type ([`crate::tensor::Backend::dtype`]).
    pub(super) fn dtype(&self) -> DType {
        match self.0 {
            Storage::F32(_) => DType::F32,
            Storage::Bf16(_) => DType::Bf16,
        }
    }

    pub(super) fn is_bf16(&self) -> bool {
        self.dtype() == DType::Bf16
    }
}

/// The block length, in values, for `bufs` of rows of `unit` values: the whole of `len` where
/// every buffer is `f32` (borrowed, one call, the f32 path unchanged), else as many whole
/// rows as fit [`WIDEN_BLOCK`] (at least one).
pub(super) fn block_len(bufs: &[&CpuBuf], len: usize, unit: usize) -> usize {
    let unit = unit.max(1);
    if bufs.iter().any(|b| b.is_bf16()) {
        unit * (WIDEN_BLOCK / unit).max(1)
    } else {
        len.max(unit)
    }
}

/// Runs `f` on consecutive blocks of `out` and of each of `ins` (all `out`'s length), each
/// block whole rows of `unit` values, widened only while `f` runs on it ([`block_len`]):
/// for operations whose every row depends only on the same rows of its inputs. `f` gets
/// the block's first row.
pub(super) fn zip_rows<const N: usize>(
    out: &mut CpuBuf,
    ins: [&CpuBuf; N],
    unit: usize,
    mut f: impl FnMut(usize, &mut [f32], [&[f32]; N]),
) {
    let len = out.len();
    debug_assert!(ins.iter().all(|b| b.len() == len), "checked by the caller");
    // A bf16 output is blocked whatever the inputs; otherwise the inputs decide.
    let block = if out.is_bf16() {
        block_len(&[&*out], len, unit)
    } else {
        block_len(&ins, len, unit)
    };
    let mut ins = ins.map(|b| b.blocks(block).into_iter());
    for (i, o) in out.blocks_mut(block).into_iter().enumerate() {
        let wide: [Cow<'_, [f32]>; N] =
            std::array::from_fn(|j| ins[j].next().map_or(Cow::Borrowed(&[][..]), Block::read));
        let slices: [&[f32]; N] = std::array::from_fn(|j| &*wide[j]);
        o.write(|o| f(i * block / unit.max(1), o, slices));
    }
}

/// A strided matrix inside a slice: element `(r, c)` lives at `r·rs + c·cs`.
#[derive(Clone, Copy, Debug)]
pub(super) struct View {
    pub rs: usize,
    pub cs: usize,
}

impl View {
    /// A contiguous row-major matrix with `cols` columns.
    pub fn rows(cols: usize) -> Self {
        View { rs: cols, cs: 1 }
    }
    /// The transpose of a contiguous row-major matrix with `cols` columns.
    pub fn transposed(cols: usize) -> Self {
        View { rs: 1, cs: cols }
    }
    /// Largest index of an `r × c` matrix (both positive).
    fn last(&self, r: usize, c: usize) -> usize {
        (r - 1) * self.rs + (c - 1) * self.cs
    }
}

/// `dst (+)= alpha · lhs · rhs` for `lhs: [m, k]`, `rhs: [k, n]`, `dst: [m, n]` given as
/// strided views. Panics if a view reaches past its slice: callers derive views from shapes
/// they have checked, so that would be a bug here, and it keeps the `unsafe` call sound.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_strided(
    (m, k, n): (usize, usize, usize),
    dst: &mut [f32],
    dv: View,
    lhs: &[f32],
    lv: View,
    rhs: &[f32],
    rv: View,
    alpha: f32,
    accumulate: bool,
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(dv.last(m, n) < dst.len(), "gemm: dst view out of bounds");
    if k == 0 {
        if !accumulate {
            (0..m).for_each(|r| (0..n).for_each(|c| dst[r * dv.rs + c * dv.cs] = 0.0));
        }
        return;
    }
    assert!(lv.last(m, k) < lhs.len(), "gemm: lhs view out of bounds");
    assert!(rv.last(k, n) < rhs.len(), "gemm: rhs view out of bounds");
    // Small products run faster on one thread than split over the pool.
    let par = if m * n * k < super::PARALLEL_WORK {
        Parallelism::None
    } else {
        par
    };
    if let Some(blas) = blas::for_product(m * n * k)
        && blas_gemm(
            blas,
            (m, k, n),
            (dst, dv),
            (lhs, lv),
            (rhs, rv),
            alpha,
            accumulate,
            par,
        )
    {
        return;
    }
    let is = |x: usize| x as isize;
    if rv.rs < rv.cs {
        // The right operand runs down its columns (`trans_b`, as in dY·Wᵀ): gemm packs it
        // element by element at stride k, at half its speed when k is large (1536 or a
        // vocabulary); faer packs it at full speed (docs/benchmarks.md, "Where the gap to
        // torch was").
        // Both split only rows and columns over threads, so the result does not depend on
        // the thread count.
        let par = match par {
            Parallelism::Rayon(n) if n > 1 => faer::Par::rayon(n),
            _ => faer::Par::Seq,
        };
        // SAFETY: as below; faer reads and writes exactly the elements the views name.
        unsafe {
            let lhs = faer::MatRef::from_raw_parts(lhs.as_ptr(), m, k, is(lv.rs), is(lv.cs));
            let rhs = faer::MatRef::from_raw_parts(rhs.as_ptr(), k, n, is(rv.rs), is(rv.cs));
            let dst =
                faer::MatMut::from_raw_parts_mut(dst.as_mut_ptr(), m, n, is(dv.rs), is(dv.cs));
            let accum = if accumulate {
                faer::Accum::Add
            } else {
                faer::Accum::Replace
            };
            faer::linalg::matmul::matmul(dst, accum, lhs, rhs, alpha, par);
        }
        // On this thread; the pool's threads clear theirs as each task starts (kernels.rs).
        super::upper::clear();
        return;
    }
    // SAFETY: the asserts above bound every index gemm forms from these strides by the
    // slices' lengths; `dst` is exclusively borrowed and does not alias `lhs` or `rhs`.
    // gemm computes dst := 1·dst + alpha·lhs·rhs, reading dst only when `accumulate`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            is(dv.cs),
            is(dv.rs),
            accumulate,
            lhs.as_ptr(),
            is(lv.cs),
            is(lv.rs),
            rhs.as_ptr(),
            is(rv.cs),
            is(rv.rs),
            1.0,
            alpha,
            false,
            false,
            false,
            par,
        );
    }
}

/// [`gemm_strided`] through MKL, on `par`'s threads; `false` (nothing done) where CBLAS
/// cannot take the views or the sizes.
#[allow(clippy::too_many_arguments)]
fn blas_gemm(
    blas: &Blas,
    (m, k, n): (usize, usize, usize),
    (dst, dv): (&mut [f32], View),
    (lhs, lv): (&[f32], View),
    (rhs, rv): (&[f32], View),
    alpha: f32,
    accumulate: bool,
    par: Parallelism,
) -> bool {
    let (Some(oa), Some(ob)) = (
        Operand::of(m, k, lv.rs, lv.cs),
        Operand::of(k, n, rv.rs, rv.cs),
    ) else {
        return false;
    };
    if dv.cs != 1 || dv.rs < n || !blas::fits(&[m, n, k, oa.ld, ob.ld, dv.rs]) {
        return false;
    }
    let threads = match par {
        Parallelism::Rayon(t) => t,
        _ => 1,
    };
    let beta = if accumulate { 1.0 } else { 0.0 };
    // SAFETY: the caller checked that the views of `m × k`, `k × n` and `m × n` lie in
    // their slices, `dst` is exclusively borrowed, and the sizes fit CBLAS's int.
    unsafe {
        blas.sgemm(
            (m, k, n),
            threads,
            alpha,
            lhs.as_ptr(),
            oa,
            rhs.as_ptr(),
            ob,
            beta,
            dst.as_mut_ptr(),
            dv.rs,
        );
    }
    super::upper::clear();
    true
}

/// `c (+)= op(a)·op(b)` on row-major slices (see [`Gemm`]).
pub(super) fn gemm_slices(a: &[f32], b: &[f32], c: &mut [f32], g: Gemm, par: Parallelism) {
    let Gemm {
        m,
        k,
        n,
        trans_a,
        trans_b,
        accumulate,
    } = g;
    let av = if trans_a {
        View::transposed(m)
    } else {
        View::rows(k)
    };
    let bv = if trans_b {
        View::transposed(k)
    } else {
        View::rows(n)
    };
    gemm_strided(
        (m, k, n),
        c,
        View::rows(n),
        a,
        av,
        b,
        bv,
        1.0,
        accumulate,
        par,
    );
}
