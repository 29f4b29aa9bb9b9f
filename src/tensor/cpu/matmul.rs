//! Products with a bf16 operand, a block of rows at a time: a bf16 activation or output
//! costs the `f32` copy of a block, not of its whole buffer (the widening the CPU backend
//! does to compute in `f32`). Where every operand is `f32` the backend's `matmul` takes
//! its whole-buffer path instead.

use gemm::Parallelism;

use super::buf::{gemm_slices, product_block_rows};
use super::{CpuBackend, CpuBuf};
use crate::tensor::Gemm;

impl CpuBackend {
    /// `c = a·b` as `g` says, `a` or `c` bf16, block by block; `b` (a weight, or a gradient
    /// already `f32`) is read whole. False, having done nothing, where the product has no
    /// blocked form here (`aᵀ·b` into a bf16 `c`, or with `b` transposed): the caller then
    /// widens whole buffers.
    pub(super) fn matmul_blocks(
        &self,
        a: &CpuBuf,
        b: &CpuBuf,
        c: &mut CpuBuf,
        g: Gemm,
        par: Parallelism,
    ) -> bool {
        if !g.trans_a {
            // Rows of `a` and `c`: each row of `c` is computed as in one product.
            let rows = product_block_rows(g.k.max(g.n));
            let b = b.read();
            for (a, c) in a
                .blocks(rows * g.k)
                .into_iter()
                .zip(c.blocks_mut(rows * g.n))
            {
                let a = a.read();
                let gb = Gemm {
                    m: a.len() / g.k,
                    ..g
                };
                let work = gb.m * g.k * g.n;
                self.product(work, work, || c.write(|c| gemm_slices(&a, &b, c, gb, par)));
            }
            return true;
        }
        if !c.is_bf16() && !g.trans_b {
            // `aᵀ·b` over tokens (a weight gradient into f32 `c`): blocks of the
            // reduction's rows, accumulated into `c` in order.
            let rows = product_block_rows(g.m.max(g.n));
            let blocks = a.blocks(rows * g.m).into_iter().zip(b.blocks(rows * g.n));
            c.write(|c| {
                for (i, (a, b)) in blocks.enumerate() {
                    let (a, b) = (a.read(), b.read());
                    let k = a.len() / g.m;
                    let gb = Gemm {
                        k,
                        accumulate: g.accumulate || i > 0,
                        ..g
                    };
                    let work = g.m * k * g.n;
                    self.product(work, work, || gemm_slices(&a, &b, c, gb, par));
                }
            });
            return true;
        }
        false
    }
}
