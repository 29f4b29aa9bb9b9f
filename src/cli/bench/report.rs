//! What `bench rollout` prints once it has measured: the medians of each mode's runs, the
//! speedups against the plain runs interleaved with them, and the figures that explain
//! them (step costs, per-bucket fits), as a table or as one JSON object (`--json`).

use pipefill::model::drafter::TreeShape;
use pipefill::profile::report::median;
use pipefill::rl::calibrate::StepCost;
use pipefill::rl::rollout::{AdaptiveConfig, RolloutOutput};
use serde_json::json;

use super::PLAIN_ARM_KS;
use super::costs::{BucketFit, CostsAt};

/// An adaptive variant's runs: its name, its threshold, the plain runs interleaved with
/// it, and its own.
pub(super) struct Variant {
    pub name: &'static str,
    pub threshold: usize,
    pub plain: Vec<RolloutOutput>,
    pub runs: Vec<RolloutOutput>,
}

/// The draft tree's mode and its step costs at one sequence per group.
pub(super) struct TreeFigures<'a> {
    /// As given (`--tree`).
    pub arg: &'a str,
    pub shape: TreeShape,
    pub plain: &'a [RolloutOutput],
    pub runs: &'a [RolloutOutput],
    pub acceptance: f64,
    pub verify_ms: f64,
    pub propose_ms: f64,
    pub rows: usize,
}

/// Everything the report shows.
pub(super) struct Report<'a> {
    pub device: String,
    pub requests: usize,
    pub reps: usize,
    /// K of the fixed-K mode.
    pub k: usize,
    /// The plain runs interleaved with the fixed-K ones, and those.
    pub plain: &'a [RolloutOutput],
    pub fixed: &'a [RolloutOutput],
    pub fixed_acceptance: f64,
    pub tree: TreeFigures<'a>,
    /// The headline variant first ([`super::HEADLINE`] indexes them).
    pub variants: &'a [Variant],
    pub median_len: f64,
    pub max_len: usize,
    /// The drafter's top-1 agreement on the measured batch and on its own rows.
    pub agreement: (f64, f64),
    pub plain_fits: &'a [BucketFit],
    pub fixed_fits: &'a [BucketFit],
    pub threshold: usize,
    pub engine_threshold: usize,
    pub propose_ms: f64,
    pub costs: &'a [StepCost],
    pub bucket_costs: &'a [CostsAt],
    pub median_costs: &'a [CostsAt],
}

/// The median of `f` over `rs`.
fn m<'a>(
    rs: impl IntoIterator<Item = &'a RolloutOutput>,
    f: impl Fn(&RolloutOutput) -> f64,
) -> f64 {
    median(rs.into_iter().map(f))
}
fn tps(r: &RolloutOutput) -> f64 {
    r.stats.tokens_per_s()
}
fn tail(r: &RolloutOutput) -> f64 {
    r.stats.tail_tokens_per_s()
}
fn tail_s(r: &RolloutOutput) -> f64 {
    r.stats.seconds - r.stats.tail_start_s
}
fn acc(r: &RolloutOutput) -> f64 {
    r.stats.acceptance_length()
}
fn secs(r: &RolloutOutput) -> f64 {
    r.stats.seconds
}
/// Driver time per verification spent drafting: what a speculative round pays on top of
/// the target's verification pass.
fn propose_round_ms(r: &RolloutOutput) -> f64 {
    1e3 * r.stats.propose_s / (r.stats.verifications.max(1) as f64)
}

