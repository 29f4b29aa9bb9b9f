//! `bench rollout`'s view of its step costs: the engine's own tokens/s per live-batch
//! bucket against what the step costs predict, the threshold either gives, the tail's share
//! of a rollout, and the printing of the step costs, which are measured by
//! [`pipefill::rl::calibrate`] (the same code `pipefill rl` calibrates with). With several
//! groups in flight a step is predicted faster by [`super::overlap`]'s measured overlap.

use std::collections::BTreeMap;

use pipefill::model::Gpt;
use pipefill::model::drafter::{DraftContext, DraftRow, Drafter};
use pipefill::profile::report::median;
use pipefill::rl::RlError;
use pipefill::rl::bandit::bucket;
use pipefill::rl::calibrate::{StepCost, chain_acceptance, fastest, step_cost_reps};
use pipefill::rl::rollout::{RolloutOutput, StepRecord, WorkKind};
use pipefill::tensor::Backend;

use super::overlap::{Overlap, overlap_at};

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
    /// How much faster the bucket's steps were predicted to run for overlapping other
    /// groups' ([`Overlap`]): their one-at-a-time cost over the predicted (1 with one group).
    pub overlap: f64,
    /// `predicted` without the overlap: every step one at a time (a lower bound where the
    /// overlap's is an upper one).
    pub predicted_serial: f64,
}

/// Step costs measured at one cache length (`step_costs`' context).
#[derive(Clone, Debug, serde::Serialize)]
pub(super) struct CostsAt {
    /// Positions cached before the timed steps.
    pub context: usize,
    pub costs: Vec<StepCost>,
}

/// Per live-batch bucket (the live batch each step was launched at), over `runs`: the
/// tokens/s of their decode and verification steps (the wall time from the previous
/// step's results to this one's; the prefill, and the steps launched before it ended,
/// excluded) against the tokens/s their step costs
/// predict: each step costs what `costs` measured for its kind at its number of sequences
/// (decode, or proposal + verification) and at its own context ([`cost_at`]), divided,
/// where other groups were in flight with it, by how much faster that many groups' steps
/// ran at once than one after another ([`overlap_at`]).
pub(super) fn bucket_fits(
    runs: &[RolloutOutput],
    costs: &[CostsAt],
    median_costs: &[CostsAt],
    overlaps: &[Overlap],
) -> Vec<BucketFit> {
    #[derive(Default)]
    struct Sums {
        tokens: f64,
        wall: f64,
        compute: f64,
        cost: f64,
        median_cost: f64,
        /// The steps' cost one at a time (fastest step costs), for `overlap`.
        serial: f64,
        seqs: f64,
        steps: usize,
        groups: usize,
    }
    let mut acc: BTreeMap<usize, Sums> = BTreeMap::new();
    for r in runs {
        // The prefill's cost is in no step cost, and the time a step ran beside it goes to
        // the prefill's wall: such a step would look faster than it ran.
        let prefilled = r
            .steps
            .iter()
            .filter(|s| s.kind == WorkKind::Prefill)
            .map(|s| s.t)
            .fold(0.0, f64::max);
        let mut prev = 0.0;
        for s in &r.steps {
            let wall = s.t - prev;
            prev = s.t;
            let k = match s.kind {
                WorkKind::Prefill => continue,
                _ if s.t - s.latency_s < prefilled => continue,
                WorkKind::Decode => None,
                WorkKind::Verify { k } => Some(k),
            };
            let e = acc.entry(bucket(s.live)).or_default();
            e.tokens += s.emitted as f64;
            e.wall += wall;
            e.compute += s.compute_s + s.drafting_s;
            let speedup = overlap_at(overlaps, step_rows(s), s.in_flight);
            let serial = cost_at(costs, s.sequences, k, s.context) / 1e3;
            e.serial += serial;
            e.cost += serial / speedup;
            e.median_cost += cost_at(median_costs, s.sequences, k, s.context) / 1e3 / speedup;
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
            overlap: e.serial / e.cost.max(1e-12),
            predicted_serial: rate(e.tokens, e.serial),
        })
        .collect()
}

