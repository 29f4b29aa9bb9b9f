//! The operand contract of every [`Backend`] operation, stated once and enforced by every
//! backend: each function here checks the operands of the operation of the same name against
//! the shape it is given (through [`Backend::len`]) and returns the [`TensorError`] that names
//! the operation and the operand, before the backend reads or writes anything.
//!
//! Why one place: the CPU backend is the reference and the CUDA backend must reject exactly
//! the same inputs with exactly the same messages (`tests/cuda_backend.rs` compares them), so
//! the rules (the strided lengths of `matmul_batched`, its `stride_c = 0` rule, the ids of an
//! embedding, …) live here rather than in a copy per backend. Backends only add what is their
//! own (grid sizes, 32-bit cuBLAS sizes). The checks run in operand order and the first
//! failure is reported; `check/tests.rs` pins every message.
//!
//! Each check takes the operation's buffers as one array in the order of the trait method's
//! parameters, then the ids and shape; its body is the table of expected lengths.

use super::{AttnShape, Backend, BatchedGemm, Gemm, IGNORE_TARGET, Result};
use crate::tensor::TensorError;

/// One operand and the number of elements it must hold.
type Operand<'a, B> = (&'static str, &'a <B as Backend>::Buf, usize);

/// Every operand holds exactly its expected length; the first that does not is the error.
fn exact<B: Backend, const N: usize>(
    be: &B,
    op: &'static str,
    operands: [Operand<'_, B>; N],
) -> Result<()> {
    operands
        .into_iter()
        .try_for_each(|(name, buf, expected)| length(be, op, name, buf, expected, false))
}

/// Every operand holds at least its expected length (strided or prefix views).
fn at_least<B: Backend, const N: usize>(
    be: &B,
    op: &'static str,
    operands: [Operand<'_, B>; N],
) -> Result<()> {
    operands
        .into_iter()
        .try_for_each(|(name, buf, expected)| length(be, op, name, buf, expected, true))
}

fn length<B: Backend>(
    be: &B,
    op: &'static str,
    operand: &'static str,
    buf: &B::Buf,
    expected: usize,
    longer_ok: bool,
) -> Result<()> {
    let got = be.len(buf);
    if got == expected || (longer_ok && got > expected) {
        Ok(())
    } else {
        Err(TensorError::Shape {
            op,
            operand,
            expected,
            got,
        })
    }
}

/// Every id is `< vocab` (targets may also be [`IGNORE_TARGET`]).
fn ids(op: &'static str, ids: &[u32], vocab: usize, allow_ignore: bool) -> Result<()> {
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

/// [`Backend::copy`]: `dst` as long as `src`.
pub(super) fn copy<B: Backend>(be: &B, [src, dst]: [&B::Buf; 2]) -> Result<()> {
    exact(be, "copy", [("dst", dst, be.len(src))])
}

/// [`Backend::copy_range`]: both ranges inside their buffers, one storage type.
pub(super) fn copy_range<B: Backend>(
    be: &B,
    [src, dst]: [&B::Buf; 2],
    src_at: usize,
    dst_at: usize,
    len: usize,
) -> Result<()> {
    const OP: &str = "copy_range";
    at_least(
        be,
        OP,
        [("src", src, src_at + len), ("dst", dst, dst_at + len)],
    )?;
    let (from, to) = (be.dtype(src), be.dtype(dst));
    if from != to {
        return Err(TensorError::Invalid {
            op: OP,
            reason: format!("src is {from:?} and dst {to:?}; a range copy keeps the storage type"),
        });
    }
    Ok(())
}

/// [`Backend::matmul`]: `a: [m, k]`, `b: [k, n]`, `c: [m, n]` (transposes store the same count).
pub(super) fn matmul<B: Backend>(be: &B, [a, b, c]: [&B::Buf; 3], g: Gemm) -> Result<()> {
    let Gemm { m, k, n, .. } = g;
    exact(
        be,
        "matmul",
        [("a", a, m * k), ("b", b, k * n), ("c", c, m * n)],
    )
}

/// [`Backend::matmul_batched`]: each operand reaches its last product, i.e. holds at least
/// `(batch − 1)·stride + size` elements (more is allowed: strided views into a bigger
/// buffer); `stride_c = 0` over several products needs `accumulate`. With `batch = 0`
/// nothing is touched, so nothing is checked.
pub(super) fn matmul_batched<B: Backend>(
    be: &B,
    [a, b, c]: [&B::Buf; 3],
    g: BatchedGemm,
) -> Result<()> {
    const OP: &str = "matmul_batched";
    let Some(last) = g.batch.checked_sub(1) else {
        return Ok(());
    };
    let Gemm { m, k, n, .. } = g.gemm;
    at_least(
        be,
        OP,
        [
            ("a", a, last * g.stride_a + m * k),
            ("b", b, last * g.stride_b + k * n),
            ("c", c, last * g.stride_c + m * n),
        ],
    )?;
    if g.stride_c == 0 && g.batch > 1 && !g.gemm.accumulate {
        return Err(TensorError::Invalid {
            op: OP,
            reason: "stride_c = 0 overwrites one output with every product; set accumulate".into(),
        });
    }
    Ok(())
}

/// [`Backend::add`]: `b` and `out` as long as `a`.
pub(super) fn add<B: Backend>(be: &B, [a, b, out]: [&B::Buf; 3]) -> Result<()> {
    let n = be.len(a);
    exact(be, "add", [("b", b, n), ("out", out, n)])
}

/// [`Backend::axpy`]: `dst` as long as `src`.
pub(super) fn axpy<B: Backend>(be: &B, [src, dst]: [&B::Buf; 2]) -> Result<()> {
    exact(be, "axpy", [("dst", dst, be.len(src))])
}

/// [`Backend::mul`]: `b` and `out` as long as `a`.
pub(super) fn mul<B: Backend>(be: &B, [a, b, out]: [&B::Buf; 3]) -> Result<()> {
    let n = be.len(a);
    exact(be, "mul", [("b", b, n), ("out", out, n)])
}

/// [`Backend::rope`]: `x, out: [positions, heads·head_dim]`, `head_dim` even, `head_dim/2`
/// frequencies.
pub(super) fn rope<B: Backend>(
    be: &B,
    [x, out]: [&B::Buf; 2],
    positions: usize,
    heads: usize,
    head_dim: usize,
    frequencies: usize,
) -> Result<()> {
    if !head_dim.is_multiple_of(2) || frequencies != head_dim / 2 {
        return Err(TensorError::Invalid {
            op: "rope",
            reason: format!(
                "head_dim {head_dim} must be even, with half as many frequencies (got {frequencies})"
            ),
        });
    }
    let n = positions * heads * head_dim;
    exact(be, "rope", [("x", x, n), ("out", out, n)])
}

/// [`Backend::repeat_kv`] (`op = "repeat_kv"`, `src` the `kv_heads`-wide side) and
/// [`Backend::repeat_kv_bwd`] (`"repeat_kv_bwd"`, `src` the repeated side).
pub(super) fn repeat_kv<B: Backend>(
    be: &B,
    op: &'static str,
    [src, dst]: [&B::Buf; 2],
    rows: usize,
    kv_heads: usize,
    rep: usize,
    head_dim: usize,
) -> Result<()> {
    let (narrow, wide) = (rows * kv_heads * head_dim, rows * kv_heads * rep * head_dim);
    let (s, d) = if op == "repeat_kv" {
        (narrow, wide)
    } else {
        (wide, narrow)
    };
    exact(be, op, [("src", src, s), ("dst", dst, d)])
}

/// [`Backend::activation_fwd`]: `out` as long as `x`.
pub(super) fn activation_fwd<B: Backend>(be: &B, [x, out]: [&B::Buf; 2]) -> Result<()> {
    exact(be, "activation_fwd", [("out", out, be.len(x))])
}

/// [`Backend::activation_bwd`]: `dy` and `dx` as long as `x`.
pub(super) fn activation_bwd<B: Backend>(be: &B, [x, dy, dx]: [&B::Buf; 3]) -> Result<()> {
    let n = be.len(x);
    exact(be, "activation_bwd", [("dy", dy, n), ("dx", dx, n)])
}

/// [`Backend::softmax_rows`]: `x` and `out` are `[rows, cols]`.
pub(super) fn softmax_rows<B: Backend>(
    be: &B,
    [x, out]: [&B::Buf; 2],
    rows: usize,
    cols: usize,
) -> Result<()> {
    let n = rows * cols;
    exact(be, "softmax_rows", [("x", x, n), ("out", out, n)])
}

/// [`Backend::rmsnorm_fwd`]: `x, out: [rows, dim]`, `weight: [dim]`, `rstd: [rows]`.
pub(super) fn rmsnorm_fwd<B: Backend>(
    be: &B,
    [x, weight, out, rstd]: [&B::Buf; 4],
    rows: usize,
    dim: usize,
) -> Result<()> {
    let n = rows * dim;
    let operands = [
        ("x", x, n),
        ("weight", weight, dim),
        ("out", out, n),
        ("rstd", rstd, rows),
    ];
    exact(be, "rmsnorm_fwd", operands)
}

/// [`Backend::rmsnorm_bwd_input`]: `x, dy, dx: [rows, dim]`, `weight: [dim]`, `rstd: [rows]`.
pub(super) fn rmsnorm_bwd_input<B: Backend>(
    be: &B,
    [x, weight, rstd, dy, dx]: [&B::Buf; 5],
    rows: usize,
    dim: usize,
) -> Result<()> {
    let n = rows * dim;
    let operands = [("x", x, n), ("weight", weight, dim), ("rstd", rstd, rows)];
    exact(be, "rmsnorm_bwd_input", operands)?;
    exact(be, "rmsnorm_bwd_input", [("dy", dy, n), ("dx", dx, n)])
}

/// [`Backend::rmsnorm_bwd_weight`]: `x, dy: [rows, dim]`, `rstd: [rows]`, `dweight: [dim]`.
pub(super) fn rmsnorm_bwd_weight<B: Backend>(
    be: &B,
    [x, rstd, dy, dweight]: [&B::Buf; 4],
    rows: usize,
    dim: usize,
) -> Result<()> {
    let n = rows * dim;
    let operands = [
        ("x", x, n),
        ("rstd", rstd, rows),
        ("dy", dy, n),
        ("dweight", dweight, dim),
    ];
    exact(be, "rmsnorm_bwd_weight", operands)
}

/// An attention shape needs heads of positive width (`batch` or `seq` may be 0: no work).
fn attn_shape(op: &'static str, s: AttnShape) -> Result<()> {
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

/// [`Backend::attention_fwd`]: a valid shape, `q, k, v, out` of [`AttnShape::qkv_len`] and
/// `probs` of [`AttnShape::probs_len`] elements.
pub(super) fn attention_fwd<B: Backend>(
    be: &B,
    [q, k, v, out, probs]: [&B::Buf; 5],
    shape: AttnShape,
) -> Result<()> {
    const OP: &str = "attention_fwd";
    attn_shape(OP, shape)?;
    let n = shape.qkv_len();
    exact(
        be,
        OP,
        [("q", q, n), ("k", k, n), ("v", v, n), ("out", out, n)],
    )?;
    exact(be, OP, [("probs", probs, shape.probs_len())])
}

/// [`Backend::attention_bwd`]: as the forward, with `d_out` and the gradients `dq, dk, dv`
/// of [`AttnShape::qkv_len`] elements.
pub(super) fn attention_bwd<B: Backend>(
    be: &B,
    [q, k, v, probs, d_out, dq, dk, dv]: [&B::Buf; 8],
    shape: AttnShape,
) -> Result<()> {
    const OP: &str = "attention_bwd";
    attn_shape(OP, shape)?;
    let n = shape.qkv_len();
    exact(
        be,
        OP,
        [("q", q, n), ("k", k, n), ("v", v, n), ("d_out", d_out, n)],
    )?;
    exact(be, OP, [("probs", probs, shape.probs_len())])?;
    exact(be, OP, [("dq", dq, n), ("dk", dk, n), ("dv", dv, n)])
}

/// A table of whole `dim`-wide rows, `ids.len()` rows of output or gradient, and every id
/// inside the table (`vocab` = the table's rows).
fn embedding<B: Backend>(
    be: &B,
    op: &'static str,
    [(table_name, table), (rows_name, rows)]: [(&'static str, &B::Buf); 2],
    ids_: &[u32],
    dim: usize,
) -> Result<()> {
    let vocab = be.len(table).checked_div(dim).unwrap_or(0);
    exact(
        be,
        op,
        [
            (table_name, table, vocab * dim),
            (rows_name, rows, ids_.len() * dim),
        ],
    )?;
    ids(op, ids_, vocab, false)
}

/// [`Backend::embedding_fwd`]: `table: [vocab, dim]`, `out: [ids, dim]`, every id `< vocab`.
pub(super) fn embedding_fwd<B: Backend>(
    be: &B,
    [table, out]: [&B::Buf; 2],
    ids: &[u32],
    dim: usize,
) -> Result<()> {
    embedding(
        be,
        "embedding_fwd",
        [("table", table), ("out", out)],
        ids,
        dim,
    )
}

/// [`Backend::embedding_bwd`]: `dtable: [vocab, dim]`, `dy: [ids, dim]`, every id `< vocab`.
pub(super) fn embedding_bwd<B: Backend>(
    be: &B,
    ids: &[u32],
    [dy, dtable]: [&B::Buf; 2],
    dim: usize,
) -> Result<()> {
    embedding(
        be,
        "embedding_bwd",
        [("dtable", dtable), ("dy", dy)],
        ids,
        dim,
    )
}

/// [`Backend::add_broadcast_rows`]: `dst: [batch, row_len]`, `row` at least `row_len` long.
pub(super) fn add_broadcast_rows<B: Backend>(
    be: &B,
    [row, dst]: [&B::Buf; 2],
    batch: usize,
    row_len: usize,
) -> Result<()> {
    const OP: &str = "add_broadcast_rows";
    exact(be, OP, [("dst", dst, batch * row_len)])?;
    at_least(be, OP, [("row", row, row_len)])
}

/// [`Backend::sum_rows`]: `src: [batch, row_len]`, `out` at least `row_len` long.
pub(super) fn sum_rows<B: Backend>(
    be: &B,
    [src, out]: [&B::Buf; 2],
    batch: usize,
    row_len: usize,
) -> Result<()> {
    const OP: &str = "sum_rows";
    exact(be, OP, [("src", src, batch * row_len)])?;
    at_least(be, OP, [("out", out, row_len)])
}

/// [`Backend::cross_entropy_fwd`]: `logits, probs: [targets, vocab]`, every target
/// `< vocab` or [`IGNORE_TARGET`].
pub(super) fn cross_entropy_fwd<B: Backend>(
    be: &B,
    [logits, probs]: [&B::Buf; 2],
    targets: &[u32],
    vocab: usize,
) -> Result<()> {
    const OP: &str = "cross_entropy_fwd";
    let n = targets.len() * vocab;
    exact(be, OP, [("logits", logits, n), ("probs", probs, n)])?;
    ids(OP, targets, vocab, true)
}

/// [`Backend::cross_entropy_grad`]: `logits: [targets, vocab]`, every target `< vocab` or
/// [`IGNORE_TARGET`].
pub(super) fn cross_entropy_grad<B: Backend>(
    be: &B,
    logits: &B::Buf,
    targets: &[u32],
    vocab: usize,
) -> Result<()> {
    const OP: &str = "cross_entropy_grad";
    exact(be, OP, [("logits", logits, targets.len() * vocab)])?;
    ids(OP, targets, vocab, true)
}

/// [`Backend::cross_entropy_bwd`]: `probs, dlogits: [targets, vocab]`, every target
/// `< vocab` or [`IGNORE_TARGET`].
pub(super) fn cross_entropy_bwd<B: Backend>(
    be: &B,
    [probs, dlogits]: [&B::Buf; 2],
    targets: &[u32],
    vocab: usize,
) -> Result<()> {
    const OP: &str = "cross_entropy_bwd";
    let n = targets.len() * vocab;
    exact(be, OP, [("probs", probs, n), ("dlogits", dlogits, n)])?;
    ids(OP, targets, vocab, true)
}

/// [`Backend::adamw_step`]: `grad`, `m`, `v` and the `master` copy (when given) as long as
/// `param`.
pub(super) fn adamw_step<B: Backend>(
    be: &B,
    [param, grad, m, v]: [&B::Buf; 4],
    master: Option<&B::Buf>,
) -> Result<()> {
    const OP: &str = "adamw_step";
    let n = be.len(param);
    exact(be, OP, [("grad", grad, n), ("m", m, n), ("v", v, n)])?;
    master.map_or(Ok(()), |master| exact(be, OP, [("master", master, n)]))
}

#[cfg(test)]
mod tests;
