//! `bench rollout`'s view of its adaptive thresholds: the engine's own tokens/s per
//! live-batch bucket, and the printing of the step costs, which are measured by
//! [`pipefill::rl::calibrate`] (the same code `pipefill rl` calibrates with).

use std::collections::BTreeMap;

use pipefill::model::drafter::DraftRow;
use pipefill::rl::bandit::bucket;
use pipefill::rl::calibrate::StepCost;
use pipefill::rl::rollout::Rollout;

/// Tokens generated and seconds spent while the live batch was in each bucket, summed
/// over `runs` (from their live curves).
fn by_bucket(runs: &[Rollout]) -> BTreeMap<usize, (f64, f64)> {
    let mut out: BTreeMap<usize, (f64, f64)> = BTreeMap::new();
    for r in runs {
        for w in r.live_curve.windows(2).filter(|w| w[0].live > 0) {
            let e = out.entry(bucket(w[0].live)).or_default();
            e.0 += (w[1].tokens - w[0].tokens) as f64;
            e.1 += w[1].t - w[0].t;
        }
    }
    out
}

/// Tokens/s of the plain and the fixed-K runs while the live batch was in each bucket:
/// `(bucket, plain, fixed)`, over the buckets both runs went through.
pub(super) fn engine_buckets(plain: &[Rollout], fixed: &[Rollout]) -> Vec<(usize, f64, f64)> {
    let (p, f) = (by_bucket(plain), by_bucket(fixed));
    p.iter()
        .filter_map(|(&b, &(pt, ps))| {
            let &(ft, fs) = f.get(&b)?;
            Some((b, pt / ps.max(1e-9), ft / fs.max(1e-9)))
        })
        .collect()
}

/// The largest bucket up to which speculation was faster in every bucket (0: not even in
/// the smallest), from `(bucket, plain, fixed)` tokens/s in bucket order.
pub(super) fn threshold_of_buckets(buckets: &[(usize, f64, f64)]) -> usize {
    buckets
        .iter()
        .take_while(|(_, plain, fixed)| fixed > plain)
        .last()
        .map_or(0, |&(b, _, _)| b)
}

/// Timed repetitions per cost (the fastest is kept).
pub(super) const COST_REPS: usize = 9;

/// The drafter context of the bench's probe row (the plain rollout's longest: the long
/// tail's context), owned: `(hidden, tokens)`.
pub(super) fn probe_context(probe: &DraftRow, d: usize) -> (Vec<f32>, Vec<u32>) {
    let n = probe.len();
    (probe.hidden[..n * d].to_vec(), probe.targets[..n].to_vec())
}

/// One line per measured group size: its costs, and whether speculation pays there at
/// acceptance length `accept`.
pub(super) fn step_cost_lines(costs: &[StepCost], accept: f64) -> Vec<String> {
    costs
        .iter()
        .map(|c| {
            format!(
                "step costs: {:>3} per group: decode {:>7.3} ms, verify K+1={} {:>7.3} ms ({:.2}x), propose {:>6.3} ms: speculation {} ({:.2} vs {:.2} ms per plain-token-equivalent)",
                c.batch,
                c.decode_ms,
                c.k + 1,
                c.verify_ms,
                c.verify_ms / c.decode_ms,
                c.propose_ms,
                if c.pays(accept) { "pays" } else { "loses" },
                (c.propose_ms + c.verify_ms) / accept,
                c.decode_ms
            )
        })
        .collect()
}
