//! The CPU buffer type and the shared helpers of the backend: length checks that produce
//! the [`TensorError`]s, and the row-major matrix product on slices (the one `unsafe` call).

use std::borrow::Cow;

use gemm::Parallelism;
use half::bf16;

use crate::tensor::{AttnShape, Gemm, IGNORE_TARGET, Result, TensorError};

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
        match &self.0 {
            Storage::F32(v) => Cow::Borrowed(v),
            Storage::Bf16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        }
    }

    /// Runs `f` on the values as a mutable `f32` slice, rounding back for `bf16` storage.
    pub(super) fn write<R>(&mut self, f: impl FnOnce(&mut [f32]) -> R) -> R {
        match &mut self.0 {
            Storage::F32(v) => f(v),
            Storage::Bf16(v) => {
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

/// Checks that `buf` has `expected` elements.
pub(super) fn check(
    op: &'static str,
    operand: &'static str,
    buf: &CpuBuf,
    expected: usize,
) -> Result<()> {
    if buf.len() == expected {
        Ok(())
    } else {
        Err(TensorError::Shape {
            op,
            operand,
            expected,
            got: buf.len(),
        })
    }
}

/// Checks that `buf` has at least `expected` elements.
pub(super) fn check_at_least(
    op: &'static str,
    operand: &'static str,
    buf: &CpuBuf,
    expected: usize,
) -> Result<()> {
    if buf.len() >= expected {
        Ok(())
    } else {
        Err(TensorError::Shape {
            op,
            operand,
            expected,
            got: buf.len(),
        })
    }
}

/// Checks that every id is `< vocab` (targets may also be [`IGNORE_TARGET`]).
pub(super) fn check_ids(
    op: &'static str,
    ids: &[u32],
    vocab: usize,
    allow_ignore: bool,
) -> Result<()> {
    match ids
        .iter()
        .position(|&id| id as usize >= vocab && !(allow_ignore && id == IGNORE_TARGET))
    {
        None => Ok(()),
        Some(position) => Err(TensorError::IdOutOfRange {
            op,
            id: ids[position],
            position,
            vocab,
        }),
    }
}

/// `c (+)= op(a)·op(b)` on slices with gemm; lengths were checked by the caller.
pub(super) fn gemm_slices(a: &[f32], b: &[f32], c: &mut [f32], g: Gemm, par: Parallelism) {
    let Gemm {
        m,
        k,
        n,
        trans_a,
        trans_b,
        accumulate,
    } = g;
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return;
    }
    // Row-major strides (column stride, row stride) of op(A) [m,k] and op(B) [k,n].
    // Small products run faster on one thread than split over the pool.
    let par = if m * n * k < 1 << 21 {
        Parallelism::None
    } else {
        par
    };
    let (a_cs, a_rs) = if trans_a {
        (m as isize, 1)
    } else {
        (1, k as isize)
    };
    let (b_cs, b_rs) = if trans_b {
        (k as isize, 1)
    } else {
        (1, n as isize)
    };
    // SAFETY: the caller checked a.len() ≥ m·k, b.len() ≥ k·n, c.len() ≥ m·n, so every
    // index gemm forms from these strides is in bounds; `c` is exclusively borrowed.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

pub(super) fn check_attn(op: &'static str, s: AttnShape) -> Result<()> {
    if s.heads == 0 || s.head_dim == 0 {
        return Err(TensorError::Invalid {
            op,
            reason: format!(
                "heads ({}) and head_dim ({}) must be positive",
                s.heads, s.head_dim
            ),
        });
    }
    Ok(())
}
