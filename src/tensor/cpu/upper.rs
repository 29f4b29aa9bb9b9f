//! Clearing the upper halves of the vector registers after faer's products.
//!
//! faer's x86 kernels (the `private-gemm-x86` crate, hand-written assembly) return with the
//! upper halves of the AVX/AVX-512 registers still set. Until the thread runs a
//! `vzeroupper`, every legacy-SSE instruction it runs pays a dependency on those halves:
//! and Rust's scalar float code at the baseline x86-64 target is all legacy SSE. On this
//! repository's Sapphire Rapids box the SwiGLU backward (an `exp` per element) ran 23–43x
//! slower after a product on the same thread, and a one-thread training step 1.8x slower
//! (docs/benchmarks.md, "Dirty upper registers"). Compiled code clears them itself on
//! leaving AVX code; assembly has to be followed by [`clear`].

/// Clears the upper halves of the calling thread's vector registers (a no-op without AVX).
#[inline]
pub(super) fn clear() {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX, which `vzeroupper` needs.
        unsafe { zero_upper() }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[inline(never)]
unsafe fn zero_upper() {
    std::arch::x86_64::_mm256_zeroupper();
}
