//! Matrix products on cuBLAS, and causal attention built from them.
//!
//! cuBLAS is column-major; our matrices are row-major. A row-major `[r, c]` matrix with row
//! stride `ld` is, byte for byte, the column-major `[c, r]` matrix with leading dimension
//! `ld`, i.e. its transpose. So `C = op(A)·op(B)` (row-major) is computed as the column-major
//! `Cᵀ = op(B)ᵀ·op(A)ᵀ`: swap the operands, swap `m` and `n`, keep each operand's transpose
//! flag and pass each storage row stride as the leading dimension.

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{Gemm as _, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::CudaBuf;
use super::kernels::{self, K};
use super::{CudaBackend, dev, grid_rows};
use crate::tensor::TensorError;
use crate::tensor::{AttnShape, BatchedGemm, Gemm, Result, check};

/// One row-major product `C = alpha·op(A)·op(B) + beta·C` with explicit row strides.
#[derive(Clone, Copy, Debug)]
pub(super) struct RowMajorGemm {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    /// `A` is stored `[k, m]` (else `[m, k]`), rows `lda` apart.
    pub trans_a: bool,
    pub lda: usize,
    /// `B` is stored `[n, k]` (else `[k, n]`), rows `ldb` apart.
    pub trans_b: bool,
    pub ldb: usize,
    /// `C` is `[m, n]`, rows `ldc` apart.
    pub ldc: usize,
    pub alpha: f32,
    pub beta: f32,
}

/// `count` products; operand `X` of product `i` starts `i·stride_x` elements in.
#[derive(Clone, Copy, Debug)]
pub(super) struct Strides {
    pub count: usize,
    pub a: usize,
    pub b: usize,
    pub c: usize,
}

fn int(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| TensorError::Invalid {
        op,
        reason: format!("{what} = {v} exceeds cuBLAS's 32-bit sizes"),
    })
}

fn long(op: &'static str, what: &str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| TensorError::Invalid {
        op,
        reason: format!("{what} = {v} is too large"),
    })
}

impl RowMajorGemm {
    /// The column-major cuBLAS configuration of this product (operands swapped: cuBLAS's
    /// `A` is our `B` and its `B` is our `A`).
    fn column_major(&self, op: &'static str) -> Result<GemmConfig<f32>> {
        let flag = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        Ok(GemmConfig {
            transa: flag(self.trans_b),
            transb: flag(self.trans_a),
            m: int(op, "n", self.n)?,
            n: int(op, "m", self.m)?,
            k: int(op, "k", self.k)?,
            alpha: self.alpha,
            lda: int(op, "ldb", self.ldb.max(1))?,
            ldb: int(op, "lda", self.lda.max(1))?,
            beta: self.beta,
            ldc: int(op, "ldc", self.ldc.max(1))?,
        })
    }
}

/// The row-major product of a [`Gemm`] over densely stored operands.
pub(super) fn dense(g: Gemm) -> RowMajorGemm {
    RowMajorGemm {
        m: g.m,
        k: g.k,
        n: g.n,
        trans_a: g.trans_a,
        lda: if g.trans_a { g.m } else { g.k },
        trans_b: g.trans_b,
        ldb: if g.trans_b { g.k } else { g.n },
        ldc: g.n,
        alpha: 1.0,
        beta: if g.accumulate { 1.0 } else { 0.0 },
    }
}

