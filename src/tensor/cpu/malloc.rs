//! glibc's allocator, tuned once per process for a training step's buffers.
//!
//! A step allocates and frees the same multi-megabyte buffers (activations, gradients, a
//! chunk's logits) micro-batch after micro-batch. By default glibc serves each buffer above
//! its mmap threshold (128 KiB, raised only up to 32 MiB as it sees them freed) with a fresh
//! mapping that it unmaps on free, and gives the top of its heap back to the kernel past
//! the trim threshold; either way the next buffer touches new pages and pays a page fault
//! for each 4 KiB. On a virtual machine a fault costs microseconds: a SmolLM-135M-shaped
//! training run of 3 steps took 3.4 M faults, about a fifth of its time (docs/benchmarks.md,
//! "Where the gap to torch was").
//!
//! Raising both thresholds keeps freed buffers in the heap for the next micro-batch, as
//! PyTorch's caching allocator does for device memory. What is kept is what the step had in
//! use a moment before, so the peak barely moves where one thread allocates (the reference
//! trainer: 3016 → 3028 MiB at that shape); a 2-stage pipeline's rose 6% (3315 → 3509 MiB).
//!
//! Every thread allocates from the one main heap (`M_ARENA_MAX` 1). glibc's other arenas
//! are heaps of at most 64 MiB, so a buffer above that (a head's `[d_model, vocab]`
//! gradient, 113 MB at a 49K vocabulary) allocated on a stage thread or a pool thread was
//! mapped afresh every micro-batch whatever the threshold: in the 2-stage pipeline sharing
//! two threads at SmolLM-135M's shape, one arena took a 3-step run from 1.57 M faults to
//! 1.09 M and 165 to 170 tokens/s, its peak from 3501 to 3519 MiB (what the one arena's
//! lock costs is inside those figures).

use std::sync::Once;

/// Buffers up to this size come from the heap (256 MiB); larger ones, such as a tied
/// table or a head's gradient at Qwen2.5's 152K vocabulary (545 MB), are mapped on their
/// own and returned on free. Qwen2.5-0.5B's shape at 2 layers, pipelined with the drafter
/// (whose refreshes make and free such tables each step), peaked at 12,750 MiB with 1 GiB
/// here, its RSS rising step by step, and at 11,453 MiB with 256 MiB, in the same time
/// (61.1 / 61.4 s); the reference trainer there ran 56 against 57-58 tokens/s, its peak
/// unchanged (docs/benchmarks.md, "Memory estimate calibration").
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 1 << 28;

/// Tunes the process's allocator, once; the first CPU backend calls it. A no-op where the
/// C library is not glibc.
pub(super) fn tune() {
    static TUNED: Once = Once::new();
    TUNED.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only sets allocator parameters; it takes the allocator's lock and
        // is safe to call from any thread at any time.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
            libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    });
}
