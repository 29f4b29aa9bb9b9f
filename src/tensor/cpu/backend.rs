//! [`Backend`] for [`CpuBackend`]: the operand checks (`crate::tensor::check`), then each
//! operation on the backend's threads (`CpuBackend::run`, `CpuBackend::product`), bf16
//! buffers widened where a kernel reads them and rounded where it writes them (`buf.rs`;
//! the products' blocks in `matmul.rs`): a block of rows at a time where the operation
//! allows (products, element-wise operations, norms, RoPE), so a bf16 buffer's `f32`
//! transient is a block, not the buffer.
//! The reference semantics the CUDA backend follows.

use half::bf16;

use super::buf::{Storage, block_len, gemm_slices, zip_rows};
use super::{CpuBackend, CpuBuf, blas, kernels};
use crate::tensor::bytes::{from_le, to_le};
use crate::tensor::{
    Activation, AdamWStep, AttnShape, Backend, BatchedGemm, DType, Gemm, Result, check,
};

impl Backend for CpuBackend {
    type Buf = CpuBuf;

    fn name(&self) -> String {
        let products = match blas::get() {
            Ok(Some(blas)) => format!(", products by {}", blas.name),
            _ => String::new(),
        };
        format!(
            "cpu ({} thread{}{products})",
            self.threads,
            if self.threads == 1 { "" } else { "s" }
        )
    }

    fn storage_dtype(&self) -> DType {
        self.storage
    }

    /// Every CPU buffer is host memory that any CPU backend reads; the same storage type
    /// keeps what a shared buffer computes that of one made here.
    fn shares_buffers_with(&self, other: &Self) -> bool {
        self.storage == other.storage
    }

    fn zeros(&self, len: usize, dtype: DType) -> Result<CpuBuf> {
        Ok(CpuBuf(match dtype {
            DType::F32 => Storage::F32(vec![0.0; len]),
            DType::Bf16 => Storage::Bf16(vec![bf16::ZERO; len]),
        }))
    }

    /// `f32` buffers are left as the allocator gives them; `bf16` ones are zeroed, since a
    /// kernel's write widens a `bf16` buffer's values before it overwrites them
    /// (`CpuBuf::write`). Poisoned (`CpuBackend::with_poisoned_outputs`), both are NaN.
    unsafe fn uninit(&self, len: usize, dtype: DType) -> Result<CpuBuf> {
        Ok(CpuBuf(match dtype {
            DType::F32 if self.poison => Storage::F32(vec![f32::NAN; len]),
            DType::Bf16 if self.poison => Storage::Bf16(vec![bf16::NAN; len]),
            DType::F32 => {
                let mut values = Vec::with_capacity(len);
                // SAFETY: the capacity is `len`, `f32` is `Copy` and has no invalid bit
                // patterns, and the caller writes every element before any is read (the
                // trait's contract, tested on the poisoned backend): no uninitialised value
                // is ever read, which is what the lint guards against (candle's CPU
                // `alloc_uninit` does the same).
                #[allow(clippy::uninit_vec)]
                unsafe {
                    values.set_len(len)
                };
                Storage::F32(values)
            }
            DType::Bf16 => return self.zeros(len, dtype),
        }))
    }

    fn from_host(&self, data: &[f32], dtype: DType) -> Result<CpuBuf> {
        Ok(CpuBuf(match dtype {
            DType::F32 => Storage::F32(data.to_vec()),
            DType::Bf16 => Storage::Bf16(data.iter().map(|&x| bf16::from_f32(x)).collect()),
        }))
    }

    fn from_host_vec(&self, data: Vec<f32>, dtype: DType) -> Result<CpuBuf> {
        match dtype {
            DType::F32 => Ok(CpuBuf(Storage::F32(data))),
            DType::Bf16 => self.from_host(&data, dtype),
        }
    }

    fn to_host(&self, buf: &CpuBuf) -> Result<Vec<f32>> {
        Ok(buf.read().into_owned())
    }

    fn take_host(&self, buf: CpuBuf) -> Result<Vec<f32>> {
        Ok(match buf.0 {
            Storage::F32(v) => v,
            Storage::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        })
    }

    fn to_host_bytes(&self, buf: &CpuBuf) -> Result<Vec<u8>> {
        Ok(match &buf.0 {
            Storage::F32(v) => to_le(v, |x| x.to_le_bytes()),
            Storage::Bf16(v) => to_le(v, |x| x.to_bits().to_le_bytes()),
        })
    }

