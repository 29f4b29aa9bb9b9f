//! [`Backend`] for [`CudaBackend`]: the same operand checks (`crate::tensor::check`) and
//! semantics as the CPU backend (`src/tensor/cpu/`, the reference), each operation one kernel launch or cuBLAS call on the
//! backend's stream. Results come back to the host only where the trait returns a value.

use half::bf16;

use super::blas::dense;
use super::kernels::{self, K};
use super::{CudaBackend, CudaBuf, Storage, dev, grid_rows};
use crate::tensor::bytes::{from_le, to_le};
use crate::tensor::{
    Activation, AdamWStep, AttnShape, Backend, BatchedGemm, DType, Gemm, Result, check,
};

impl Backend for CudaBackend {
    type Buf = CudaBuf;

    fn name(&self) -> String {
        format!("cuda:{} ({})", self.inner.ordinal, self.inner.device_name)
    }

    fn storage_dtype(&self) -> DType {
        self.storage
    }

    /// The same device and stream (one backend and its clones): a buffer written on another
    /// stream could still be in flight when this one reads it.
    fn shares_buffers_with(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.inner, &other.inner) && self.storage == other.storage
    }

    fn zeros(&self, len: usize, dtype: DType) -> Result<CudaBuf> {
        Ok(CudaBuf(match dtype {
            DType::F32 => Storage::F32(self.zeros_slice("zeros", len)?),
            // bf16 zero is the all-zero bit pattern.
            DType::Bf16 => Storage::Bf16(self.zeros_slice("zeros", len)?),
        }))
    }

    fn from_host(&self, data: &[f32], dtype: DType) -> Result<CudaBuf> {
        const OP: &str = "from_host";
        let s = self.stream();
        Ok(CudaBuf(match dtype {
            DType::F32 if data.is_empty() => Storage::F32(s.null().map_err(dev(OP))?),
            DType::F32 => Storage::F32(s.clone_htod(data).map_err(dev(OP))?),
            DType::Bf16 if data.is_empty() => Storage::Bf16(s.null().map_err(dev(OP))?),
            DType::Bf16 => {
                let bits: Vec<u16> = data.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
                Storage::Bf16(s.clone_htod(&bits).map_err(dev(OP))?)
            }
        }))
    }

    fn to_host(&self, buf: &CudaBuf) -> Result<Vec<f32>> {
        Ok(match &buf.0 {
            Storage::F32(s) => self.download("to_host", s)?,
            Storage::Bf16(s) => self
                .download("to_host", s)?
                .into_iter()
                .map(|b| bf16::from_bits(b).to_f32())
                .collect(),
        })
    }

    /// One device-to-host copy of the stored values (bf16 as its 2-byte bits, never widened).
    fn to_host_bytes(&self, buf: &CudaBuf) -> Result<Vec<u8>> {
        const OP: &str = "to_host_bytes";
        Ok(match &buf.0 {
            Storage::F32(s) => to_le(&self.download(OP, s)?, |x| x.to_le_bytes()),
            Storage::Bf16(s) => to_le(&self.download(OP, s)?, |x| x.to_le_bytes()),
        })
    }

    /// The bytes' values in their own width, then one host-to-device copy.
    fn from_host_bytes(&self, bytes: &[u8], dtype: DType) -> Result<CudaBuf> {
        const OP: &str = "from_host_bytes";
        Ok(CudaBuf(match dtype {
            DType::F32 => {
                Storage::F32(self.upload(OP, &from_le(OP, bytes, dtype, f32::from_le_bytes)?)?)
            }
            DType::Bf16 => {
                Storage::Bf16(self.upload(OP, &from_le(OP, bytes, dtype, u16::from_le_bytes)?)?)
            }
        }))
    }

    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len()
    }

    fn dtype(&self, buf: &CudaBuf) -> DType {
        match buf.0 {
            Storage::F32(_) => DType::F32,
            Storage::Bf16(_) => DType::Bf16,
        }
    }

    fn copy(&self, src: &CudaBuf, dst: &mut CudaBuf) -> Result<()> {
        const OP: &str = "copy";
        check::copy(self, [src, dst])?;
        let Some((n64, cfg)) = Self::elementwise_len(src.len()) else {
            return Ok(());
        };
        let s = self.stream();
        match (&src.0, &mut dst.0) {
            (Storage::F32(a), Storage::F32(b)) => s.memcpy_dtod(a, b).map_err(dev(OP)),
            (Storage::Bf16(a), Storage::Bf16(b)) => s.memcpy_dtod(a, b).map_err(dev(OP)),
            (Storage::F32(a), Storage::Bf16(b)) => {
                launch!(self, OP, K::F32ToBf16, cfg, [a, b, &n64])
            }
            (Storage::Bf16(a), Storage::F32(b)) => {
                launch!(self, OP, K::Bf16ToF32, cfg, [a, b, &n64])
            }
        }
    }

    fn copy_range(
        &self,
        src: &CudaBuf,
        src_at: usize,
        dst: &mut CudaBuf,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        self.range_copy(src, src_at, dst, dst_at, len)
    }

    fn fill(&self, buf: &mut CudaBuf, value: f32) -> Result<()> {
        const OP: &str = "fill";
        let Some((n64, cfg)) = Self::elementwise_len(buf.len()) else {
            return Ok(());
        };
        match &mut buf.0 {
            Storage::F32(d) => launch!(self, OP, K::FillF32, cfg, [d, &value, &n64]),
            Storage::Bf16(d) => {
                let bits = bf16::from_f32(value).to_bits();
                launch!(self, OP, K::FillU16, cfg, [d, &bits, &n64])
            }
        }
    }

    fn matmul(&self, a: &CudaBuf, b: &CudaBuf, c: &mut CudaBuf, g: Gemm) -> Result<()> {
        const OP: &str = "matmul";
        check::matmul(self, [a, b, c], g)?;
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        if g.k == 0 {
            // An empty sum: C = 0, or unchanged when accumulating.
            return if g.accumulate {
                Ok(())
            } else {
                self.fill(c, 0.0)
            };
        }
        let (a, b) = (self.read(OP, a)?, self.read(OP, b)?);
        self.write(OP, c, |c| self.sgemm(OP, dense(g), None, &*a, &*b, c))
    }

    fn matmul_batched(
        &self,
        a: &CudaBuf,
        b: &CudaBuf,
        c: &mut CudaBuf,
        g: BatchedGemm,
    ) -> Result<()> {
        self.batched_products(a, b, c, g)
    }

    fn add(&self, a: &CudaBuf, b: &CudaBuf, out: &mut CudaBuf) -> Result<()> {
        const OP: &str = "add";
        check::add(self, [a, b, out])?;
        let Some((n64, cfg)) = Self::elementwise_len(a.len()) else {
            return Ok(());
        };
        let (a, b) = (self.read(OP, a)?, self.read(OP, b)?);
        self.write(OP, out, |o| {
            launch!(self, OP, K::AddF32, cfg, [&*a, &*b, o, &n64])
        })
    }

    fn axpy(&self, alpha: f32, src: &CudaBuf, dst: &mut CudaBuf) -> Result<()> {
        const OP: &str = "axpy";
        check::axpy(self, [src, dst])?;
        let Some((n64, cfg)) = Self::elementwise_len(src.len()) else {
            return Ok(());
        };
        let s = self.read(OP, src)?;
        self.write(OP, dst, |d| {
            launch!(self, OP, K::AxpyF32, cfg, [&alpha, &*s, d, &n64])
        })
    }

    fn scale(&self, buf: &mut CudaBuf, alpha: f32) -> Result<()> {
        const OP: &str = "scale";
        let Some((n64, cfg)) = Self::elementwise_len(buf.len()) else {
            return Ok(());
        };
        self.write(OP, buf, |d| {
            launch!(self, OP, K::ScaleF32, cfg, [d, &alpha, &n64])
        })
    }

    fn activation_fwd(&self, act: Activation, x: &CudaBuf, out: &mut CudaBuf) -> Result<()> {
        const OP: &str = "activation_fwd";
        check::activation_fwd(self, [x, out])?;
        let Some((n64, cfg)) = Self::elementwise_len(x.len()) else {
            return Ok(());
        };
        let kind = activation_kind(act);
        let x = self.read(OP, x)?;
        self.write(OP, out, |o| {
            launch!(self, OP, K::ActivationFwd, cfg, [&*x, o, &n64, &kind])
        })
    }

    fn activation_bwd(
        &self,
        act: Activation,
        x: &CudaBuf,
        dy: &CudaBuf,
        dx: &mut CudaBuf,
    ) -> Result<()> {
        const OP: &str = "activation_bwd";
        check::activation_bwd(self, [x, dy, dx])?;
        let Some((n64, cfg)) = Self::elementwise_len(x.len()) else {
            return Ok(());
        };
        let kind = activation_kind(act);
        let (x, dy) = (self.read(OP, x)?, self.read(OP, dy)?);
        self.write(OP, dx, |d| {
            launch!(self, OP, K::ActivationBwd, cfg, [&*x, &*dy, d, &n64, &kind])
        })
    }

    fn mul(&self, a: &CudaBuf, b: &CudaBuf, out: &mut CudaBuf) -> Result<()> {
        const OP: &str = "mul";
        check::mul(self, [a, b, out])?;
        let Some((n64, cfg)) = Self::elementwise_len(a.len()) else {
            return Ok(());
        };
        let (a, b) = (self.read(OP, a)?, self.read(OP, b)?);
        self.write(OP, out, |o| {
            launch!(self, OP, K::MulF32, cfg, [&*a, &*b, o, &n64])
        })
    }

    fn rope(
        &self,
        x: &CudaBuf,
        out: &mut CudaBuf,
        positions: &[u32],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
        inverse: bool,
    ) -> Result<()> {
        const OP: &str = "rope";
        check::rope(
            self,
            [x, out],
            positions.len(),
            heads,
            head_dim,
            inv_freq.len(),
        )?;
        let half = head_dim / 2;
        let Some((n64, cfg)) = Self::elementwise_len(positions.len() * heads * half) else {
            return Ok(());
        };
        let (heads64, half64) = (heads as u64, half as u64);
        let sign: f32 = if inverse { -1.0 } else { 1.0 };
        let x = self.read(OP, x)?;
        let (pos, freq) = (self.upload(OP, positions)?, self.upload(OP, inv_freq)?);
        self.write(OP, out, |o| {
            launch!(
                self,
                OP,
                K::RopeF32,
                cfg,
                [&*x, o, &pos, &freq, &heads64, &half64, &sign, &n64]
            )
        })
    }

    fn repeat_kv(
        &self,
        src: &CudaBuf,
        dst: &mut CudaBuf,
        rows: usize,
        kv_heads: usize,
        rep: usize,
        head_dim: usize,
    ) -> Result<()> {
        const OP: &str = "repeat_kv";
        check::repeat_kv(self, OP, [src, dst], rows, kv_heads, rep, head_dim)?;
        let Some((n64, cfg)) = Self::elementwise_len(rows * kv_heads * rep * head_dim) else {
            return Ok(());
        };
        let (kv64, rep64, dim64) = (kv_heads as u64, rep as u64, head_dim as u64);
        let src = self.read(OP, src)?;
        self.write(OP, dst, |d| {
            launch!(
                self,
                OP,
                K::RepeatKvF32,
                cfg,
                [&*src, d, &kv64, &rep64, &dim64, &n64]
            )
        })
    }

    fn repeat_kv_bwd(
        &self,
        src: &CudaBuf,
        dst: &mut CudaBuf,
        rows: usize,
        kv_heads: usize,
        rep: usize,
        head_dim: usize,
    ) -> Result<()> {
        const OP: &str = "repeat_kv_bwd";
        check::repeat_kv(self, OP, [src, dst], rows, kv_heads, rep, head_dim)?;
        let Some((n64, cfg)) = Self::elementwise_len(rows * kv_heads * head_dim) else {
            return Ok(());
        };
        let (kv64, rep64, dim64) = (kv_heads as u64, rep as u64, head_dim as u64);
        let src = self.read(OP, src)?;
        self.write(OP, dst, |d| {
            launch!(
                self,
                OP,
                K::RepeatKvBwdF32,
                cfg,
                [&*src, d, &kv64, &rep64, &dim64, &n64]
            )
        })
    }

    fn softmax_rows(&self, x: &CudaBuf, out: &mut CudaBuf, rows: usize, cols: usize) -> Result<()> {
        const OP: &str = "softmax_rows";
        check::softmax_rows(self, [x, out], rows, cols)?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let cfg = kernels::per_row(grid_rows(OP, rows)?, cols);
        let cols64 = cols as u64;
        let x = self.read(OP, x)?;
        self.write(OP, out, |o| {
            launch!(self, OP, K::SoftmaxRows, cfg, [&*x, o, &cols64])
        })
    }

    fn rmsnorm_fwd(
        &self,
        x: &CudaBuf,
        weight: &CudaBuf,
        out: &mut CudaBuf,
        rstd: &mut CudaBuf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        self.norm_fwd(x, weight, out, rstd, rows, dim, eps)
    }

    fn rmsnorm_bwd_input(
        &self,
        x: &CudaBuf,
        weight: &CudaBuf,
        rstd: &CudaBuf,
        dy: &CudaBuf,
        dx: &mut CudaBuf,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        self.norm_bwd_input(x, weight, rstd, dy, dx, rows, dim)
    }

    fn rmsnorm_bwd_weight(
        &self,
        x: &CudaBuf,
        rstd: &CudaBuf,
        dy: &CudaBuf,
        dweight: &mut CudaBuf,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        self.norm_bwd_weight(x, rstd, dy, dweight, rows, dim)
    }

    fn attention_fwd(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        out: &mut CudaBuf,
        probs: &mut CudaBuf,
        shape: AttnShape,
    ) -> Result<()> {
        const OP: &str = "attention_fwd";
        check::attention_fwd(self, [q, k, v, out, probs], shape)?;
        let (q, k, v) = (self.read(OP, q)?, self.read(OP, k)?, self.read(OP, v)?);
        self.write(OP, out, |o| {
            self.write(OP, probs, |p| {
                self.attention_fwd_f32(&q, &k, &v, o, p, shape)
            })
        })
    }

    fn attention_bwd(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        probs: &CudaBuf,
        d_out: &CudaBuf,
        dq: &mut CudaBuf,
        dk: &mut CudaBuf,
        dv: &mut CudaBuf,
        shape: AttnShape,
    ) -> Result<()> {
        const OP: &str = "attention_bwd";
        check::attention_bwd(self, [q, k, v, probs, d_out, dq, dk, dv], shape)?;
        let (q, k, v) = (self.read(OP, q)?, self.read(OP, k)?, self.read(OP, v)?);
        let (p, d) = (self.read(OP, probs)?, self.read(OP, d_out)?);
        self.write(OP, dq, |gq| {
            self.write(OP, dk, |gk| {
                self.write(OP, dv, |gv| {
                    self.attention_bwd_f32(&q, &k, &v, &p, &d, gq, gk, gv, shape)
                })
            })
        })
    }

    fn embedding_fwd(
        &self,
        table: &CudaBuf,
        ids: &[u32],
        out: &mut CudaBuf,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_fwd";
        check::embedding_fwd(self, [table, out], ids, dim)?;
        let Some((n64, cfg)) = Self::elementwise_len(ids.len() * dim) else {
            return Ok(());
        };
        let dim64 = dim as u64;
        let (t, ids) = (self.read(OP, table)?, self.upload(OP, ids)?);
        self.write(OP, out, |o| {
            launch!(self, OP, K::EmbeddingFwd, cfg, [&*t, &ids, o, &dim64, &n64])
        })
    }

    fn embedding_bwd(
        &self,
        ids: &[u32],
        dy: &CudaBuf,
        dtable: &mut CudaBuf,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_bwd";
        check::embedding_bwd(self, ids, [dy, dtable], dim)?;
        let Some((n64, cfg)) = Self::elementwise_len(ids.len() * dim) else {
            return Ok(());
        };
        let dim64 = dim as u64;
        let (dy, ids) = (self.read(OP, dy)?, self.upload(OP, ids)?);
        self.write(OP, dtable, |t| {
            launch!(
                self,
                OP,
                K::EmbeddingBwd,
                cfg,
                [&ids, &*dy, t, &dim64, &n64]
            )
        })
    }

    fn add_broadcast_rows(
        &self,
        row: &CudaBuf,
        dst: &mut CudaBuf,
        batch: usize,
        row_len: usize,
    ) -> Result<()> {
        const OP: &str = "add_broadcast_rows";
        check::add_broadcast_rows(self, [row, dst], batch, row_len)?;
        let Some((n64, cfg)) = Self::elementwise_len(batch * row_len) else {
            return Ok(());
        };
        let width64 = row_len as u64;
        let r = self.read(OP, row)?;
        self.write(OP, dst, |d| {
            launch!(self, OP, K::AddBroadcastRows, cfg, [&*r, d, &width64, &n64])
        })
    }

    fn sum_rows(
        &self,
        src: &CudaBuf,
        out: &mut CudaBuf,
        batch: usize,
        row_len: usize,
    ) -> Result<()> {
        const OP: &str = "sum_rows";
        check::sum_rows(self, [src, out], batch, row_len)?;
        if batch == 0 || row_len == 0 {
            return Ok(());
        }
        let cfg = kernels::per_column_group(row_len);
        let (batch64, width64) = (batch as u64, row_len as u64);
        let s = self.read(OP, src)?;
        self.write(OP, out, |o| {
            launch!(self, OP, K::SumRows, cfg, [&*s, o, &batch64, &width64])
        })
    }

    fn cross_entropy_fwd(
        &self,
        logits: &CudaBuf,
        targets: &[u32],
        probs: &mut CudaBuf,
        vocab: usize,
    ) -> Result<(f32, usize)> {
        self.loss_fwd(logits, targets, probs, vocab)
    }

    fn cross_entropy_grad(
        &self,
        logits: &mut CudaBuf,
        targets: &[u32],
        vocab: usize,
        scale: f32,
    ) -> Result<(f32, usize)> {
        self.loss_grad(logits, targets, vocab, scale)
    }

    fn cross_entropy_bwd(
        &self,
        probs: &CudaBuf,
        targets: &[u32],
        dlogits: &mut CudaBuf,
        vocab: usize,
        scale: f32,
    ) -> Result<()> {
        self.loss_bwd(probs, targets, dlogits, vocab, scale)
    }

    fn sum_squares(&self, x: &CudaBuf) -> Result<f64> {
        self.squared_norm(x)
    }

    fn adamw_step(
        &self,
        param: &mut CudaBuf,
        master: Option<&mut CudaBuf>,
        grad: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        hp: AdamWStep,
    ) -> Result<()> {
        self.adamw_update(param, master, grad, m, v, hp)
    }
}

/// The `kind` argument of the activation kernels.
fn activation_kind(act: Activation) -> i32 {
    match act {
        Activation::Gelu => 0,
        Activation::Silu | Activation::Swiglu => 1,
    }
}
