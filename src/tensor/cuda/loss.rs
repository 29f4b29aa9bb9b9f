//! Loss, reductions and the optimizer on the GPU: cross-entropy forward/backward, the sum of
//! squares behind the global gradient norm, and AdamW. [`super::backend`] forwards the
//! corresponding [`crate::tensor::Backend`] methods here (same checks and semantics as the
//! CPU backend).

use cudarc::driver::CudaSlice;

use super::kernels::{self, K};
use super::{CudaBackend, CudaBuf, Storage, dev, grid_rows};
use crate::tensor::{AdamWStep, Backend, Result, check};

impl CudaBackend {
    pub(super) fn loss_fwd(
        &self,
        logits: &CudaBuf,
        targets: &[u32],
        probs: &mut CudaBuf,
        vocab: usize,
    ) -> Result<(f32, usize)> {
        const OP: &str = "cross_entropy_fwd";
        let rows = targets.len();
        check::cross_entropy_fwd(self, [logits, probs], targets, vocab)?;
        let counted = targets
            .iter()
            .filter(|&&t| t != crate::tensor::IGNORE_TARGET)
            .count();
        if rows == 0 || vocab == 0 {
            return Ok((0.0, counted));
        }
        let cfg = kernels::per_row(grid_rows(OP, rows)?, vocab);
        let vocab64 = vocab as u64;
        let (l, t) = (self.read(OP, logits)?, self.upload(OP, targets)?);
        let mut loss = self.alloc_f32(OP, rows)?;
        self.write(OP, probs, |p| {
            launch!(
                self,
                OP,
                K::CrossEntropyFwd,
                cfg,
                [&*l, &t, p, &mut loss, &vocab64]
            )
        })?;
        // Ignored rows hold 0; sum in f64 like the CPU backend.
        let total: f64 = self
            .download(OP, &loss)?
            .iter()
            .map(|&x| f64::from(x))
            .sum();
        Ok((total as f32, counted))
    }

    pub(super) fn loss_bwd(
        &self,
        probs: &CudaBuf,
        targets: &[u32],
        dlogits: &mut CudaBuf,
        vocab: usize,
        scale: f32,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_bwd";
        check::cross_entropy_bwd(self, [probs, dlogits], targets, vocab)?;
        let Some((n64, cfg)) = Self::elementwise_len(targets.len() * vocab) else {
            return Ok(());
        };
        let vocab64 = vocab as u64;
        let (p, t) = (self.read(OP, probs)?, self.upload(OP, targets)?);
        self.write(OP, dlogits, |d| {
            launch!(
                self,
                OP,
                K::CrossEntropyBwd,
                cfg,
                [&*p, &t, d, &vocab64, &scale, &n64]
            )
        })
    }

    /// The fused loss and gradient, composed of the forward and backward kernels above
    /// (a temporary of the chunk's size holds the probabilities): the fused LM head's chunk
    /// stays chunk-sized on the GPU too.
    pub(super) fn loss_grad(
        &self,
        logits: &mut CudaBuf,
        targets: &[u32],
        vocab: usize,
        scale: f32,
    ) -> Result<(f32, usize)> {
        check::cross_entropy_grad(self, logits, targets, vocab)?;
        let mut probs = self.zeros(logits.len(), crate::tensor::DType::F32)?;
        let loss = self.loss_fwd(logits, targets, &mut probs, vocab)?;
        self.loss_bwd(&probs, targets, logits, vocab, scale)?;
        Ok(loss)
    }

    /// [`Backend::copy_range`]: one device-to-device copy.
    pub(super) fn range_copy(
        &self,
        src: &CudaBuf,
        src_at: usize,
        dst: &mut CudaBuf,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        const OP: &str = "copy_range";
        check::copy_range(self, [src, dst], src_at, dst_at, len)?;
        if len == 0 {
            return Ok(());
        }
        let (from, to) = (src_at..src_at + len, dst_at..dst_at + len);
        let s = self.stream();
        match (&src.0, &mut dst.0) {
            (Storage::F32(a), Storage::F32(b)) => {
                s.memcpy_dtod(&a.slice(from), &mut b.slice_mut(to))
            }
            (Storage::Bf16(a), Storage::Bf16(b)) => {
                s.memcpy_dtod(&a.slice(from), &mut b.slice_mut(to))
            }
            _ => unreachable!("check::copy_range refuses two storage types"),
        }
        .map_err(dev(OP))
    }

    pub(super) fn squared_norm(&self, x: &CudaBuf) -> Result<f64> {
        const OP: &str = "sum_squares";
        let n = x.len();
        if n == 0 {
            return Ok(0.0);
        }
        let blocks = kernels::sum_squares_blocks(n);
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            ..kernels::elementwise(n)
        };
        let n64 = n as u64;
        let x = self.read(OP, x)?;
        let mut partial: CudaSlice<f64> = self.zeros_slice(OP, blocks)?;
        launch!(
            self,
            OP,
            K::SumSquaresPartial,
            cfg,
            [&*x, &mut partial, &n64]
        )?;
        Ok(self.download(OP, &partial)?.iter().sum())
    }

    pub(super) fn adamw_update(
        &self,
        param: &mut CudaBuf,
        master: Option<&mut CudaBuf>,
        grad: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        hp: AdamWStep,
    ) -> Result<()> {
        const OP: &str = "adamw_step";
        let n = param.len();
        check::adamw_step(self, [param, grad, m, v], master.as_deref())?;
        let Some((n64, cfg)) = Self::elementwise_len(n) else {
            return Ok(());
        };
        // Bias corrections as the CPU computes them (f32 powi of the clamped step).
        let t = hp.step.max(1) as i32;
        let (bc1, bc2) = (1.0 - hp.beta1.powi(t), 1.0 - hp.beta2.powi(t));
        let g = self.read(OP, grad)?;
        let update = |p: &mut CudaSlice<f32>| {
            self.write(OP, m, |m| {
                self.write(OP, v, |v| {
                    launch!(
                        self,
                        OP,
                        K::AdamwF32,
                        cfg,
                        [
                            p,
                            &*g,
                            m,
                            v,
                            &n64,
                            &hp.lr,
                            &hp.beta1,
                            &hp.beta2,
                            &hp.eps,
                            &hp.weight_decay,
                            &bc1,
                            &bc2,
                            &hp.grad_scale,
                        ]
                    )
                })
            })
        };
        match master {
            Some(master) => {
                self.write(OP, master, update)?;
                self.copy(master, param)
            }
            None => self.write(OP, param, update),
        }
    }
}