    fn from_host_bytes(&self, bytes: &[u8], dtype: DType) -> Result<CpuBuf> {
        const OP: &str = "from_host_bytes";
        Ok(CpuBuf(match dtype {
            DType::F32 => Storage::F32(from_le(OP, bytes, dtype, f32::from_le_bytes)?),
            DType::Bf16 => Storage::Bf16(from_le(OP, bytes, dtype, |b| {
                bf16::from_bits(u16::from_le_bytes(b))
            })?),
        }))
    }

    fn len(&self, buf: &CpuBuf) -> usize {
        buf.len()
    }

    fn dtype(&self, buf: &CpuBuf) -> DType {
        buf.dtype()
    }

    fn copy(&self, src: &CpuBuf, dst: &mut CpuBuf) -> Result<()> {
        check::copy(self, [src, dst])?;
        match (&src.0, &mut dst.0) {
            (Storage::F32(s), Storage::F32(d)) => d.copy_from_slice(s),
            (Storage::Bf16(s), Storage::Bf16(d)) => d.copy_from_slice(s),
            // Widened or rounded value by value: no transient.
            (Storage::Bf16(s), Storage::F32(d)) => {
                d.iter_mut().zip(s).for_each(|(d, s)| *d = s.to_f32())
            }
            (Storage::F32(s), Storage::Bf16(d)) => d
                .iter_mut()
                .zip(s)
                .for_each(|(d, &s)| *d = bf16::from_f32(s)),
        }
        Ok(())
    }

    fn copy_range(
        &self,
        src: &CpuBuf,
        src_at: usize,
        dst: &mut CpuBuf,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        check::copy_range(self, [src, dst], src_at, dst_at, len)?;
        let (from, to) = (src_at..src_at + len, dst_at..dst_at + len);
        match (&src.0, &mut dst.0) {
            (Storage::F32(s), Storage::F32(d)) => d[to].copy_from_slice(&s[from]),
            (Storage::Bf16(s), Storage::Bf16(d)) => d[to].copy_from_slice(&s[from]),
            _ => unreachable!("check::copy_range refuses two storage types"),
        }
        Ok(())
    }

    fn fill(&self, buf: &mut CpuBuf, value: f32) -> Result<()> {
        zip_rows(buf, [], 1, |_, d, []| d.fill(value));
        Ok(())
    }

    fn matmul(&self, a: &CpuBuf, b: &CpuBuf, c: &mut CpuBuf, g: Gemm) -> Result<()> {
        check::matmul(self, [a, b, c], g)?;
        let par = self.parallelism();
        if (a.is_bf16() || c.is_bf16())
            && g.m * g.k * g.n > 0
            && self.matmul_blocks(a, b, c, g, par)
        {
            return Ok(());
        }
        let (a, b) = (a.read(), b.read());
        let work = g.m * g.k * g.n;
        self.product(work, work, || c.write(|c| gemm_slices(&a, &b, c, g, par)));
        Ok(())
    }

    fn matmul_batched(&self, a: &CpuBuf, b: &CpuBuf, c: &mut CpuBuf, g: BatchedGemm) -> Result<()> {
        check::matmul_batched(self, [a, b, c], g)?;
        let gm = g.gemm;
        let (a, b) = (a.read(), b.read());
        let par = self.parallelism();
        let each = gm.m * gm.k * gm.n;
        self.product(each, g.batch * each, || {
            c.write(|c| {
                for i in 0..g.batch {
                    let (a, b) = (&a[i * g.stride_a..], &b[i * g.stride_b..]);
                    gemm_slices(a, b, &mut c[i * g.stride_c..], gm, par);
                }
            })
        });
        Ok(())
    }

    fn add(&self, a: &CpuBuf, b: &CpuBuf, out: &mut CpuBuf) -> Result<()> {
        check::add(self, [a, b, out])?;
        zip_rows(out, [a, b], 1, |_, o, [a, b]| {
            o.iter_mut()
                .zip(a.iter().zip(b.iter()))
                .for_each(|(o, (x, y))| *o = x + y)
        });
        Ok(())
    }

