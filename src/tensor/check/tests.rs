//! The exact error of every operation for every bad operand, on the CPU backend: each case
//! makes one operand one element too long (or one parameter invalid) and pins the message,
//! so the contract stated in [`super`] cannot drift. `tests/cuda_backend.rs` checks that the
//! CUDA backend reports the same errors.

use crate::tensor::{
    AdamWStep, AttnShape, Backend, BatchedGemm, CpuBackend, DType, Gemm, IGNORE_TARGET,
};

type Buf = <CpuBackend as Backend>::Buf;

fn be() -> CpuBackend {
    CpuBackend::new(1).unwrap()
}

fn z(be: &CpuBackend, n: usize) -> Buf {
    be.zeros(n, DType::F32).unwrap()
}

/// Runs `op` once per operand with that operand's length one too many (the others as in
/// `lens`), returning the error messages; `op` must accept `lens` itself.
fn each_operand_wrong<const N: usize>(
    lens: [usize; N],
    op: impl Fn(&CpuBackend, &mut [Buf; N]) -> crate::tensor::Result<()>,
) -> Vec<String> {
    let be = be();
    let mut ok = lens.map(|n| z(&be, n));
    op(&be, &mut ok).expect("the base lengths are valid");
    (0..N)
        .map(|i| {
            let mut bufs = lens.map(|n| z(&be, n));
            bufs[i] = z(&be, lens[i] + 1);
            op(&be, &mut bufs).unwrap_err().to_string()
        })
        .collect()
}

fn shape(op: &str, operand: &str, got: usize, expected: usize) -> String {
    format!("{op}: operand `{operand}` has {got} elements, expected {expected}")
}

#[test]
fn copy_and_elementwise() {
    assert_eq!(
        each_operand_wrong([4, 4], |b, [s, d]| b.copy(s, d)),
        [shape("copy", "dst", 4, 5), shape("copy", "dst", 5, 4)]
    );
    assert_eq!(
        each_operand_wrong([3, 3, 3], |b, [x, y, o]| b.add(x, y, o)),
        [
            shape("add", "b", 3, 4),
            shape("add", "b", 4, 3),
            shape("add", "out", 4, 3),
        ]
    );
    assert_eq!(
        each_operand_wrong([3, 3], |b, [s, d]| b.axpy(2.0, s, d)),
        [shape("axpy", "dst", 3, 4), shape("axpy", "dst", 4, 3)]
    );
    let act = crate::tensor::Activation::Gelu;
    assert_eq!(
        each_operand_wrong([3, 3], |b, [x, o]| b.activation_fwd(act, x, o)),
        [
            shape("activation_fwd", "out", 3, 4),
            shape("activation_fwd", "out", 4, 3),
        ]
    );
    assert_eq!(
        each_operand_wrong([3, 3, 3], |b, [x, dy, dx]| b.activation_bwd(act, x, dy, dx)),
        [
            shape("activation_bwd", "dy", 3, 4),
            shape("activation_bwd", "dy", 4, 3),
            shape("activation_bwd", "dx", 4, 3),
        ]
    );
    assert_eq!(
        each_operand_wrong([6, 6], |b, [x, o]| b.softmax_rows(x, o, 2, 3)),
        [
            shape("softmax_rows", "x", 7, 6),
            shape("softmax_rows", "out", 7, 6),
        ]
    );
}

#[test]
fn matmul() {
    assert_eq!(
        each_operand_wrong([6, 12, 8], |b, [x, y, c]| {
            b.matmul(x, y, c, Gemm::nn(2, 3, 4))
        }),
        [
            shape("matmul", "a", 7, 6),
            shape("matmul", "b", 13, 12),
            shape("matmul", "c", 9, 8),
        ]
    );
}

#[test]
fn matmul_batched() {
    let g = BatchedGemm {
        gemm: Gemm::nn(2, 3, 4),
        batch: 3,
        stride_a: 6,
        stride_b: 0,
        stride_c: 8,
    };
    let be = be();
    let run = |a: usize, b: usize, c: usize, g: BatchedGemm| {
        be.matmul_batched(&z(&be, a), &z(&be, b), &mut z(&be, c), g)
            .map_err(|e| e.to_string())
    };
    // Strided operands need `(batch − 1)·stride + size` elements; more is fine.
    assert_eq!(run(18, 12, 24, g), Ok(()));
    assert_eq!(run(19, 13, 25, g), Ok(()));
    assert_eq!(
        run(17, 12, 24, g),
        Err(shape("matmul_batched", "a", 17, 18))
    );
    assert_eq!(
        run(18, 11, 24, g),
        Err(shape("matmul_batched", "b", 11, 12))
    );
    assert_eq!(
        run(18, 12, 23, g),
        Err(shape("matmul_batched", "c", 23, 24))
    );
    // No products: nothing is read or written, so nothing is checked.
    assert_eq!(run(0, 0, 0, BatchedGemm { batch: 0, ..g }), Ok(()));
    let shared = BatchedGemm { stride_c: 0, ..g };
    assert_eq!(
        run(18, 12, 8, shared),
        Err(
            "matmul_batched: stride_c = 0 overwrites one output with every product; \
             set accumulate"
                .into()
        )
    );
    let summed = BatchedGemm {
        gemm: g.gemm.accumulate(),
        ..shared
    };
    assert_eq!(run(18, 12, 8, summed), Ok(()));
    // One product may write at stride 0.
    assert_eq!(run(6, 12, 8, BatchedGemm { batch: 1, ..shared }), Ok(()));
}