/// Rows a step carried through the model: one per sequence for a decode, K+1 for the
/// verification of K drafts (how its products run, and so how it overlaps: `overlap`).
pub(super) fn step_rows(s: &StepRecord) -> usize {
    match s.kind {
        WorkKind::Verify { k } => s.sequences * (k + 1),
        WorkKind::Prefill | WorkKind::Decode => s.sequences,
    }
}

/// What one step of `b` sequences at a cache of `context` positions costs, in ms: each
/// table's cost ([`cost_in`]), linear in the context between the tables' (ascending) and
/// beyond the longest (the attention over the cache grows linearly with it, the rest does
/// not change); below the shortest, its cost (a line through points far away gave the
/// steps right after the prompts' prefill half the cost they ran at, so the shortest
/// table is timed near their caches). A longer cache never costs less: a noisy table
/// takes its shorter neighbour's cost. One table's cost at any context.
fn cost_at(tables: &[CostsAt], b: usize, k: Option<usize>, context: usize) -> f64 {
    let mut pts: Vec<(f64, f64)> = Vec::new();
    for t in tables {
        let (x, y) = (t.context as f64, cost_in(&t.costs, b, k));
        match pts.last_mut() {
            Some(last) if last.0 == x => last.1 = last.1.min(y),
            _ => pts.push((x, y)),
        }
    }
    for i in 1..pts.len() {
        pts[i].1 = pts[i].1.max(pts[i - 1].1);
    }
    match pts.first() {
        None => f64::NAN,
        Some(&(first, _)) => linear(&pts, (context as f64).max(first)),
    }
}

/// What one step of `b` sequences costs by `costs`, in ms: a decode (`k` = `None`) or the
/// proposal and verification of a chain of `k` (the measured K nearest to it), linear in
/// `b` between measured sizes and beyond the largest.
fn cost_in(costs: &[StepCost], b: usize, k: Option<usize>) -> f64 {
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
    linear(&pts, b as f64)
}