    fn axpy(&self, alpha: f32, src: &CpuBuf, dst: &mut CpuBuf) -> Result<()> {
        check::axpy(self, [src, dst])?;
        zip_rows(dst, [src], 1, |_, d, [s]| {
            d.iter_mut()
                .zip(s.iter())
                .for_each(|(d, &s)| *d += alpha * s)
        });
        Ok(())
    }

    fn scale(&self, buf: &mut CpuBuf, alpha: f32) -> Result<()> {
        zip_rows(buf, [], 1, |_, d, []| {
            d.iter_mut().for_each(|x| *x *= alpha)
        });
        Ok(())
    }

    fn activation_fwd(&self, act: Activation, x: &CpuBuf, out: &mut CpuBuf) -> Result<()> {
        check::activation_fwd(self, [x, out])?;
        zip_rows(out, [x], 1, |_, o, [x]| kernels::activation_fwd(act, x, o));
        Ok(())
    }

    fn activation_bwd(
        &self,
        act: Activation,
        x: &CpuBuf,
        dy: &CpuBuf,
        dx: &mut CpuBuf,
    ) -> Result<()> {
        check::activation_bwd(self, [x, dy, dx])?;
        zip_rows(dx, [x, dy], 1, |_, d, [x, dy]| {
            kernels::activation_bwd(act, x, dy, d)
        });
        Ok(())
    }

    fn mul(&self, a: &CpuBuf, b: &CpuBuf, out: &mut CpuBuf) -> Result<()> {
        check::mul(self, [a, b, out])?;
        zip_rows(out, [a, b], 1, |_, o, [a, b]| {
            o.iter_mut()
                .zip(a.iter().zip(b.iter()))
                .for_each(|(o, (x, y))| *o = x * y)
        });
        Ok(())
    }

    fn rope(
        &self,
        x: &CpuBuf,
        out: &mut CpuBuf,
        positions: &[u32],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
        inverse: bool,
    ) -> Result<()> {
        check::rope(
            self,
            [x, out],
            positions.len(),
            heads,
            head_dim,
            inv_freq.len(),
        )?;
        let width = x.len() / positions.len().max(1);
        zip_rows(out, [x], width, |row, o, [x]| {
            let rows = o.len() / width.max(1);
            let at = &positions[row..row + rows];
            kernels::rope(x, o, at, head_dim, inv_freq, inverse)
        });
        Ok(())
    }

    fn repeat_kv(
        &self,
        src: &CpuBuf,
        dst: &mut CpuBuf,
        rows: usize,
        kv_heads: usize,
        rep: usize,
        head_dim: usize,
    ) -> Result<()> {
        check::repeat_kv(self, "repeat_kv", [src, dst], rows, kv_heads, rep, head_dim)?;
        let s = src.read();
        dst.write(|d| kernels::repeat_kv(&s, d, kv_heads, rep, head_dim));
        Ok(())
    }

    fn repeat_kv_bwd(
        &self,
        src: &CpuBuf,
        dst: &mut CpuBuf,
        rows: usize,
        kv_heads: usize,
        rep: usize,
        head_dim: usize,
    ) -> Result<()> {
        check::repeat_kv(
            self,
            "repeat_kv_bwd",
            [src, dst],
            rows,
            kv_heads,
            rep,
            head_dim,
        )?;
        let s = src.read();
        dst.write(|d| kernels::repeat_kv_bwd(&s, d, kv_heads, rep, head_dim));
        Ok(())
    }

    fn softmax_rows(&self, x: &CpuBuf, out: &mut CpuBuf, rows: usize, cols: usize) -> Result<()> {
        check::softmax_rows(self, [x, out], rows, cols)?;
        let x = x.read();
        self.run(rows * cols, |par| {
            out.write(|o| kernels::softmax_rows(par, &x, o, cols))
        });
        Ok(())
    }

    fn rmsnorm_fwd(
        &self,
        x: &CpuBuf,
        weight: &CpuBuf,
        out: &mut CpuBuf,
        rstd: &mut CpuBuf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        check::rmsnorm_fwd(self, [x, weight, out, rstd], rows, dim)?;
        let w = weight.read();
        let block = block_len(&[x, &*out, &*rstd], rows * dim, dim) / dim.max(1);
        let xs = x.blocks(block * dim);
        let rs = rstd.blocks_mut(block);
        for ((x, o), r) in xs.into_iter().zip(out.blocks_mut(block * dim)).zip(rs) {
            let x = x.read();
            self.run(x.len(), |par| {
                o.write(|o| r.write(|r| kernels::rmsnorm_fwd(par, &x, &w, o, r, eps)))
            });
        }
        Ok(())
    }

