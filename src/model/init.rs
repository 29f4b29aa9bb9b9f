//! Deterministic initialisation: each parameter draws from its own SplitMix64 stream seeded
//! from (model seed, parameter name), so a parameter's initial value does not depend on how
//! the model is cut into stages, on which rank builds it, or on construction order.
//!
//! [`overwritten`] builds a model whose parameters the caller sets at once (a resumed
//! checkpoint, a run's final weights) without drawing them: the draws (a `ln`, `sqrt`,
//! `sin`/`cos` per pair of values) were a large share of a `pipefill rl` run's CPU
//! (docs/benchmarks.md, "Smaller figures behind design choices"), since it rebuilds its
//! update pipeline from the previous step's weights every step.

use std::cell::Cell;

use super::GptConfig;

thread_local! {
    /// Inside [`overwritten`] on this thread: [`normal`] hands out zeros instead of draws.
    static SKIP_DRAWS: Cell<bool> = const { Cell::new(false) };
}

/// Runs `build` with every [`normal`] draw on this thread replaced by zeros, for a model
/// whose parameters are all overwritten right after it is built. Layers that start from a
/// constant (a norm's gain of ones) are unaffected; either way the caller must set every
/// parameter, which the checkpoint's restore and [`crate::model::Gpt::set_param`] loops do.
pub fn overwritten<T>(build: impl FnOnce() -> T) -> T {
    /// Restores the previous mode even if `build` panics, so nothing after it on this
    /// thread gets zeros for a real initialisation.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SKIP_DRAWS.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SKIP_DRAWS.with(|s| s.replace(true)));
    build()
}

/// Whether this thread is inside [`overwritten`] (the parameters built now are placeholders
/// their caller overwrites: nothing is drawn, nothing imported).
pub(crate) fn overwriting() -> bool {
    SKIP_DRAWS.with(Cell::get)
}

/// SplitMix64 step: the well-known 64-bit mixer (Steele, Lea, Flood 2014).
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a hash of the name, to separate the streams of different parameters.
fn fnv1a(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3)
    })
}

/// `len` samples of `N(0, std²)` from the stream of (seed, name) (Box–Muller, in `f64`).
pub fn normal(seed: u64, name: &str, len: usize, std: f32) -> Vec<f32> {
    if SKIP_DRAWS.with(Cell::get) {
        return vec![0.0; len];
    }
    let mut state = seed ^ fnv1a(name);
    // One warm-up draw decorrelates seeds that differ in few bits.
    splitmix64(&mut state);
    let mut uniform = || ((splitmix64(&mut state) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let (u1, u2) = (uniform(), uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = std::f64::consts::TAU * u2;
        out.push((r * theta.cos()) as f32 * std);
        if out.len() < len {
            out.push((r * theta.sin()) as f32 * std);
        }
    }
    out
}

/// Standard deviation of most weight matrices and embeddings (GPT-2).
pub const INIT_STD: f32 = 0.02;

/// Standard deviation of the projections that write into the residual stream (`wo`, `w2`),
/// scaled down by `√(2·layers)` so the stream's variance does not grow with depth.
pub fn residual_std(config: &GptConfig) -> f32 {
    INIT_STD / ((2 * config.layers) as f32).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_deterministic_and_distinct() {
        let a = normal(7, "blocks.0.attn.wq", 1000, 1.0);
        assert_eq!(a, normal(7, "blocks.0.attn.wq", 1000, 1.0));
        assert_ne!(a, normal(7, "blocks.0.attn.wk", 1000, 1.0));
        assert_ne!(a, normal(8, "blocks.0.attn.wq", 1000, 1.0));
        // A prefix of a longer draw is the shorter draw.
        assert_eq!(normal(7, "x", 11, 1.0)[..], normal(7, "x", 20, 1.0)[..11]);
    }

    #[test]
    fn overwritten_skips_draws_only_inside_its_scope() {
        let drawn = normal(7, "w", 64, 1.0);
        assert_eq!(overwritten(|| normal(7, "w", 64, 1.0)), vec![0.0; 64]);
        // Nested scopes restore the outer mode, and draws resume after the scope.
        assert_eq!(
            overwritten(|| {
                overwritten(|| ());
                normal(7, "w", 3, 1.0)
            }),
            vec![0.0; 3]
        );
        assert_eq!(normal(7, "w", 64, 1.0), drawn);
        let _ = std::panic::catch_unwind(|| overwritten(|| panic!("a failed build")));
        assert_eq!(normal(7, "w", 64, 1.0), drawn);
    }

    #[test]
    fn samples_are_standard_normal() {
        let x = normal(3, "embed.tok", 20_000, 2.0);
        let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / x.len() as f64;
        let var = x
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / x.len() as f64;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.05, "std {}", var.sqrt());
    }
}