/// `pts` (ascending in x) at `x`: linear between two points and beyond the last two; the
/// one point's value where there is one; NaN where there is none.
pub(super) fn linear(pts: &[(f64, f64)], x: f64) -> f64 {
    let seg = pts
        .windows(2)
        .find(|w| x <= w[1].0)
        .or_else(|| pts.windows(2).last());
    match seg {
        Some(w) => {
            let ((x0, y0), (x1, y1)) = (w[0], w[1]);
            y0 + (y1 - y0) * (x - x0) / (x1 - x0)
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
            "{:>6.1} tokens/s (its steps' own compute {:>6.1}), predicted {:>6.1} from the fastest step costs ({:+4.0}%), {:>6.1} from their medians ({:+4.0}%); {:.2} tokens per sequence a step, {} group{}{}",
            f.measured,
            f.compute,
            f.predicted,
            100.0 * (f.measured / f.predicted - 1.0),
            f.predicted_median,
            100.0 * (f.measured / f.predicted_median - 1.0),
            f.acceptance,
            f.groups,
            if f.groups == 1 { "" } else { "s" },
            match f.overlap > 1.0 {
                true => format!(
                    " (overlapping {:.2}x; one step at a time: {:.1}, {:+.0}%)",
                    f.overlap,
                    f.predicted_serial,
                    100.0 * (f.measured / f.predicted_serial - 1.0)
                ),
                false => String::new(),
            }
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

/// Timed repetitions per cost (the fastest is kept).
pub(super) const COST_REPS: usize = 9;

/// Step costs for the per-bucket predictions ([`bucket_fits`]), one table per context of
/// `contexts`, for groups of up to `max_b` sequences, from one measurement of
/// [`COST_REPS`] repetitions ([`step_cost_reps`]): each cost the fastest of them, and each
/// their median (on a shared machine the fastest is what a step costs when nothing else
/// runs, the median what it costs as the machine is loaded during the rollouts).
pub(super) fn bucket_tables<B: Backend>(
    model: &Gpt<B>,
    drafter: &mut Drafter<B>,
    contexts: &[DraftContext<'_>],
    ks: &[usize],
    max_b: usize,
) -> Result<(Vec<CostsAt>, Vec<CostsAt>), RlError> {
    let middle = |t: &[f64]| median(t.iter().copied());
    let mut tables = (Vec::new(), Vec::new());
    for &c in contexts {
        let timed = step_cost_reps(model, drafter, c, ks, max_b, COST_REPS)?;
        let table = |pick: &dyn Fn(&[f64]) -> f64| CostsAt {
            context: c.tokens.len(),
            costs: timed.iter().map(|t| t.cost(pick)).collect(),
        };
        tables.0.push(table(&fastest));
        tables.1.push(table(&middle));
    }
    Ok(tables)
}

/// A context of the bench's probe row (the plain rollout's longest), owned: `(hidden,
/// tokens)` of its first `1/parts`. Half of it ([`TAIL_PARTS`]) is about the middle of the
/// positions the long tail decodes at (the longest sequence from where a tenth of the
/// batch is live to its end): the threshold's step costs are timed at a cache this long.
/// An eighth ([`EARLY_PARTS`]) is nearer where the larger buckets decode, early in the
/// rollout, and a thirty-second ([`FIRST_PARTS`]) where the widest do, right after the
/// prefill: the per-bucket predictions take the step costs at all three, linear in between.
pub(super) fn probe_context(probe: &DraftRow, d: usize, parts: usize) -> (Vec<f32>, Vec<u32>) {
    let n = probe.len().div_ceil(parts.max(1)).max(1).min(probe.len());
    (probe.hidden[..n * d].to_vec(), probe.targets[..n].to_vec())
}

/// [`probe_context`]'s share for the long tail's step costs.
pub(super) const TAIL_PARTS: usize = 2;
/// [`probe_context`]'s share for the early, larger buckets' step costs.
pub(super) const EARLY_PARTS: usize = 8;
/// [`probe_context`]'s share for the first steps after the prompts' prefill, where the
/// widest buckets decode (their caches held 12–28 positions on the d512 bench, where the
/// probe row's eighth is 55: at that cost plain at live ≤ 64 was predicted 11–13% slower
/// than it ran).
pub(super) const FIRST_PARTS: usize = 32;

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

#[cfg(test)]
mod tests {
    use super::*;

    fn table(context: usize, decode_ms: [f64; 2]) -> CostsAt {
        let costs = [1, 2]
            .into_iter()
            .zip(decode_ms)
            .map(|(batch, decode_ms)| StepCost {
                batch,
                k: 4,
                decode_ms,
                verify_ms: 2.0 * decode_ms,
                propose_ms: 1.0,
            })
            .collect();
        CostsAt { context, costs }
    }

    #[test]
    fn a_step_costs_what_its_own_context_and_size_cost() {
        let two = [table(50, [10.0, 14.0]), table(250, [20.0, 30.0])];
        // Between the contexts, beyond them, and between the sizes.
        assert_eq!(cost_at(&two, 1, None, 150), 15.0);
        assert_eq!(cost_at(&two, 1, None, 350), 25.0);
        assert_eq!(cost_at(&two, 2, None, 50), 14.0);
        assert_eq!(
            cost_at(&two, 2, None, 10),
            14.0,
            "not below the shorter context"
        );
        assert_eq!(cost_at(&two, 2, Some(4), 250), 61.0);
        // One table: its cost at any context; a longer cache measured cheaper: no slope.
        assert_eq!(cost_at(&two[..1], 1, None, 400), 10.0);
        let noisy = [table(50, [10.0, 14.0]), table(250, [9.0, 13.0])];
        assert_eq!(cost_at(&noisy, 1, None, 400), 10.0);
        assert!(cost_at(&[], 1, None, 10).is_nan());
        // Three tables: linear within each pair, the shortest's cost below it.
        let three = [table(10, [6.0, 8.0]), two[0].clone(), two[1].clone()];
        assert_eq!(cost_at(&three, 1, None, 30), 8.0);
        assert_eq!(cost_at(&three, 1, None, 150), 15.0);
        assert_eq!(cost_at(&three, 2, None, 5), 8.0);
        // A shorter table measured dearer than the next is its floor.
        let noisy = [table(10, [12.0, 16.0]), two[0].clone(), two[1].clone()];
        assert_eq!(cost_at(&noisy, 1, None, 50), 12.0);
        assert_eq!(cost_at(&noisy, 1, None, 250), 20.0);
    }

    fn step(t: f64, in_flight: usize, kind: WorkKind) -> StepRecord {
        StepRecord {
            t,
            live: 2,
            sequences: 1,
            context: 50,
            kind,
            emitted: 1,
            in_flight,
            drafting_s: 0.0,
            compute_s: 0.01,
            latency_s: 0.01,
        }
    }

    fn two_steps(in_flight: usize, kind: WorkKind) -> RolloutOutput {
        RolloutOutput {
            sequences: Vec::new(),
            prompt_lens: Vec::new(),
            rows: Vec::new(),
            stats: Default::default(),
            live_curve: Vec::new(),
            steps: vec![step(0.01, in_flight, kind), step(0.02, in_flight, kind)],
            choices: Vec::new(),
        }
    }

    #[test]
    fn overlapped_steps_are_predicted_faster() {
        let run = |in_flight| two_steps(in_flight, WorkKind::Decode);
        let costs = [table(50, [10.0, 14.0])];
        let overlaps = [Overlap {
            rows: 1,
            groups: 2,
            speedup: 2.0,
        }];
        let alone = bucket_fits(&[run(1)], &costs, &costs, &overlaps);
        let both = bucket_fits(&[run(2)], &costs, &costs, &overlaps);
        // Two 10 ms decodes: 100 tokens/s one after another, 200 at once; measured 100.
        assert_eq!((alone[0].predicted, alone[0].overlap), (100.0, 1.0));
        assert_eq!((both[0].predicted, both[0].overlap), (200.0, 2.0));
        assert_eq!(both[0].predicted_serial, 100.0);
        assert!((both[0].measured - 100.0).abs() < 1e-9);
    }

    /// A step launched before the prefill ended ran partly in the prefill's wall time: it
    /// is left out, not credited with the tokens of a step that seemed to take no time.
    #[test]
    fn steps_beside_the_prefill_are_left_out() {
        let costs = [table(50, [10.0, 14.0])];
        let mut run = two_steps(1, WorkKind::Decode);
        // The first decode was launched at 0.0, before the prefill's results at 0.015; the
        // second at 0.016, after them.
        run.steps.insert(1, step(0.015, 1, WorkKind::Prefill));
        run.steps[2].latency_s = 0.004;
        let fit = bucket_fits(&[run], &costs, &costs, &[]);
        assert_eq!(fit[0].steps, 1);
        // The second decode: 1 token in the 5 ms since the prefill's results.
        assert!(
            (fit[0].measured - 200.0).abs() < 1e-6,
            "{}",
            fit[0].measured
        );
    }

    /// A verification of K drafts of one sequence carries K+1 rows and overlaps as steps of
    /// that many rows do, not as one-row decodes.
    #[test]
    fn a_verification_overlaps_as_its_rows_not_its_sequences() {
        let costs = [table(50, [10.0, 14.0])];
        let o = |rows, speedup| Overlap {
            rows,
            groups: 2,
            speedup,
        };
        let overlaps = [o(1, 2.0), o(5, 1.0)];
        let verify = WorkKind::Verify { k: 4 };
        assert_eq!(step_rows(&step(0.0, 2, verify)), 5);
        assert_eq!(step_rows(&step(0.0, 2, WorkKind::Decode)), 1);
        let fit = |kind| bucket_fits(&[two_steps(2, kind)], &costs, &costs, &overlaps)[0].overlap;
        assert_eq!(fit(WorkKind::Decode), 2.0);
        assert_eq!(fit(verify), 1.0);
    }
}