#[test]
fn rmsnorm() {
    let (rows, dim) = (2, 3);
    assert_eq!(
        each_operand_wrong([6, 3, 6, 2], |b, [x, w, o, r]| {
            b.rmsnorm_fwd(x, w, o, r, rows, dim, 1e-5)
        }),
        [
            shape("rmsnorm_fwd", "x", 7, 6),
            shape("rmsnorm_fwd", "weight", 4, 3),
            shape("rmsnorm_fwd", "out", 7, 6),
            shape("rmsnorm_fwd", "rstd", 3, 2),
        ]
    );
    assert_eq!(
        each_operand_wrong([6, 3, 2, 6, 6], |b, [x, w, r, dy, dx]| {
            b.rmsnorm_bwd_input(x, w, r, dy, dx, rows, dim)
        }),
        [
            shape("rmsnorm_bwd_input", "x", 7, 6),
            shape("rmsnorm_bwd_input", "weight", 4, 3),
            shape("rmsnorm_bwd_input", "rstd", 3, 2),
            shape("rmsnorm_bwd_input", "dy", 7, 6),
            shape("rmsnorm_bwd_input", "dx", 7, 6),
        ]
    );
    assert_eq!(
        each_operand_wrong([6, 2, 6, 3], |b, [x, r, dy, dw]| {
            b.rmsnorm_bwd_weight(x, r, dy, dw, rows, dim)
        }),
        [
            shape("rmsnorm_bwd_weight", "x", 7, 6),
            shape("rmsnorm_bwd_weight", "rstd", 3, 2),
            shape("rmsnorm_bwd_weight", "dy", 7, 6),
            shape("rmsnorm_bwd_weight", "dweight", 4, 3),
        ]
    );
}

#[test]
fn attention() {
    let s = AttnShape {
        batch: 1,
        seq: 2,
        heads: 2,
        head_dim: 3,
    };
    let (n, p) = (s.qkv_len(), s.probs_len());
    assert_eq!((n, p), (12, 8));
    assert_eq!(
        each_operand_wrong([n, n, n, n, p], |b, [q, k, v, o, pr]| {
            b.attention_fwd(q, k, v, o, pr, s)
        }),
        ["q", "k", "v", "out", "probs"].map(|o| {
            let (got, want) = if o == "probs" { (9, 8) } else { (13, 12) };
            shape("attention_fwd", o, got, want)
        })
    );
    assert_eq!(
        each_operand_wrong(
            [n, n, n, p, n, n, n, n],
            |b, [q, k, v, pr, d, dq, dk, dv]| { b.attention_bwd(q, k, v, pr, d, dq, dk, dv, s) }
        ),
        ["q", "k", "v", "probs", "d_out", "dq", "dk", "dv"].map(|o| {
            let (got, want) = if o == "probs" { (9, 8) } else { (13, 12) };
            shape("attention_bwd", o, got, want)
        })
    );
    let be = be();
    for (heads, head_dim) in [(0, 3), (2, 0)] {
        let bad = AttnShape {
            heads,
            head_dim,
            ..s
        };
        let reason = format!("heads ({heads}) and head_dim ({head_dim}) must be positive");
        let (q, mut o, mut pr) = (z(&be, n), z(&be, n), z(&be, p));
        let e = be
            .attention_fwd(&q, &q, &q, &mut o, &mut pr, bad)
            .unwrap_err();
        assert_eq!(e.to_string(), format!("attention_fwd: {reason}"));
        let (mut dq, mut dk, mut dv) = (z(&be, n), z(&be, n), z(&be, n));
        let e = be
            .attention_bwd(&q, &q, &q, &pr, &q, &mut dq, &mut dk, &mut dv, bad)
            .unwrap_err();
        assert_eq!(e.to_string(), format!("attention_bwd: {reason}"));
    }
}

