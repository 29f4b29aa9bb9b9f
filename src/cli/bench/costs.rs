//! `bench rollout`'s view of its step costs: the engine's own tokens/s per live-batch
//! bucket against what the step costs predict, the threshold either gives, the tail's share
//! of a rollout, and the printing of the step costs, which are measured by
//! [`pipefill::rl::calibrate`] (the same code `pipefill rl` calibrates with).

use std::collections::BTreeMap;

use pipefill::model::Gpt;
use pipefill::model::drafter::DraftRow;
use pipefill::model::drafter::{DraftContext, Drafter};
use pipefill::profile::report::median;
use pipefill::rl::RlError;
use pipefill::rl::bandit::bucket;
use pipefill::rl::calibrate::{StepCost, chain_acceptance, step_costs};
use pipefill::rl::rollout::{RolloutOutput, WorkKind};
use pipefill::tensor::Backend;

/// One live-batch bucket of a mode's runs: tokens/s measured, and what the measured step
/// costs predict for the same steps.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub(super) struct BucketFit {
    pub bucket: usize,
    /// Decode and verification steps launched while the live batch was in the bucket.
    pub steps: usize,
    pub measured: f64,
    /// Tokens/s of the engine's own work on those steps alone (the stages' compute and the
    /// drafting): what the measured figure would be without any time between steps.
    pub compute: f64,
    /// Predicted from the fastest of the step costs' repetitions (what the threshold uses).
    pub predicted: f64,
    /// Predicted from their medians (what a step typically costs on the machine as loaded).
    pub predicted_median: f64,
    /// Tokens per sequence per step (1 for plain decoding).
    pub acceptance: f64,
    /// Most groups in flight at once.
    pub groups: usize,
}

/// Per live-batch bucket (the live batch each step was launched at), over `runs`: the
/// tokens/s of their decode and verification steps (the wall time from the previous
/// step's results to this one's, prefill excluded) against the tokens/s their step costs
/// predict: each step costs what `costs` measured for its kind at its number of sequences
/// (decode, or proposal + verification), one step at a time. With several groups in flight
/// the steps overlap, so there the engine may beat the prediction.
pub(super) fn bucket_fits(
    runs: &[RolloutOutput],
    costs: &[StepCost],
    median_costs: &[StepCost],
) -> Vec<BucketFit> {
    #[derive(Default)]
    struct Sums {
        tokens: f64,
        wall: f64,
        compute: f64,
        cost: f64,
        median_cost: f64,
        seqs: f64,
        steps: usize,
        groups: usize,
    }
    let mut acc: BTreeMap<usize, Sums> = BTreeMap::new();
    for r in runs {
        let mut prev = 0.0;
        for s in &r.steps {
            let wall = s.t - prev;
            prev = s.t;
            let k = match s.kind {
                WorkKind::Prefill => continue,
                WorkKind::Decode => None,
                WorkKind::Verify { k } => Some(k),
            };
            let e = acc.entry(bucket(s.live)).or_default();
            e.tokens += s.emitted as f64;
            e.wall += wall;
            e.compute += s.compute_s + s.drafting_s;
            e.cost += cost_at(costs, s.sequences, k) / 1e3;
            e.median_cost += cost_at(median_costs, s.sequences, k) / 1e3;
            e.seqs += s.sequences as f64;
            e.steps += 1;
            e.groups = e.groups.max(s.in_flight);
        }
    }
    let rate = |tokens: f64, s: f64| tokens / s.max(1e-9);
    acc.into_iter()
        .map(|(bucket, e)| BucketFit {
            bucket,
            steps: e.steps,
            measured: rate(e.tokens, e.wall),
            compute: rate(e.tokens, e.compute),
            predicted: rate(e.tokens, e.cost),
            predicted_median: rate(e.tokens, e.median_cost),
            acceptance: e.tokens / e.seqs.max(1.0),
            groups: e.groups,
        })
        .collect()
}

/// What one step of `b` sequences costs by `costs`, in ms: a decode (`k` = `None`) or the
/// proposal and verification of a chain of `k` (the measured K nearest to it), linear in
/// `b` between measured sizes and beyond the largest.
fn cost_at(costs: &[StepCost], b: usize, k: Option<usize>) -> f64 {
    // The entries of one K (decode costs are the same in all of them).
    let Some(at) = costs
        .iter()
        .min_by_key(|c| k.map_or(0, |k| c.k.abs_diff(k)))
        .map(|c| c.k)
    else {
        return f64::NAN;
    };
    let pts: Vec<(f64, f64)> = costs
        .iter()
        .filter(|c| c.k == at)
        .map(|c| {
            let ms = match k {
                None => c.decode_ms,
                Some(_) => c.verify_ms + c.propose_ms,
            };
            (c.batch as f64, ms)
        })
        .collect();
    let b = b as f64;
    let seg = pts
        .windows(2)
        .find(|w| b <= w[1].0)
        .or_else(|| pts.windows(2).last());
    match seg {
        Some(w) => {
            let ((b0, c0), (b1, c1)) = (w[0], w[1]);
            c0 + (c1 - c0) * (b - b0) / (b1 - b0)
        }
        None => pts.first().map_or(f64::NAN, |p| p.1),
    }
}