    fn rmsnorm_bwd_input(
        &self,
        x: &CpuBuf,
        weight: &CpuBuf,
        rstd: &CpuBuf,
        dy: &CpuBuf,
        dx: &mut CpuBuf,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        check::rmsnorm_bwd_input(self, [x, weight, rstd, dy, dx], rows, dim)?;
        let w = weight.read();
        let block = block_len(&[x, rstd, dy, &*dx], rows * dim, dim) / dim.max(1);
        let (xs, rs) = (x.blocks(block * dim), rstd.blocks(block));
        let blocks = xs.into_iter().zip(rs).zip(dy.blocks(block * dim));
        for (((x, r), dy), d) in blocks.zip(dx.blocks_mut(block * dim)) {
            let (x, r, dy) = (x.read(), r.read(), dy.read());
            self.run(x.len(), |par| {
                d.write(|d| kernels::rmsnorm_bwd_input(par, &x, &w, &r, &dy, d))
            });
        }
        Ok(())
    }

    fn rmsnorm_bwd_weight(
        &self,
        x: &CpuBuf,
        rstd: &CpuBuf,
        dy: &CpuBuf,
        dweight: &mut CpuBuf,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        check::rmsnorm_bwd_weight(self, [x, rstd, dy, dweight], rows, dim)?;
        // Row by row into `dweight`, so blocks of rows sum in the same order.
        let block = block_len(&[x, rstd, dy], rows * dim, dim) / dim.max(1);
        let (xs, rs) = (x.blocks(block * dim), rstd.blocks(block));
        dweight.write(|d| {
            for ((x, r), dy) in xs.into_iter().zip(rs).zip(dy.blocks(block * dim)) {
                kernels::rmsnorm_bwd_weight(&x.read(), &r.read(), &dy.read(), d);
            }
        });
        Ok(())
    }

    fn attention_fwd(
        &self,
        q: &CpuBuf,
        k: &CpuBuf,
        v: &CpuBuf,
        out: &mut CpuBuf,
        probs: &mut CpuBuf,
        shape: AttnShape,
    ) -> Result<()> {
        check::attention_fwd(self, [q, k, v, out, probs], shape)?;
        let (rows, pair) = attention_blocks(&shape);
        let qkv = [q, k, v].map(|b| b.blocks(rows));
        let (out, p) = (out.blocks_mut(rows), probs.blocks_mut(pair));
        self.run(shape.probs_len() * shape.head_dim, |par| {
            kernels::attention_fwd(par, qkv, out, p, shape)
        });
        Ok(())
    }

    fn attention_bwd(
        &self,
        q: &CpuBuf,
        k: &CpuBuf,
        v: &CpuBuf,
        probs: &CpuBuf,
        d_out: &CpuBuf,
        dq: &mut CpuBuf,
        dk: &mut CpuBuf,
        dv: &mut CpuBuf,
        shape: AttnShape,
    ) -> Result<()> {
        check::attention_bwd(self, [q, k, v, probs, d_out, dq, dk, dv], shape)?;
        let (rows, pair) = attention_blocks(&shape);
        let qkv = [q, k, v].map(|b| b.blocks(rows));
        let (p, d) = (probs.blocks(pair), d_out.blocks(rows));
        let grads = [dq, dk, dv].map(|b| b.blocks_mut(rows));
        self.run(shape.probs_len() * shape.head_dim, |par| {
            kernels::attention_bwd(par, qkv, p, d, grads, shape)
        });
        Ok(())
    }

    fn embedding_fwd(
        &self,
        table: &CpuBuf,
        ids: &[u32],
        out: &mut CpuBuf,
        dim: usize,
    ) -> Result<()> {
        check::embedding_fwd(self, [table, out], ids, dim)?;
        out.write(|o| {
            for (row, &id) in o.chunks_mut(dim.max(1)).zip(ids) {
                let at = id as usize * dim;
                row.copy_from_slice(&table.read_range(at..at + dim));
            }
        });
        Ok(())
    }

