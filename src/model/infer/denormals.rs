//! [`Flushed`]: the inference kernels' arithmetic with subnormal floats flushed to zero.
//!
//! A long context's softmax gives most cached rows weights far below `f32::MIN_POSITIVE`,
//! and their products with the values are subnormal again. x86 cores compute an operation
//! on or to a subnormal in a slow microcode assist: on the rollout bench's target (d_model
//! 512, on 2 cores of a Xeon with AVX-512 and AMX) a 5-row verification at 350 cached
//! positions cost 14.8 ms with subnormals and 10.8 ms with the thread flushing them, a
//! 1-row decode 10.5 and 9.1 ms (docs/benchmarks.md, "Subnormals in generation"; 11.8 and
//! 9.8 ms with this guard around the kernels). Inference runtimes
//! flush them (TensorFlow on x86 by default, PyTorch with `set_flush_denormal`); the values
//! lost are below 1.2e-38: a softmax weight that small, times a value, is far under an ulp of
//! an output that is a weighted mean of values.
//!
//! The mode is set for the span of one kernel call and put back after it, so the kernels'
//! results do not depend on the calling thread's mode, and nothing else (training, the
//! backend's products) runs flushed. Every path of a kernel runs under it, so the plain and
//! the SIMD paths stay bitwise the same.

/// While alive, the calling thread treats subnormal inputs as zero and flushes subnormal
/// results to zero (x86-64: MXCSR's DAZ and FTZ bits); elsewhere it does nothing.
pub(crate) struct Flushed {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

/// MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6).
#[cfg(target_arch = "x86_64")]
const FTZ_DAZ: u32 = 0x8040;

impl Flushed {
    /// Flushes subnormals on this thread until the guard drops.
    #[inline]
    pub(crate) fn subnormals() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let saved = read_mxcsr();
            write_mxcsr(saved | FTZ_DAZ);
            Flushed { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Flushed {}
    }
}

impl Drop for Flushed {
    #[inline]
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        write_mxcsr(self.saved);
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn read_mxcsr() -> u32 {
    let mut v: u32 = 0;
    // SAFETY: `stmxcsr` stores the 4-byte control word to a valid, writable location.
    unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut v, options(nostack, preserves_flags)) };
    v
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn write_mxcsr(v: u32) {
    // SAFETY: `ldmxcsr` loads a control word read by `stmxcsr` with only the FTZ/DAZ bits
    // changed (both valid on every x86-64 CPU with SSE2, which x86-64 has).
    unsafe {
        std::arch::asm!("ldmxcsr [{}]", in(reg) &v, options(nostack, preserves_flags, readonly))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subnormals_flush_inside_the_guard_only() {
        let tiny = std::hint::black_box(f32::MIN_POSITIVE);
        let half = std::hint::black_box(0.5f32);
        assert!((tiny * half).is_subnormal());
        {
            let _f = Flushed::subnormals();
            #[cfg(target_arch = "x86_64")]
            assert_eq!(std::hint::black_box(tiny) * std::hint::black_box(half), 0.0);
        }
        assert!((std::hint::black_box(tiny) * half).is_subnormal());
    }
}
