//! A tiny, seedable, platform-independent random number generator (SplitMix64).
//!
//! Data generation must give the same tasks on every machine and every rank of a launch,
//! from the seed alone, so it uses its own generator with a fixed algorithm instead of a
//! crate whose stream could change between versions.

use serde::{Deserialize, Serialize};

/// SplitMix64 (Steele, Lea, Flood 2014): 64 bits of state, passes BigCrush, trivially
/// reproducible. Its whole state is one `u64`, so it is cheap to store in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose stream is determined by `seed` alone.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator for sub-stream `index` of `seed` (e.g. the data of step `index`), so a
    /// stream can be entered at any point without replaying what precedes it.
    pub fn derive(seed: u64, index: u64) -> Self {
        // Mix the pair through one output of each so nearby (seed, index) pairs are unrelated.
        let a = Self::new(seed).next_u64();
        let b = Self::new(index ^ 0xA076_1D64_78BD_642F).next_u64();
        Self::new(a ^ b.rotate_left(29))
    }

    /// The current state (what a checkpoint stores to resume this stream).
    pub fn state(&self) -> u64 {
        self.state
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform float in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform integer in `[0, n)`; `n` must be positive. Uses rejection so there is
    /// no modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0, "below(0)");
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    /// A uniform integer in `[lo, hi]` (inclusive).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// A size in `[1, max]` from a heavy-tailed law (a Pareto type II with shape 1,
    /// truncated by rejection): P(size > k) = scale / (scale + k) before truncation, so
    /// most draws are small and a few are near `max`. This is what makes solution
    /// lengths long-tailed. It uses only a division and a floor, which IEEE 754 rounds
    /// exactly, so the draws are the same on every platform (no `powf`/`ln`).
    pub fn heavy_tailed(&mut self, scale: f64, max: u32) -> u32 {
        let max = max.max(1);
        loop {
            // u in (0, 1]: never zero, so 1/u is finite.
            let u = ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64);
            let x = scale * (1.0 / u - 1.0);
            if x < max as f64 {
                return 1 + x as u32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_first_outputs() {
        // Reference values of SplitMix64 seeded with 0 (from the published algorithm).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn below_stays_in_range_and_sizes_are_heavy_tailed() {
        let mut r = SplitMix64::new(7);
        for _ in 0..1000 {
            assert!(r.below(13) < 13);
        }
        let draws: Vec<u32> = (0..4000).map(|_| r.heavy_tailed(1.5, 30)).collect();
        assert!(draws.iter().all(|&d| (1..=30).contains(&d)));
        let ones = draws.iter().filter(|&&d| d == 1).count();
        let big = draws.iter().filter(|&&d| d >= 20).count();
        assert!(ones > big * 3, "ones {ones}, big {big}");
        assert!(big > 0);
    }
}