/// The largest bucket up to which speculation was faster in every bucket (0: not even in
/// the smallest), from the plain and the fixed-K runs' measured tokens/s.
pub(super) fn threshold_of_buckets(plain: &[BucketFit], fixed: &[BucketFit]) -> usize {
    plain
        .iter()
        .map_while(|p| {
            let f = fixed.iter().find(|f| f.bucket == p.bucket)?;
            (f.measured > p.measured).then_some(p.bucket)
        })
        .last()
        .unwrap_or(0)
}

/// One line per bucket: the plain and the fixed-K runs' measured tokens/s against what
/// their step costs predict.
pub(super) fn fit_lines(plain: &[BucketFit], fixed: &[BucketFit], k: usize) -> Vec<String> {
    let fit = |f: &BucketFit| {
        format!(
            "{:>6.1} tokens/s (its steps' own compute {:>6.1}), predicted {:>6.1} from the fastest step costs ({:+4.0}%), {:>6.1} from their medians ({:+4.0}%); {:.2} tokens per sequence a step, {} group{}",
            f.measured,
            f.compute,
            f.predicted,
            100.0 * (f.measured / f.predicted - 1.0),
            f.predicted_median,
            100.0 * (f.measured / f.predicted_median - 1.0),
            f.acceptance,
            f.groups,
            if f.groups == 1 { "" } else { "s" }
        )
    };
    plain
        .iter()
        .map(|p| {
            let spec = fixed
                .iter()
                .find(|f| f.bucket == p.bucket)
                .map_or(String::new(), |f| format!("; fixed K={k} {}", fit(f)));
            format!(
                "engine vs step costs, live ≤ {:>3}: plain {}{spec}",
                p.bucket,
                fit(p)
            )
        })
        .collect()
}

/// Share of a rollout's time after only its longest 10% of sequences are live (from the
/// first moment at most a tenth of the batch is live to the end).
pub(super) fn tail_share(r: &RolloutOutput) -> f64 {
    let n = r.sequences.len();
    let tenth = (n / 10).max(1);
    let total = r.stats.seconds.max(1e-9);
    r.live_curve
        .iter()
        .find(|p| p.live <= tenth)
        .map_or(0.0, |p| (total - p.t) / total)
}

/// Timed repetitions per cost (the fastest is kept).
pub(super) const COST_REPS: usize = 9;

/// Step costs of `model` and `drafter` as [`step_costs`] measures them, but each the median
/// of [`COST_REPS`] one-repetition measurements instead of the fastest: on a shared machine
/// the fastest is what a step costs when nothing else runs, the median what it costs as the
/// machine is loaded during the rollouts.
pub(super) fn median_step_costs<B: Backend>(
    model: &Gpt<B>,
    drafter: &mut Drafter<B>,
    ctx: DraftContext<'_>,
    ks: &[usize],
    max_b: usize,
) -> Result<Vec<StepCost>, RlError> {
    let runs: Vec<Vec<StepCost>> = (0..COST_REPS)
        .map(|_| step_costs(model, drafter, ctx, ks, max_b, 1))
        .collect::<Result<_, _>>()?;
    let mid = |i: usize, f: fn(&StepCost) -> f64| median(runs.iter().map(|r| f(&r[i])));
    Ok((0..runs[0].len())
        .map(|i| StepCost {
            decode_ms: mid(i, |c| c.decode_ms),
            verify_ms: mid(i, |c| c.verify_ms),
            propose_ms: mid(i, |c| c.propose_ms),
            ..runs[0][i]
        })
        .collect())
}

/// The long tail's typical context, owned: `(hidden, tokens)` of the first half of the
/// bench's probe row (the plain rollout's longest), about the middle of the positions the
/// tail decodes at (the longest sequence from where a tenth of the batch is live to its
/// end). The step costs are timed at a cache this long.
pub(super) fn probe_context(probe: &DraftRow, d: usize) -> (Vec<f32>, Vec<u32>) {
    let n = probe.len().div_ceil(2);
    (probe.hidden[..n * d].to_vec(), probe.targets[..n].to_vec())
}

/// The per-token acceptance α of a drafter whose chains of `k` reach acceptance length
/// `accept` (`1 + α + … + α^k`; bisection, the sum grows with α).
pub(super) fn per_token_acceptance(accept: f64, k: usize) -> f64 {
    let (mut lo, mut hi) = (0.0, 1.0);
    for _ in 0..50 {
        let mid = 0.5 * (lo + hi);
        if chain_acceptance(mid, k) < accept {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// One line per measured group size and K: its costs, and whether speculation pays there
/// at `acceptance(K)` tokens per verification.
pub(super) fn step_cost_lines(
    costs: &[StepCost],
    acceptance: impl Fn(usize) -> f64,
) -> Vec<String> {
    costs
        .iter()
        .map(|c| {
            let accept = acceptance(c.k);
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