    fn embedding_bwd(
        &self,
        ids: &[u32],
        dy: &CpuBuf,
        dtable: &mut CpuBuf,
        dim: usize,
    ) -> Result<()> {
        check::embedding_bwd(self, ids, [dy, dtable], dim)?;
        let dy = dy.read();
        dtable.write(|t| {
            for (row, &id) in dy.chunks(dim.max(1)).zip(ids) {
                let dst = &mut t[id as usize * dim..][..dim];
                dst.iter_mut().zip(row).for_each(|(d, &g)| *d += g);
            }
        });
        Ok(())
    }

    fn add_broadcast_rows(
        &self,
        row: &CpuBuf,
        dst: &mut CpuBuf,
        batch: usize,
        row_len: usize,
    ) -> Result<()> {
        check::add_broadcast_rows(self, [row, dst], batch, row_len)?;
        let r = row.read();
        let r = &r[..row_len];
        zip_rows(dst, [], row_len, |_, d, []| {
            for chunk in d.chunks_mut(row_len.max(1)) {
                chunk.iter_mut().zip(r).for_each(|(d, &s)| *d += s);
            }
        });
        Ok(())
    }

    fn sum_rows(&self, src: &CpuBuf, out: &mut CpuBuf, batch: usize, row_len: usize) -> Result<()> {
        check::sum_rows(self, [src, out], batch, row_len)?;
        // Row by row into `out`, so blocks of rows sum in the same order.
        let block = block_len(&[src], batch * row_len, row_len);
        out.write(|o| {
            for s in src.blocks(block) {
                for chunk in s.read().chunks(row_len.max(1)) {
                    o[..row_len]
                        .iter_mut()
                        .zip(chunk)
                        .for_each(|(o, &s)| *o += s);
                }
            }
        });
        Ok(())
    }

    fn cross_entropy_fwd(
        &self,
        logits: &CpuBuf,
        targets: &[u32],
        probs: &mut CpuBuf,
        vocab: usize,
    ) -> Result<(f32, usize)> {
        check::cross_entropy_fwd(self, [logits, probs], targets, vocab)?;
        let l = logits.read();
        Ok(self.run(targets.len() * vocab, |par| {
            probs.write(|p| kernels::cross_entropy_fwd(par, &l, targets, p, vocab))
        }))
    }

    fn cross_entropy_grad(
        &self,
        logits: &mut CpuBuf,
        targets: &[u32],
        vocab: usize,
        scale: f32,
    ) -> Result<(f32, usize)> {
        check::cross_entropy_grad(self, logits, targets, vocab)?;
        Ok(self.run(targets.len() * vocab, |par| {
            logits.write(|l| kernels::cross_entropy_grad(par, l, targets, vocab, scale))
        }))
    }

    fn cross_entropy_bwd(
        &self,
        probs: &CpuBuf,
        targets: &[u32],
        dlogits: &mut CpuBuf,
        vocab: usize,
        scale: f32,
    ) -> Result<()> {
        check::cross_entropy_bwd(self, [probs, dlogits], targets, vocab)?;
        let p = probs.read();
        dlogits.write(|d| kernels::cross_entropy_bwd(&p, targets, d, vocab, scale));
        Ok(())
    }

    fn sum_squares(&self, x: &CpuBuf) -> Result<f64> {
        let x = x.read();
        Ok(self.run(x.len(), |par| kernels::sum_squares(par, &x)))
    }

    fn adamw_step(
        &self,
        param: &mut CpuBuf,
        master: Option<&mut CpuBuf>,
        grad: &CpuBuf,
        m: &mut CpuBuf,
        v: &mut CpuBuf,
        hp: AdamWStep,
    ) -> Result<()> {
        check::adamw_step(self, [param, grad, m, v], master.as_deref())?;
        let g = grad.read();
        let mut step = |p: &mut CpuBuf| {
            self.run(g.len(), |par| {
                p.write(|p| m.write(|m| v.write(|v| kernels::adamw(par, p, &g, m, v, &hp))))
            })
        };
        match master {
            Some(master) => {
                step(master);
                self.copy(master, param)?;
            }
            None => step(param),
        }
        Ok(())
    }
}

/// The blocks attention's kernels take their operands in: a sequence's rows of `q`, `k`,
/// `v`, the output and their gradients (`[seq, d]`), and a (sequence, head) pair's
/// probabilities (`[seq, seq]`).
fn attention_blocks(s: &AttnShape) -> (usize, usize) {
    (s.seq * s.heads * s.head_dim, s.seq * s.seq)
}