#[test]
fn embeddings_and_broadcast_rows() {
    let be = be();
    let dim = 3;
    // The table's rows are `len / dim`; a ragged table is one element off a whole row count.
    let (t, mut out) = (z(&be, 7), z(&be, 2 * dim));
    let e = be.embedding_fwd(&t, &[0, 1], &mut out, dim).unwrap_err();
    assert_eq!(e.to_string(), shape("embedding_fwd", "table", 7, 6));
    let t = z(&be, 4 * dim);
    let e = be.embedding_fwd(&t, &[0, 1, 2], &mut out, dim).unwrap_err();
    assert_eq!(e.to_string(), shape("embedding_fwd", "out", 6, 9));
    let e = be.embedding_fwd(&t, &[0, 4], &mut out, dim).unwrap_err();
    assert_eq!(
        e.to_string(),
        "embedding_fwd: id 4 at position 1 is out of range (vocabulary 4)"
    );
    let mut dt = z(&be, 7);
    let e = be.embedding_bwd(&[0, 1], &out, &mut dt, dim).unwrap_err();
    assert_eq!(e.to_string(), shape("embedding_bwd", "dtable", 7, 6));
    let mut dt = z(&be, 4 * dim);
    let e = be.embedding_bwd(&[0], &out, &mut dt, dim).unwrap_err();
    assert_eq!(e.to_string(), shape("embedding_bwd", "dy", 6, 3));
    let e = be
        .embedding_bwd(&[IGNORE_TARGET, 0], &out, &mut dt, dim)
        .unwrap_err();
    assert!(e.to_string().contains("id 4294967295 at position 0"), "{e}");

    // `row`/`out` may be longer than `row_len`, not shorter.
    let (row, mut dst) = (z(&be, 5), z(&be, 8));
    assert!(be.add_broadcast_rows(&row, &mut dst, 2, 4).is_ok());
    let e = be.add_broadcast_rows(&row, &mut dst, 3, 4).unwrap_err();
    assert_eq!(e.to_string(), shape("add_broadcast_rows", "dst", 8, 12));
    let e = be.add_broadcast_rows(&row, &mut dst, 1, 8).unwrap_err();
    assert_eq!(e.to_string(), shape("add_broadcast_rows", "row", 5, 8));
    let (src, mut sum) = (z(&be, 8), z(&be, 5));
    assert!(be.sum_rows(&src, &mut sum, 2, 4).is_ok());
    let e = be.sum_rows(&src, &mut sum, 4, 4).unwrap_err();
    assert_eq!(e.to_string(), shape("sum_rows", "src", 8, 16));
    let e = be.sum_rows(&src, &mut sum, 1, 8).unwrap_err();
    assert_eq!(e.to_string(), shape("sum_rows", "out", 5, 8));
}

#[test]
fn cross_entropy() {
    let targets = [0, IGNORE_TARGET];
    assert_eq!(
        each_operand_wrong([6, 6], |b, [l, p]| {
            b.cross_entropy_fwd(l, &targets, p, 3).map(|_| ())
        }),
        [
            shape("cross_entropy_fwd", "logits", 7, 6),
            shape("cross_entropy_fwd", "probs", 7, 6),
        ]
    );
    assert_eq!(
        each_operand_wrong([6, 6], |b, [p, d]| b
            .cross_entropy_bwd(p, &targets, d, 3, 1.0)),
        [
            shape("cross_entropy_bwd", "probs", 7, 6),
            shape("cross_entropy_bwd", "dlogits", 7, 6),
        ]
    );
    let be = be();
    let (l, mut p) = (z(&be, 6), z(&be, 6));
    let e = be.cross_entropy_fwd(&l, &[3, 0], &mut p, 3).unwrap_err();
    assert_eq!(
        e.to_string(),
        "cross_entropy_fwd: id 3 at position 0 is out of range (vocabulary 3)"
    );
    let e = be
        .cross_entropy_bwd(&p, &[0, 3], &mut z(&be, 6), 3, 1.0)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "cross_entropy_bwd: id 3 at position 1 is out of range (vocabulary 3)"
    );
}

#[test]
fn adamw() {
    let hp = AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        step: 1,
        grad_scale: 1.0,
    };
    // `param` sets the length the others must have.
    assert_eq!(
        each_operand_wrong([4, 4, 4, 4], |b, [p, g, m, v]| b
            .adamw_step(p, None, g, m, v, hp)),
        [
            shape("adamw_step", "grad", 4, 5),
            shape("adamw_step", "grad", 5, 4),
            shape("adamw_step", "m", 5, 4),
            shape("adamw_step", "v", 5, 4),
        ]
    );
    assert_eq!(
        each_operand_wrong([4, 4, 4, 4, 4], |b, [p, master, g, m, v]| {
            b.adamw_step(p, Some(master), g, m, v, hp)
        })[1],
        shape("adamw_step", "master", 5, 4)
    );
}
