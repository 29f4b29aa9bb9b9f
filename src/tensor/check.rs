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

use super::{AttnShape, Backend, BatchedGemm, Gemm, IGNORE_TARGET, Result, TensorError};

/// `buf` has exactly `expected` elements.
fn exact<B: Backend>(
    be: &B,
    op: &'static str,
    operand: &'static str,
    buf: &B::Buf,
    expected: usize,
) -> Result<()> {
    let got = be.len(buf);
    if got == expected {
        Ok(())
    } else {
        Err(shape_error(op, operand, expected, got))
    }
}

/// `buf` has at least `expected` elements.
fn at_least<B: Backend>(
    be: &B,
    op: &'static str,
    operand: &'static str,
    buf: &B::Buf,
    expected: usize,
) -> Result<()> {
    let got = be.len(buf);
    if got >= expected {
        Ok(())
    } else {
        Err(shape_error(op, operand, expected, got))
    }
}

fn shape_error(
    op: &'static str,
    operand: &'static str,
    expected: usize,
    got: usize,
) -> TensorError {
    TensorError::Shape {
        op,
        operand,
        expected,
        got,
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
pub(super) fn copy<B: Backend>(be: &B, src: &B::Buf, dst: &B::Buf) -> Result<()> {
    exact(be, "copy", "dst", dst, be.len(src))
}

/// [`Backend::matmul`]: `a: [m, k]`, `b: [k, n]`, `c: [m, n]` (transposes store the same count).
pub(super) fn matmul<B: Backend>(
    be: &B,
    a: &B::Buf,
    b: &B::Buf,
    c: &B::Buf,
    g: Gemm,
) -> Result<()> {
    const OP: &str = "matmul";
    exact(be, OP, "a", a, g.m * g.k)?;
    exact(be, OP, "b", b, g.k * g.n)?;
    exact(be, OP, "c", c, g.m * g.n)
}

/// [`Backend::matmul_batched`]: each operand reaches its last product, i.e. holds at least
/// `(batch − 1)·stride + size` elements (more is allowed: strided views into a bigger
/// buffer); `stride_c = 0` over several products needs `accumulate`. With `batch = 0`
/// nothing is touched, so nothing is checked.
pub(super) fn matmul_batched<B: Backend>(
    be: &B,
    a: &B::Buf,
    b: &B::Buf,
    c: &B::Buf,
    g: BatchedGemm,
) -> Result<()> {
    const OP: &str = "matmul_batched";
    let BatchedGemm {
        gemm: gm,
        batch,
        stride_a,
        stride_b,
        stride_c,
    } = g;
    let Some(last) = batch.checked_sub(1) else {
        return Ok(());
    };
    for (name, buf, stride, size) in [
        ("a", a, stride_a, gm.m * gm.k),
        ("b", b, stride_b, gm.k * gm.n),
        ("c", c, stride_c, gm.m * gm.n),
    ] {
        at_least(be, OP, name, buf, last * stride + size)?;
    }
    if stride_c == 0 && batch > 1 && !gm.accumulate {
        return Err(TensorError::Invalid {
            op: OP,
            reason: "stride_c = 0 overwrites one output with every product; set accumulate".into(),
        });
    }
    Ok(())
}

/// [`Backend::add`]: `b` and `out` as long as `a`.
pub(super) fn add<B: Backend>(be: &B, a: &B::Buf, b: &B::Buf, out: &B::Buf) -> Result<()> {
    let n = be.len(a);
    exact(be, "add", "b", b, n)?;
    exact(be, "add", "out", out, n)
}

/// [`Backend::axpy`]: `dst` as long as `src`.
pub(super) fn axpy<B: Backend>(be: &B, src: &B::Buf, dst: &B::Buf) -> Result<()> {
    exact(be, "axpy", "dst", dst, be.len(src))
}

/// [`Backend::activation_fwd`]: `out` as long as `x`.
pub(super) fn activation_fwd<B: Backend>(be: &B, x: &B::Buf, out: &B::Buf) -> Result<()> {
    exact(be, "activation_fwd", "out", out, be.len(x))
}

/// [`Backend::activation_bwd`]: `dy` and `dx` as long as `x`.
pub(super) fn activation_bwd<B: Backend>(
    be: &B,
    x: &B::Buf,
    dy: &B::Buf,
    dx: &B::Buf,
) -> Result<()> {
    const OP: &str = "activation_bwd";
    let n = be.len(x);
    exact(be, OP, "dy", dy, n)?;
    exact(be, OP, "dx", dx, n)
}

/// [`Backend::softmax_rows`]: `x` and `out` are `[rows, cols]`.
pub(super) fn softmax_rows<B: Backend>(
    be: &B,
    x: &B::Buf,
    out: &B::Buf,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const OP: &str = "softmax_rows";
    exact(be, OP, "x", x, rows * cols)?;
    exact(be, OP, "out", out, rows * cols)
}

/// [`Backend::rmsnorm_fwd`]: `x, out: [rows, dim]`, `weight: [dim]`, `rstd: [rows]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn rmsnorm_fwd<B: Backend>(
    be: &B,
    x: &B::Buf,
    weight: &B::Buf,
    out: &B::Buf,
    rstd: &B::Buf,
    rows: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "rmsnorm_fwd";
    exact(be, OP, "x", x, rows * dim)?;
    exact(be, OP, "weight", weight, dim)?;
    exact(be, OP, "out", out, rows * dim)?;
    exact(be, OP, "rstd", rstd, rows)
}

/// [`Backend::rmsnorm_bwd_input`]: `x, dy, dx: [rows, dim]`, `weight: [dim]`, `rstd: [rows]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn rmsnorm_bwd_input<B: Backend>(
    be: &B,
    x: &B::Buf,
    weight: &B::Buf,
    rstd: &B::Buf,
    dy: &B::Buf,
    dx: &B::Buf,
    rows: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "rmsnorm_bwd_input";
    exact(be, OP, "x", x, rows * dim)?;
    exact(be, OP, "weight", weight, dim)?;
    exact(be, OP, "rstd", rstd, rows)?;
    exact(be, OP, "dy", dy, rows * dim)?;
    exact(be, OP, "dx", dx, rows * dim)
}

