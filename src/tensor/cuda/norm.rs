//! RMSNorm on the GPU, forward and the two halves of its backward. [`super::backend`]
//! forwards the corresponding [`crate::tensor::Backend`] methods here (same checks and
//! semantics as the CPU backend).

use super::kernels::{self, K};
use super::{CudaBackend, CudaBuf, grid_rows};
use crate::tensor::{Result, check};

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_fwd(
        &self,
        x: &CudaBuf,
        weight: &CudaBuf,
        out: &mut CudaBuf,
        rstd: &mut CudaBuf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_fwd";
        check::rmsnorm_fwd(self, [x, weight, out, rstd], rows, dim)?;
        if rows == 0 {
            return Ok(());
        }
        let cfg = kernels::per_row(grid_rows(OP, rows)?, dim);
        let dim64 = dim as u64;
        let (x, w) = (self.read(OP, x)?, self.read(OP, weight)?);
        self.write(OP, out, |o| {
            self.write(OP, rstd, |r| {
                launch!(
                    self,
                    OP,
                    K::RmsnormFwd,
                    cfg,
                    [&*x, &*w, &mut *o, r, &dim64, &eps]
                )
            })
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_bwd_input(
        &self,
        x: &CudaBuf,
        weight: &CudaBuf,
        rstd: &CudaBuf,
        dy: &CudaBuf,
        dx: &mut CudaBuf,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_bwd_input";
        check::rmsnorm_bwd_input(self, [x, weight, rstd, dy, dx], rows, dim)?;
        if rows == 0 || dim == 0 {
            return Ok(());
        }
        let cfg = kernels::per_row(grid_rows(OP, rows)?, dim);
        let dim64 = dim as u64;
        let (x, w, r, dy) = (
            self.read(OP, x)?,
            self.read(OP, weight)?,
            self.read(OP, rstd)?,
            self.read(OP, dy)?,
        );
        self.write(OP, dx, |d| {
            launch!(
                self,
                OP,
                K::RmsnormBwdInput,
                cfg,
                [&*x, &*w, &*r, &*dy, d, &dim64]
            )
        })
    }

    pub(super) fn norm_bwd_weight(
        &self,
        x: &CudaBuf,
        rstd: &CudaBuf,
        dy: &CudaBuf,
        dweight: &mut CudaBuf,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_bwd_weight";
        check::rmsnorm_bwd_weight(self, [x, rstd, dy, dweight], rows, dim)?;
        if rows == 0 || dim == 0 {
            return Ok(());
        }
        let cfg = kernels::per_column_group(dim);
        let (rows64, dim64) = (rows as u64, dim as u64);
        let (x, r, dy) = (self.read(OP, x)?, self.read(OP, rstd)?, self.read(OP, dy)?);
        self.write(OP, dweight, |d| {
            launch!(
                self,
                OP,
                K::RmsnormBwdWeight,
                cfg,
                [&*x, &*r, &*dy, d, &rows64, &dim64]
            )
        })
    }
}