impl CudaBackend {
    /// [`crate::tensor::Backend::matmul_batched`]: one strided-batched cuBLAS call, or a
    /// sequence of products when the outputs overlap.
    pub(super) fn batched_products(
        &self,
        a: &CudaBuf,
        b: &CudaBuf,
        c: &mut CudaBuf,
        g: BatchedGemm,
    ) -> Result<()> {
        const OP: &str = "matmul_batched";
        check::matmul_batched(self, [a, b, c], g)?;
        let BatchedGemm {
            gemm: gm,
            batch,
            stride_a,
            stride_b,
            stride_c,
        } = g;
        let size_c = gm.m * gm.n;
        if batch == 0 || size_c == 0 {
            return Ok(());
        }
        if gm.k == 0 {
            if gm.accumulate {
                return Ok(());
            }
            let s = self.stream().clone();
            return self.write(OP, c, |c| {
                for i in 0..batch {
                    s.memset_zeros(&mut c.slice_mut(i * stride_c..i * stride_c + size_c))
                        .map_err(dev(OP))?;
                }
                Ok(())
            });
        }
        let (a, b) = (self.read(OP, a)?, self.read(OP, b)?);
        self.write(OP, c, |c| {
            if batch == 1 || stride_c >= size_c {
                // Disjoint outputs: one strided-batched call.
                let strides = Strides {
                    count: batch,
                    a: stride_a,
                    b: stride_b,
                    c: stride_c,
                };
                self.sgemm(OP, dense(gm), Some(strides), &*a, &*b, c)
            } else {
                // Overlapping outputs (accumulating into a shared C): cuBLAS would race, so
                // run the products one after the other on the stream, as the CPU does.
                for i in 0..batch {
                    let (ai, bi) = (a.slice(i * stride_a..), b.slice(i * stride_b..));
                    let mut ci = c.slice_mut(i * stride_c..i * stride_c + size_c);
                    self.sgemm(OP, dense(gm), None, &ai, &bi, &mut ci)?;
                }
                Ok(())
            }
        })
    }

    /// Runs one product (or `strides.count` of them) on cuBLAS. `m, n, k` must be positive.
    pub(super) fn sgemm<A, B, C>(
        &self,
        op: &'static str,
        g: RowMajorGemm,
        strides: Option<Strides>,
        a: &A,
        b: &B,
        c: &mut C,
    ) -> Result<()>
    where
        A: DevicePtr<f32>,
        B: DevicePtr<f32>,
        C: DevicePtrMut<f32>,
    {
        let cfg = g.column_major(op)?;
        // cuBLAS runs in the thread's current context.
        self.inner.ctx.bind_to_thread().map_err(dev(op))?;
        let blas = self
            .inner
            .blas
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // SAFETY: the callers checked that every operand holds the elements these sizes,
        // strides and leading dimensions address; `c` is exclusively borrowed.
        let r = unsafe {
            match strides {
                None => blas.gemm(cfg, b, a, c),
                Some(s) => {
                    let batched = StridedBatchedConfig {
                        gemm: cfg,
                        batch_size: int(op, "batch", s.count)?,
                        stride_a: long(op, "stride_b", s.b)?,
                        stride_b: long(op, "stride_a", s.a)?,
                        stride_c: long(op, "stride_c", s.c)?,
                    };
                    blas.gemm_strided_batched(batched, b, a, c)
                }
            }
        };
        r.map_err(dev(op))
    }