/// [`Backend::rmsnorm_bwd_weight`]: `x, dy: [rows, dim]`, `rstd: [rows]`, `dweight: [dim]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn rmsnorm_bwd_weight<B: Backend>(
    be: &B,
    x: &B::Buf,
    rstd: &B::Buf,
    dy: &B::Buf,
    dweight: &B::Buf,
    rows: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "rmsnorm_bwd_weight";
    exact(be, OP, "x", x, rows * dim)?;
    exact(be, OP, "rstd", rstd, rows)?;
    exact(be, OP, "dy", dy, rows * dim)?;
    exact(be, OP, "dweight", dweight, dim)
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

/// [`Backend::attention_fwd`]: a valid shape, `q, k, v, out` of
/// [`AttnShape::qkv_len`] and `probs` of [`AttnShape::probs_len`] elements.
pub(super) fn attention_fwd<B: Backend>(
    be: &B,
    [q, k, v, out]: [&B::Buf; 4],
    probs: &B::Buf,
    shape: AttnShape,
) -> Result<()> {
    const OP: &str = "attention_fwd";
    attn_shape(OP, shape)?;
    let n = shape.qkv_len();
    for (name, buf) in [("q", q), ("k", k), ("v", v), ("out", out)] {
        exact(be, OP, name, buf, n)?;
    }
    exact(be, OP, "probs", probs, shape.probs_len())
}

/// [`Backend::attention_bwd`]: as the forward, with `d_out` and the gradients `dq, dk, dv`
/// of [`AttnShape::qkv_len`] elements.
pub(super) fn attention_bwd<B: Backend>(
    be: &B,
    [q, k, v, d_out]: [&B::Buf; 4],
    probs: &B::Buf,
    [dq, dk, dv]: [&B::Buf; 3],
    shape: AttnShape,
) -> Result<()> {
    const OP: &str = "attention_bwd";
    attn_shape(OP, shape)?;
    let n = shape.qkv_len();
    for (name, buf) in [("q", q), ("k", k), ("v", v), ("d_out", d_out)] {
        exact(be, OP, name, buf, n)?;
    }
    exact(be, OP, "probs", probs, shape.probs_len())?;
    for (name, buf) in [("dq", dq), ("dk", dk), ("dv", dv)] {
        exact(be, OP, name, buf, n)?;
    }
    Ok(())
}

