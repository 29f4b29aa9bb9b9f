//! The CPU backend: `f32` arithmetic, matrix products by MKL where it is found (`blas.rs`)
//! and by the `gemm` and `faer` crates otherwise, optional `bf16` storage.
//!
//! Threading is explicit because the runtime's virtual clock times each action by the CPU
//! time of the thread that ran it: [`CpuBackend::new`]`(1)` computes on the caller's thread
//! only (gemm `Parallelism::None`, MKL on one thread, serial kernels); `new(n > 1)` owns a
//! rayon pool of `n` threads and runs every operation inside it (`pool.install` +
//! `Parallelism::Rayon`), so it never competes with the global rayon pool, except MKL's
//! products, which MKL splits over `n` threads of its own from the caller's.

mod backend;
mod blas;
mod buf;
pub(crate) mod kernels;
mod malloc;
mod matmul;
#[cfg(test)]
mod tests;
mod upper;

use std::sync::Arc;

use gemm::Parallelism;

pub use buf::CpuBuf;
pub(crate) use buf::product_block_rows;

use super::{DType, Result};
use crate::tensor::TensorError;

/// Whether the products run on MKL in this process (`PIPEFILL_BLAS`, see `blas.rs`).
pub fn uses_mkl() -> bool {
    matches!(blas::get(), Ok(Some(_)))
}

/// Why the library `PIPEFILL_BLAS` names cannot be used, if it cannot.
pub fn check_blas() -> Result<()> {
    blas::get()
        .map(|_| ())
        .map_err(|reason| TensorError::Invalid {
            op: "cpu backend",
            reason,
        })
}

/// Operations below this many multiply-adds (or elements) stay on the caller's thread.
pub(super) const PARALLEL_WORK: usize = 1 << 20;

/// The CPU backend. Cheap to clone (the thread pool is shared).
#[derive(Clone)]
pub struct CpuBackend {
    threads: usize,
    pool: Option<Arc<rayon::ThreadPool>>,
    storage: DType,
    /// New outputs ([`crate::tensor::Backend::uninit`]) filled with NaN.
    poison: bool,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("threads", &self.threads)
            .field("storage", &self.storage)
            .field("poison", &self.poison)
            .finish()
    }
}

impl CpuBackend {
    /// A backend computing on `threads` threads (0 is taken as 1). With 1 every operation
    /// runs on the caller's thread; otherwise on a private rayon pool of that size.
    pub fn new(threads: usize) -> Result<Self> {
        malloc::tune();
        check_blas()?;
        let threads = threads.max(1);
        let pool = if threads > 1 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("pipefill-cpu-{i}"))
                .build()
                .map_err(|e| TensorError::Device(format!("cannot start {threads} threads: {e}")))?;
            Some(Arc::new(pool))
        } else {
            None
        };
        Ok(CpuBackend {
            threads,
            pool,
            storage: DType::F32,
            poison: false,
        })
    }

    /// The same backend, asking the model to store parameters and activations as `dtype`.
    pub fn with_storage(mut self, dtype: DType) -> Self {
        self.storage = dtype;
        self
    }

    /// The same backend with every new output ([`crate::tensor::Backend::uninit`]) filled
    /// with NaN rather than left as the allocator gives it: a run on it matches one on the
    /// plain backend only where every operation writes its output whole before reading it
    /// (the tests of that contract).
    pub fn with_poisoned_outputs(mut self) -> Self {
        self.poison = true;
        self
    }

    /// Number of compute threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` inside the backend's pool when it has one and the operation is big enough
    /// (`work` ≈ multiply-adds) to gain from it; otherwise right here, on the caller's
    /// thread, which also saves the hand-off to the pool. `f` gets whether it may split its
    /// work across threads.
    fn run<R: Send>(&self, work: usize, f: impl FnOnce(bool) -> R + Send) -> R {
        match &self.pool {
            Some(pool) if work >= PARALLEL_WORK => pool.install(|| {
                upper::clear();
                f(true)
            }),
            _ => f(false),
        }
    }

    /// Runs matrix products `f` of `each` multiply-adds (`total` in all): where MKL computes
    /// them, right here, since MKL splits a product over threads of its own from the
    /// caller's (inside the pool, a pool thread would wait beside them: 204–207 GF/s over a
    /// SmolLM-135M-shaped step, against 240–242 from the caller's thread,
    /// docs/benchmarks.md); otherwise as [`CpuBackend::run`] does, so that the crates split
    /// them over this backend's pool.
    fn product<R: Send>(&self, each: usize, total: usize, f: impl FnOnce() -> R + Send) -> R {
        if blas::for_product(each).is_some() {
            f()
        } else {
            self.run(total, |_| f())
        }
    }

    fn parallelism(&self) -> Parallelism {
        if self.threads > 1 {
            Parallelism::Rayon(self.threads)
        } else {
            Parallelism::None
        }
    }
}