    /// Causal attention forward on `f32` buffers (lengths checked by the caller).
    pub(super) fn attention_fwd_f32(
        &self,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        probs: &mut CudaSlice<f32>,
        s: AttnShape,
    ) -> Result<()> {
        const OP: &str = "attention_fwd";
        let AttnShape {
            batch,
            seq,
            heads,
            head_dim,
        } = s;
        if batch == 0 || seq == 0 {
            return Ok(());
        }
        let (row, block, scale) = (
            heads * head_dim,
            seq * heads * head_dim,
            1.0 / (head_dim as f32).sqrt(),
        );
        let per_head = Strides {
            count: heads,
            a: head_dim,
            b: head_dim,
            c: seq * seq,
        };
        // Scores S = Q·Kᵀ/√d for every head of sequence b, into probs[b].
        let scores = RowMajorGemm {
            m: seq,
            k: head_dim,
            n: seq,
            trans_a: false,
            lda: row,
            trans_b: true,
            ldb: row,
            ldc: seq,
            alpha: scale,
            beta: 0.0,
        };
        for b in 0..batch {
            let mut p = probs.slice_mut(b * heads * seq * seq..(b + 1) * heads * seq * seq);
            self.sgemm(
                OP,
                scores,
                Some(per_head),
                &q.slice(b * block..),
                &k.slice(b * block..),
                &mut p,
            )?;
        }
        let rows = grid_rows(OP, batch * heads * seq)?;
        let seq64 = seq as u64;
        launch!(
            self,
            OP,
            K::CausalSoftmax,
            kernels::per_row(rows, seq),
            [&mut *probs, &seq64]
        )?;
        // out = P·V, written head by head into the interleaved [seq, heads, head_dim] rows.
        let mix = RowMajorGemm {
            m: seq,
            k: seq,
            n: head_dim,
            trans_a: false,
            lda: seq,
            trans_b: false,
            ldb: row,
            ldc: row,
            alpha: 1.0,
            beta: 0.0,
        };
        let strides = Strides {
            count: heads,
            a: seq * seq,
            b: head_dim,
            c: head_dim,
        };
        for b in 0..batch {
            let p = probs.slice(b * heads * seq * seq..);
            let mut o = out.slice_mut(b * block..(b + 1) * block);
            self.sgemm(OP, mix, Some(strides), &p, &v.slice(b * block..), &mut o)?;
        }
        Ok(())
    }