/// A table of whole `dim`-wide rows, `ids.len()` rows of gradient or output, and every id
/// inside the table (`vocab = table rows`).
fn embedding<B: Backend>(
    be: &B,
    op: &'static str,
    (table_name, table): (&'static str, &B::Buf),
    (rows_name, rows): (&'static str, &B::Buf),
    ids_: &[u32],
    dim: usize,
) -> Result<()> {
    let vocab = be.len(table).checked_div(dim).unwrap_or(0);
    exact(be, op, table_name, table, vocab * dim)?;
    exact(be, op, rows_name, rows, ids_.len() * dim)?;
    ids(op, ids_, vocab, false)
}

/// [`Backend::embedding_fwd`]: `table: [vocab, dim]`, `out: [ids, dim]`, every id `< vocab`.
pub(super) fn embedding_fwd<B: Backend>(
    be: &B,
    table: &B::Buf,
    ids: &[u32],
    out: &B::Buf,
    dim: usize,
) -> Result<()> {
    embedding(
        be,
        "embedding_fwd",
        ("table", table),
        ("out", out),
        ids,
        dim,
    )
}

/// [`Backend::embedding_bwd`]: `dtable: [vocab, dim]`, `dy: [ids, dim]`, every id `< vocab`.
pub(super) fn embedding_bwd<B: Backend>(
    be: &B,
    ids: &[u32],
    dy: &B::Buf,
    dtable: &B::Buf,
    dim: usize,
) -> Result<()> {
    embedding(
        be,
        "embedding_bwd",
        ("dtable", dtable),
        ("dy", dy),
        ids,
        dim,
    )
}

/// [`Backend::add_broadcast_rows`]: `dst: [batch, row_len]`, `row` at least `row_len` long.
pub(super) fn add_broadcast_rows<B: Backend>(
    be: &B,
    row: &B::Buf,
    dst: &B::Buf,
    batch: usize,
    row_len: usize,
) -> Result<()> {
    const OP: &str = "add_broadcast_rows";
    exact(be, OP, "dst", dst, batch * row_len)?;
    at_least(be, OP, "row", row, row_len)
}

/// [`Backend::sum_rows`]: `src: [batch, row_len]`, `out` at least `row_len` long.
pub(super) fn sum_rows<B: Backend>(
    be: &B,
    src: &B::Buf,
    out: &B::Buf,
    batch: usize,
    row_len: usize,
) -> Result<()> {
    const OP: &str = "sum_rows";
    exact(be, OP, "src", src, batch * row_len)?;
    at_least(be, OP, "out", out, row_len)
}

/// The two `[rows, vocab]` operands of a cross-entropy (`rows = targets.len()`), and every
/// target `< vocab` or [`IGNORE_TARGET`].
fn cross_entropy<B: Backend>(
    be: &B,
    op: &'static str,
    [(first_name, first), (second_name, second)]: [(&'static str, &B::Buf); 2],
    targets: &[u32],
    vocab: usize,
) -> Result<()> {
    let n = targets.len() * vocab;
    exact(be, op, first_name, first, n)?;
    exact(be, op, second_name, second, n)?;
    ids(op, targets, vocab, true)
}

/// [`Backend::cross_entropy_fwd`]: `logits, probs: [targets, vocab]`, valid targets.
pub(super) fn cross_entropy_fwd<B: Backend>(
    be: &B,
    logits: &B::Buf,
    targets: &[u32],
    probs: &B::Buf,
    vocab: usize,
) -> Result<()> {
    let operands = [("logits", logits), ("probs", probs)];
    cross_entropy(be, "cross_entropy_fwd", operands, targets, vocab)
}

/// [`Backend::cross_entropy_bwd`]: `probs, dlogits: [targets, vocab]`, valid targets.
pub(super) fn cross_entropy_bwd<B: Backend>(
    be: &B,
    probs: &B::Buf,
    targets: &[u32],
    dlogits: &B::Buf,
    vocab: usize,
) -> Result<()> {
    let operands = [("probs", probs), ("dlogits", dlogits)];
    cross_entropy(be, "cross_entropy_bwd", operands, targets, vocab)
}

/// [`Backend::adamw_step`]: `grad`, `m`, `v` and the `master` copy (when given) as long as
/// `param`.
pub(super) fn adamw_step<B: Backend>(
    be: &B,
    param: &B::Buf,
    master: Option<&B::Buf>,
    grad: &B::Buf,
    m: &B::Buf,
    v: &B::Buf,
) -> Result<()> {
    const OP: &str = "adamw_step";
    let n = be.len(param);
    exact(be, OP, "grad", grad, n)?;
    exact(be, OP, "m", m, n)?;
    exact(be, OP, "v", v, n)?;
    match master {
        Some(master) => exact(be, OP, "master", master, n),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests;