impl Report<'_> {
    /// Prints the report (`json`: one object on stdout) and says whether every speculative
    /// run produced the plain runs' greedy tokens.
    pub fn print(&self, json: bool) -> bool {
        let headline = &self.variants[super::HEADLINE];
        // Every variant's plain runs, borrowed.
        let plain = || self.variants.iter().flat_map(|v| &v.plain);
        let adapt = &headline.runs;
        let (fixed, fixed_tree) = (self.fixed, self.tree.runs);
        let reference = plain().next().expect("reps ≥ 1");
        let identical = fixed
            .iter()
            .chain(fixed_tree)
            .chain(self.variants.iter().flat_map(|v| &v.runs))
            .all(|r| r.sequences == reference.sequences);
        // Each variant against the plain runs interleaved with it (the same drift).
        let speedups: Vec<f64> = self
            .variants
            .iter()
            .map(|v| m(&v.runs, tail) / m(&v.plain, tail))
            .collect();
        let speedup = speedups[super::HEADLINE];
        let fixed_speedup = m(fixed, tail) / m(self.plain, tail);
        let tree_speedup = m(fixed_tree, tail) / m(self.tree.plain, tail);
        let last = adapt.last().expect("reps ≥ 1");
        let mut ks: Vec<(usize, usize)> = Vec::new();
        for c in &last.choices {
            match ks.iter_mut().find(|(k, _)| *k == c.k) {
                Some(e) => e.1 += 1,
                None => ks.push((c.k, 1)),
            }
        }
        ks.sort();
        let t = &self.tree;
        if json {
            let figures = json!({
                "device": self.device,
                "plain_tokens_per_s": m(plain(), tail),
                "fixed_tokens_per_s": m(fixed, tail),
                "adaptive_tokens_per_s": m(adapt, tail),
                "speedup": speedup,
                "acceptance_length": m(adapt, acc),
                "fixed_acceptance_length": self.fixed_acceptance,
                "fixed_speedup": fixed_speedup,
                "tree": json!({
                    "shape": [t.shape.depth, t.shape.branch, t.shape.width, t.shape.nodes],
                    "fixed_tokens_per_s": m(fixed_tree, tail),
                    "fixed_speedup": tree_speedup,
                    "acceptance_length": t.acceptance,
                    "verify_ms": t.verify_ms,
                    "propose_ms": t.propose_ms,
                    "rows": t.rows,
                }),
                "plain_overall_tokens_per_s": m(plain(), tps),
                "adaptive_overall_tokens_per_s": m(adapt, tps),
                "overall_speedup": m(adapt, tps) / m(plain(), tps),
                "plain_tail_s": m(plain(), tail_s),
                "plain_tail_share": m(plain(), RolloutOutput::tail_share),
                "completion_lengths": json!({"median": self.median_len, "max": self.max_len}),
                "drafter_agreement": json!({
                    "held_out": self.agreement.0,
                    "own_rows": self.agreement.1,
                }),
                "buckets": json!({"plain": self.plain_fits, "fixed": self.fixed_fits}),
                "adaptive_tail_s": m(adapt, tail_s),
                "adaptive_mode": headline.name,
                "variants": self.variants.iter().zip(&speedups).map(|(v, s)| json!({
                    "mode": v.name,
                    "threshold": v.threshold,
                    "tokens_per_s": m(&v.runs, tail),
                    "speedup": s,
                    "acceptance_length": m(&v.runs, acc),
                })).collect::<Vec<_>>(),
                "threshold": self.threshold,
                "engine_threshold": self.engine_threshold,
                "propose_ms": self.propose_ms,
                "fixed_propose_ms_per_verification": m(fixed, propose_round_ms),
                "step_costs": self.costs,
                "bucket_step_costs": self.bucket_costs,
                "median_step_costs": self.median_costs,
                "k_choices": ks,
                "identical_outputs": identical,
                "requests": self.requests,
                "reps": self.reps,
            });
            println!("{figures}");
            return identical;
        }
        println!(
            "{:<10} {:>9} {:>11} {:>10} {:>8} {:>10}",
            "mode", "total s", "tokens/s", "tail tok/s", "tail s", "accept len"
        );
        let table: Vec<(&str, Vec<&RolloutOutput>)> = [
            ("plain", plain().collect()),
            ("fixed K", fixed.iter().collect()),
            ("fixed tree", fixed_tree.iter().collect()),
        ]
        .into_iter()
        .chain(
            self.variants
                .iter()
                .map(|v| (v.name, v.runs.iter().collect())),
        )
        .collect();
        for (name, rs) in &table {
            let rs = || rs.iter().copied();
            println!(
                "{name:<10} {:>9.3} {:>11.1} {:>10.1} {:>8.3} {:>10.2}",
                m(rs(), secs),
                m(rs(), tps),
                m(rs(), tail),
                m(rs(), tail_s),
                m(rs(), acc)
            );
        }
        println!(
            "long-tail speedup fixed K={}/plain: {fixed_speedup:.2}x; fixed tree {}/plain: \
             {tree_speedup:.2}x",
            self.k, t.arg
        );
        for (v, s) in self.variants.iter().zip(&speedups) {
            println!(
                "long-tail speedup {}/plain: {s:.2}x (live ≤ {}, arms {:?})",
                v.name,
                v.threshold,
                match v.name {
                    "K=0 arm" => PLAIN_ARM_KS.to_vec(),
                    _ => AdaptiveConfig::default().ks,
                }
            );
        }
        println!(
            "long-tail speedup adaptive/plain: {speedup:.2}x ({}; medians of {} runs)",
            headline.name, self.reps
        );
        println!(
            "drafting inside the rollout, fixed K={}: {:.3} ms per sequence verified (alone: {:.3} ms)",
            self.k,
            m(fixed, propose_round_ms),
            self.propose_ms
        );
        println!(
            "the longest 10% of sequences take {:.0}% of the plain rollout's time (median of {} runs)",
            100.0 * m(plain(), RolloutOutput::tail_share),
            plain().count()
        );
        println!("adaptive K choices (last run, K: count): {ks:?}");
        println!("greedy outputs identical across modes: {identical}");
        identical
    }
}