    /// Causal attention backward on `f32` buffers (lengths checked by the caller).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_bwd_f32(
        &self,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        probs: &CudaSlice<f32>,
        d_out: &CudaSlice<f32>,
        dq: &mut CudaSlice<f32>,
        dk: &mut CudaSlice<f32>,
        dv: &mut CudaSlice<f32>,
        s: AttnShape,
    ) -> Result<()> {
        const OP: &str = "attention_bwd";
        let AttnShape {
            batch,
            seq,
            heads,
            head_dim,
        } = s;
        if batch == 0 || seq == 0 {
            return Ok(());
        }
        let (row, block, scale) = (
            heads * head_dim,
            seq * heads * head_dim,
            1.0 / (head_dim as f32).sqrt(),
        );
        let square = seq * seq;
        let mut ds = self.alloc_f32(OP, batch * heads * square)?;
        // [seq, seq] · [seq, head_dim] per head: P or dS on the left, an interleaved operand on
        // the right, an interleaved result (dV, dQ, dK).
        let left_square = |trans_a: bool| RowMajorGemm {
            m: seq,
            k: seq,
            n: head_dim,
            trans_a,
            lda: seq,
            trans_b: false,
            ldb: row,
            ldc: row,
            alpha: 1.0,
            beta: 0.0,
        };
        let square_by_head = Strides {
            count: heads,
            a: square,
            b: head_dim,
            c: head_dim,
        };
        // dP = dO·Vᵀ per head, into ds.
        let dp = RowMajorGemm {
            m: seq,
            k: head_dim,
            n: seq,
            trans_a: false,
            lda: row,
            trans_b: true,
            ldb: row,
            ldc: seq,
            alpha: 1.0,
            beta: 0.0,
        };
        let head_by_head = Strides {
            count: heads,
            a: head_dim,
            b: head_dim,
            c: square,
        };
        for b in 0..batch {
            let (p, d) = (probs.slice(b * heads * square..), d_out.slice(b * block..));
            // dV = Pᵀ·dO
            let mut gv = dv.slice_mut(b * block..(b + 1) * block);
            self.sgemm(OP, left_square(true), Some(square_by_head), &p, &d, &mut gv)?;
            let mut g = ds.slice_mut(b * heads * square..(b + 1) * heads * square);
            self.sgemm(
                OP,
                dp,
                Some(head_by_head),
                &d,
                &v.slice(b * block..),
                &mut g,
            )?;
        }
        // dS = P∘(dP − rowsum(dP∘P))/√d, in place.
        let rows = grid_rows(OP, batch * heads * seq)?;
        let seq64 = seq as u64;
        launch!(
            self,
            OP,
            K::AttentionDscores,
            kernels::per_row(rows, seq),
            [probs, &mut ds, &seq64, &scale]
        )?;
        for b in 0..batch {
            let g = ds.slice(b * heads * square..);
            // dQ = dS·K
            let mut gq = dq.slice_mut(b * block..(b + 1) * block);
            self.sgemm(
                OP,
                left_square(false),
                Some(square_by_head),
                &g,
                &k.slice(b * block..),
                &mut gq,
            )?;
            // dK = dSᵀ·Q
            let mut gk = dk.slice_mut(b * block..(b + 1) * block);
            self.sgemm(
                OP,
                left_square(true),
                Some(square_by_head),
                &g,
                &q.slice(b * block..),
                &mut gk,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemm(m: usize, k: usize, n: usize, trans_a: bool, trans_b: bool) -> RowMajorGemm {
        RowMajorGemm {
            m,
            k,
            n,
            trans_a,
            lda: if trans_a { m } else { k },
            trans_b,
            ldb: if trans_b { k } else { n },
            ldc: n,
            alpha: 1.0,
            beta: 0.0,
        }
    }

    /// Emulates cuBLAS sgemm (column-major, as documented) on host slices.
    fn column_major_sgemm(cfg: &GemmConfig<f32>, a: &[f32], b: &[f32], c: &mut [f32]) {
        let (m, n, k) = (cfg.m as usize, cfg.n as usize, cfg.k as usize);
        let (lda, ldb, ldc) = (cfg.lda as usize, cfg.ldb as usize, cfg.ldc as usize);
        let t = |op: cublasOperation_t| op == cublasOperation_t::CUBLAS_OP_T;
        let at = |i: usize, p: usize| {
            if t(cfg.transa) {
                a[p + i * lda]
            } else {
                a[i + p * lda]
            }
        };
        let bt = |p: usize, j: usize| {
            if t(cfg.transb) {
                b[j + p * ldb]
            } else {
                b[p + j * ldb]
            }
        };
        for j in 0..n {
            for i in 0..m {
                let dot: f32 = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
                c[i + j * ldc] = cfg.alpha * dot + cfg.beta * c[i + j * ldc];
            }
        }
    }

    /// The row-major → column-major mapping, checked against a plain row-major product for
    /// every transpose combination (this is the part of the GEMM path testable without a GPU).
    #[test]
    fn column_major_mapping_computes_the_row_major_product() {
        let (m, k, n) = (3, 4, 5);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 2.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 - 3.0).collect();
        for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
            // Store op(A) = a as [m, k] or its transpose [k, m]; same for B.
            let a_store: Vec<f32> = if trans_a {
                (0..k * m).map(|x| a[(x % m) * k + x / m]).collect()
            } else {
                a.clone()
            };
            let b_store: Vec<f32> = if trans_b {
                (0..n * k).map(|x| b[(x % k) * n + x / k]).collect()
            } else {
                b.clone()
            };
            let cfg = gemm(m, k, n, trans_a, trans_b)
                .column_major("test")
                .unwrap();
            let mut c = vec![0.0; m * n];
            column_major_sgemm(&cfg, &b_store, &a_store, &mut c);
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
                    assert_eq!(
                        c[i * n + j],
                        want,
                        "trans_a={trans_a} trans_b={trans_b} at ({i},{j})"
                    );
                }
            }
        }
    }

    #[test]
    fn sizes_beyond_32_bits_are_an_error() {
        assert!(
            gemm(1 << 31, 1, 1, false, false)
                .column_major("matmul")
                .is_err()
        );
        assert!(gemm(4, 4, 4, false, false).column_major("matmul").is_ok());
    }
}
