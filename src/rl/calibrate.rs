//! What a speculative step costs against a plain one, measured on the actual target and
//! drafter, and the live-batch threshold that follows: `pipefill rl` calibrates with it at
//! start-up (`rl.spec_threshold = "auto"`), `pipefill bench rollout` prints it. One copy of
//! the measurement, so that the bench's figures are the ones the trainer acts on.
//!
//! Per sequences in one group `b` = 1, 2, 4, …: the target's decode step, its verification
//! of K+1 positions and the drafter's proposal of K tokens, timed alone on one thread and
//! on the whole target (a group in the long tail passes the stages one after another, so
//! their costs add up), each the fastest of a few repetitions timed in turn. A chain of K
//! pays at `b` while `acceptance(K) × decode(b) > propose(K, b) + verify(K, b)`; the
//! threshold per group is the largest `b` up to which some K pays at every measured size,
//! and the engine's is the live batch up to which its groups stay that small (it merges
//! small groups: [`crate::rl::rollout::live_threshold`]). The acceptance of a chain of K
//! follows from the drafter's per-token acceptance α (its held-out `Σ min(p, q)`, measured
//! every step) as `1 + α + … + α^K`.

use std::time::Instant;

use serde::Serialize;

use crate::data::SplitMix64;
use crate::model::drafter::{DraftContext, Drafter, TreeShape};
use crate::model::infer::{InferStage, Span, StageInput, StageOutput, TreeStep, run_stages};
use crate::model::{Cut, Gpt};
use crate::rl::RlError;
use crate::tensor::Backend;

/// Largest group size the step costs are measured for.
pub const MAX_CALIBRATION_BATCH: usize = 32;
/// The context `pipefill rl`'s calibration times its steps at: the drafter's context and
/// the target's cache, in positions.
pub const COST_PAST: usize = 32;

/// What one step of a group of `batch` sequences costs, in milliseconds, drafting `k`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StepCost {
    pub batch: usize,
    pub k: usize,
    pub decode_ms: f64,
    pub verify_ms: f64,
    pub propose_ms: f64,
}

impl StepCost {
    /// Whether a speculative step (proposal + verification, `acceptance` tokens per
    /// sequence) emits tokens faster than plain decode steps (one token each).
    pub fn pays(&self, acceptance: f64) -> bool {
        acceptance * self.decode_ms > self.propose_ms + self.verify_ms
    }
}

/// Tokens a verification of a chain of `k` emits on average when each draft token is
/// accepted with probability `alpha` (given the ones before it were): `1 + α + … + α^k`.
pub fn chain_acceptance(alpha: f64, k: usize) -> f64 {
    let a = alpha.clamp(0.0, 1.0);
    (0..=k).map(|j| a.powi(j as i32)).sum()
}

/// Step costs for groups of 1, 2, 4, … up to `max_b` sequences and every draft length in
/// `ks` (ascending by batch, then by `ks`' order), each the fastest of `reps`: the whole
/// `model` on one thread decoding one position per sequence and verifying K+1, resuming
/// a prefilled cache as long as `ctx` (the attention over the cache grows with it: a long
/// tail decodes far into its sequences); and `drafter` proposing K tokens for `batch`
/// copies of `ctx`. The decode cost is measured once per size and shared by its entries.
pub fn step_costs<B: Backend>(
    model: &Gpt<B>,
    drafter: &mut Drafter<B>,
    ctx: DraftContext<'_>,
    ks: &[usize],
    max_b: usize,
    reps: usize,
) -> Result<Vec<StepCost>, RlError> {
    let timed = step_cost_reps(model, drafter, ctx, ks, max_b, reps)?;
    Ok(timed.iter().map(|t| t.cost(fastest)).collect())
}

/// The fastest of a cost's repetitions (what it costs when nothing else runs).
pub fn fastest(times: &[f64]) -> f64 {
    times.iter().copied().fold(f64::MAX, f64::min)
}

/// Every repetition of one entry of [`step_costs`], in milliseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct StepCostReps {
    pub batch: usize,
    pub k: usize,
    pub decode_ms: Vec<f64>,
    pub verify_ms: Vec<f64>,
    pub propose_ms: Vec<f64>,
}

impl StepCostReps {
    /// The entry's cost with each time summarised by `pick` over its repetitions (the
    /// fastest for [`step_costs`]).
    pub fn cost(&self, pick: impl Fn(&[f64]) -> f64) -> StepCost {
        StepCost {
            batch: self.batch,
            k: self.k,
            decode_ms: pick(&self.decode_ms),
            verify_ms: pick(&self.verify_ms),
            propose_ms: pick(&self.propose_ms),
        }
    }
}

/// [`step_costs`]' measurement with every repetition kept, so that one measurement gives
/// the fastest and, say, the median.
pub fn step_cost_reps<B: Backend>(
    model: &Gpt<B>,
    drafter: &mut Drafter<B>,
    ctx: DraftContext<'_>,
    ks: &[usize],
    max_b: usize,
    reps: usize,
) -> Result<Vec<StepCostReps>, RlError> {
    let k_max = ks.iter().copied().max().unwrap_or(0);
    if k_max == 0 || ks.contains(&0) || reps == 0 {
        return Err(RlError::CalibrationInput(format!(
            "draft lengths {ks:?} and {reps} repetitions: need K ≥ 1 and at least one repetition"
        )));
    }
    let past = (ctx.tokens.len().max(1)).min(model.config().seq_len.saturating_sub(k_max + 1));
    let mut stages = InferStage::stages_of(model, &Cut::Even(1))?;
    let mut rng = SplitMix64::new(1);
    let ms = |f: &mut dyn FnMut() -> Result<(), RlError>| {
        let s = Instant::now();
        f().map(|()| s.elapsed().as_secs_f64() * 1e3)
    };
    let mut out = Vec::new();
    let mut b = 1;
    while b <= max_b.max(1) {
        let ids = vec![5u32; b * (past + k_max + 1)];
        run_stages(&mut stages, &Span::each(b, 0, past + k_max + 1), &ids)?;
        let contexts = vec![ctx; b];
        // Timed in turn, so that a burst of other work on a shared box hits them alike: the
        // threshold takes each one's least-disturbed time, since it needs every smaller size
        // to pay, and one inflated verification would cut it.
        let mut decode_ms = Vec::with_capacity(reps);
        let (mut verify_ms, mut propose_ms) =
            (vec![Vec::new(); ks.len()], vec![Vec::new(); ks.len()]);
        for _ in 0..reps {
            decode_ms.push(ms(&mut || {
                run_stages(&mut stages, &Span::each(b, past, 1), &ids[..b])?;
                Ok(())
            })?);
            for (i, &k) in ks.iter().enumerate() {
                verify_ms[i].push(ms(&mut || {
                    run_stages(
                        &mut stages,
                        &Span::each(b, past, k + 1),
                        &ids[..b * (k + 1)],
                    )?;
                    Ok(())
                })?);
                propose_ms[i].push(ms(&mut || {
                    drafter.propose(&contexts, k, 0.0, &mut rng)?;
                    Ok(())
                })?);
            }
        }
        out.extend((ks.iter().zip(verify_ms).zip(propose_ms)).map(
            |((&k, verify_ms), propose_ms)| StepCostReps {
                batch: b,
                k,
                decode_ms: decode_ms.clone(),
                verify_ms,
                propose_ms,
            },
        ));
        b *= 2;
    }
    Ok(out)
}

/// The largest group size up to which speculation pays at every measured size, with some
/// K at each (0: it does not pay even for one sequence), `acceptance(k)` tokens per
/// verification of a chain of `k`. Between measured sizes the smaller one decides.
pub fn threshold_per_group(costs: &[StepCost], acceptance: impl Fn(usize) -> f64) -> usize {
    largest_paying(costs, |b| {
        costs
            .iter()
            .any(|c| c.batch == b && c.pays(acceptance(c.k)))
    })
}

/// [`threshold_per_group`] for an epsilon-greedy bandit over the measured draft lengths
/// (and a plain arm, K = 0, with `rl.advanced.plain_arm`): at a size, the bandit mostly takes the best
/// arm but a fraction `epsilon` of its steps go to an arm drawn at random, which at a size
/// where only a short draft barely pays can cost more than the best arm saves. Speculation
/// pays there when that mix emits tokens faster than plain decoding: `Σ p_a L_a / Σ p_a
/// c_a > 1 / decode`, `p_a` the arm's share of steps, `L_a` its tokens per sequence and
/// `c_a` its cost (plain: 1 token for a decode).
pub fn threshold_per_group_explored(
    costs: &[StepCost],
    acceptance: impl Fn(usize) -> f64,
    epsilon: f64,
    plain_arm: bool,
) -> usize {
    largest_paying(costs, |b| {
        let at: Vec<&StepCost> = costs.iter().filter(|c| c.batch == b).collect();
        let Some(decode) = at.first().map(|c| c.decode_ms) else {
            return false;
        };
        // (tokens, cost) of every arm.
        let mut arms: Vec<(f64, f64)> = at
            .iter()
            .map(|c| (acceptance(c.k), c.propose_ms + c.verify_ms))
            .collect();
        if plain_arm {
            arms.push((1.0, decode));
        }
        let rate = |&(l, c): &(f64, f64)| l / c;
        let Some(best) = (0..arms.len()).max_by(|&i, &j| rate(&arms[i]).total_cmp(&rate(&arms[j])))
        else {
            return false;
        };
        let e = epsilon.clamp(0.0, 1.0);
        let share = |i: usize| e / arms.len() as f64 + if i == best { 1.0 - e } else { 0.0 };
        let tokens: f64 = (0..arms.len()).map(|i| share(i) * arms[i].0).sum();
        let cost: f64 = (0..arms.len()).map(|i| share(i) * arms[i].1).sum();
        tokens / cost > 1.0 / decode
    })
}

/// The largest group size up to which `pays` holds at every measured size of `costs`.
fn largest_paying(costs: &[StepCost], pays: impl Fn(usize) -> bool) -> usize {
    let mut sizes: Vec<usize> = costs.iter().map(|c| c.batch).collect();
    sizes.dedup();
    let mut best = 0;
    for (i, &b) in sizes.iter().enumerate() {
        if !pays(b) {
            break;
        }
        // Paying at `b` and at the next measured size covers the sizes between.
        best = match sizes.get(i + 1) {
            Some(&next) if pays(next) => next - 1,
            _ => b,
        };
    }
    best
}

/// A drafter context of `n` positions for timing proposals (its values do not change the
/// work): deterministic pseudo-random hidden states of width `d` and tokens below `vocab`.
pub fn timing_context(n: usize, d: usize, vocab: usize) -> (Vec<f32>, Vec<u32>) {
    let mut rng = SplitMix64::new(0xca1b);
    let hidden = (0..n * d).map(|_| rng.next_f64() as f32 - 0.5).collect();
    let tokens = (0..n).map(|i| (i % vocab.max(1)) as u32).collect();
    (hidden, tokens)
}

/// The step costs `pipefill rl` measured on its policy and drafter, and the groups in
/// flight that turn a threshold per group into the engine's.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    pub costs: Vec<StepCost>,
    pub groups: usize,
    /// Fewest positions a group step carries (`rl.advanced.min_group_rows`): the engine merges
    /// groups below it.
    pub min_group_rows: usize,
    /// Repetitions per cost (the fastest kept).
    pub reps: usize,
    /// Wall time the measurement took.
    pub seconds: f64,
}

impl Calibration {
    /// Measures `model` and `drafter` for the draft lengths `ks` and groups of up to
    /// `sequences / groups` (at most [`MAX_CALIBRATION_BATCH`]).
    pub fn measure<B: Backend>(
        model: &Gpt<B>,
        drafter: &mut Drafter<B>,
        ks: &[usize],
        sequences: usize,
        groups: usize,
        min_group_rows: usize,
        reps: usize,
    ) -> Result<Self, RlError> {
        let started = Instant::now();
        let c = model.config();
        let (hidden, tokens) = timing_context(COST_PAST, c.d_model, c.vocab);
        let ctx = DraftContext {
            hidden: &hidden,
            tokens: &tokens,
        };
        let groups = groups.max(1);
        let max_b = sequences.div_ceil(groups).clamp(1, MAX_CALIBRATION_BATCH);
        let costs = step_costs(model, drafter, ctx, ks, max_b, reps)?;
        Ok(Calibration {
            costs,
            groups,
            min_group_rows,
            reps,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// The engine's threshold (live sequences) at per-token acceptance `alpha`, for a
    /// bandit over the measured draft lengths (and plain steps with `rl.advanced.plain_arm`) exploring
    /// with probability `epsilon` ([`threshold_per_group_explored`]).
    pub fn threshold(&self, alpha: f64, epsilon: f64, plain_arm: bool) -> usize {
        let accept = |k| chain_acceptance(alpha, k);
        let per_group = threshold_per_group_explored(&self.costs, accept, epsilon, plain_arm);
        // The engine merges small groups: its live threshold for `per_group` per group.
        let k_max = self.costs.iter().map(|c| c.k).max().unwrap_or(0);
        crate::rl::rollout::live_threshold(
            per_group,
            (k_max + 1) as f64,
            self.groups,
            self.min_group_rows,
        )
    }

    /// Whether speculation could pay at all: with every draft token accepted, for one
    /// sequence per group. When not, no drafter can make it pay on this target.
    pub fn can_pay(&self) -> bool {
        threshold_per_group(&self.costs, |k| (k + 1) as f64) > 0
    }

    /// The costs in one line: per group size, decode and the verification and proposal of
    /// the longest draft, in milliseconds.
    pub fn summary(&self) -> String {
        let k_max = self.costs.iter().map(|c| c.k).max().unwrap_or(0);
        let sizes: Vec<String> = (self.costs.iter().filter(|c| c.k == k_max))
            .map(|c| {
                format!(
                    "b={} {:.2}/{:.2}/{:.2}",
                    c.batch, c.decode_ms, c.verify_ms, c.propose_ms
                )
            })
            .collect();
        format!(
            "decode/verify K+1={}/propose K={k_max} ms per group of b: {}",
            k_max + 1,
            sizes.join(", ")
        )
    }
}

/// What a draft-tree step of one sequence costs (one thread, fastest of `reps`): the
/// target verifying the tree the drafter proposes for `ctx` (its nodes + 1 rows, with tree
/// attention, resuming at [`COST_PAST`]), and that proposal. `(verify_ms, propose_ms,
/// rows)`.
pub fn tree_cost<B: Backend>(
    model: &Gpt<B>,
    drafter: &mut Drafter<B>,
    ctx: DraftContext<'_>,
    shape: &TreeShape,
    reps: usize,
) -> Result<(f64, f64, usize), RlError> {
    let ctx = [ctx];
    let tree = drafter.propose_tree(&ctx, shape, 0.0)?.remove(0);
    let rows = tree.len() + 1;
    let past = COST_PAST.min(model.config().seq_len.saturating_sub(rows));
    let mut stages = InferStage::stages_of(model, &Cut::Even(1))?;
    let prefill = [Span {
        slot: 0,
        start: 0,
        len: past,
    }];
    run_stages(&mut stages, &prefill, &vec![5u32; past])?;
    let span = [Span {
        slot: 0,
        start: past,
        len: rows,
    }];
    let step = TreeStep {
        parents: vec![Some(tree.row_parents())],
        compact: Vec::new(),
    };
    let mut ids = vec![5u32];
    ids.extend_from_slice(&tree.tokens);
    let (mut verify_ms, mut propose_ms) = (f64::MAX, f64::MAX);
    for _ in 0..reps.max(1) {
        let s = Instant::now();
        let mut input = StageInput::Tokens(&ids);
        for stage in stages.iter_mut() {
            match stage.forward_with(&span, Some(&step), input)? {
                StageOutput::Hidden(h) => input = StageInput::Hidden(h),
                StageOutput::Final { .. } => break,
            }
        }
        verify_ms = verify_ms.min(s.elapsed().as_secs_f64() * 1e3);
        let s = Instant::now();
        drafter.propose_tree(&ctx, shape, 0.0)?;
        propose_ms = propose_ms.min(s.elapsed().as_secs_f64() * 1e3);
    }
    Ok((verify_ms, propose_ms, rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Costs at group sizes 1, 2, 4, 8 for K = 1 and 4: decode 1 ms plus 0.25 ms per
    /// sequence, verification `verify_x` of a decode per drafted position (growing with the
    /// group: compute-bound at larger sizes), proposal `propose_ms` per drafted token.
    fn costs(verify_x: f64, propose_ms: f64) -> Vec<StepCost> {
        [1, 2, 4, 8]
            .into_iter()
            .flat_map(|b| {
                let decode = 1.0 + 0.25 * b as f64;
                [1, 4].map(|k| StepCost {
                    batch: b,
                    k,
                    decode_ms: decode,
                    verify_ms: decode * (1.0 + verify_x * k as f64 * (b as f64).sqrt()),
                    propose_ms: propose_ms * k as f64,
                })
            })
            .collect()
    }

    /// One measured cost with a 1 ms decode: the hand-built cases below.
    fn unit_decode(batch: usize, k: usize, verify_ms: f64, propose_ms: f64) -> StepCost {
        StepCost {
            batch,
            k,
            decode_ms: 1.0,
            verify_ms,
            propose_ms,
        }
    }

    #[test]
    fn chain_acceptance_is_the_geometric_sum() {
        assert_eq!(chain_acceptance(0.0, 4), 1.0);
        assert_eq!(chain_acceptance(1.0, 4), 5.0);
        assert!((chain_acceptance(0.5, 2) - 1.75).abs() < 1e-12);
        assert_eq!(chain_acceptance(1.7, 1), 2.0, "clamped to a probability");
    }

    #[test]
    fn expensive_verification_gives_zero_and_cheap_a_positive_threshold() {
        let accept = |k: usize| chain_acceptance(0.8, k);
        // Verifying one extra position costs as much as a whole decode step: never pays.
        assert_eq!(threshold_per_group(&costs(1.0, 0.05), accept), 0);
        // Nearly free verification (memory-bound): pays at every measured size.
        assert_eq!(threshold_per_group(&costs(0.02, 0.01), accept), 8);
        // In between: pays for small groups only, and only up to the first size that loses.
        // (b = 2: 2.70 ms of decodes against 2.56 + 0.02; b = 4: 3.60 against 4.0 + 0.02.)
        assert_eq!(threshold_per_group(&costs(0.5, 0.02), accept), 2);
        // A useless drafter (α = 0) never pays, however cheap the verification.
        assert_eq!(threshold_per_group(&costs(0.02, 0.01), |_| 1.0), 0);
    }

    #[test]
    fn some_k_paying_is_enough_and_the_threshold_stops_at_the_first_loss() {
        let c = |batch, k, verify_ms| unit_decode(batch, k, verify_ms, 0.1);
        let accept = |k: usize| chain_acceptance(0.5, k);
        // b = 1: K = 4 loses (3.0 > 1.94) but K = 1 pays (1.2 < 1.5); b = 2 pays; b = 4
        // loses; b = 8 would pay but the threshold has stopped.
        let costs = [
            c(1, 1, 1.1),
            c(1, 4, 2.9),
            c(2, 1, 1.2),
            c(2, 4, 3.0),
            c(4, 1, 1.6),
            c(4, 4, 3.0),
            c(8, 1, 1.0),
            c(8, 4, 1.0),
        ];
        // Pays at 1 and 2, loses at 4: 2 (3 lies between a paying and a losing size).
        assert_eq!(threshold_per_group(&costs, accept), 2);
        let cal = Calibration {
            costs: costs.to_vec(),
            groups: 4,
            min_group_rows: crate::rl::rollout::MIN_GROUP_ROWS,
            reps: 1,
            seconds: 0.0,
        };
        // Two per group; verifying K+1 = 5 rows each, the engine keeps one group until
        // the live batch fills two of MIN_GROUP_ROWS: at most two live.
        let engine =
            crate::rl::rollout::live_threshold(2, 5.0, 4, crate::rl::rollout::MIN_GROUP_ROWS);
        assert_eq!(engine, 2, "one group of two");
        assert_eq!(cal.threshold(0.5, 0.0, true), engine);
        assert_eq!(cal.threshold(0.0, 0.0, true), 0);
        // Never merging (`rl.advanced.min_group_rows = 1`): two per group in each of four groups.
        let split = Calibration {
            min_group_rows: 1,
            ..cal.clone()
        };
        assert_eq!(split.threshold(0.5, 0.0, true), 8);
        assert!(cal.can_pay());
        let hopeless = Calibration {
            costs: vec![c(1, 1, 5.0), c(1, 4, 9.0)],
            ..cal
        };
        assert!(!hopeless.can_pay(), "not even with every token accepted");
    }

    #[test]
    fn exploration_that_costs_more_than_the_best_arm_saves_turns_a_size_off() {
        let c = |batch, k, verify_ms| unit_decode(batch, k, verify_ms, 0.0);
        let accept = |k: usize| chain_acceptance(0.5, k);
        // b = 1: K = 1 and K = 4 both pay well. b = 2: K = 1 barely pays (1.5 tokens for
        // 1.4 ms) and K = 4 costs 4 decodes for 1.94 tokens.
        let costs = [c(1, 1, 1.1), c(1, 4, 1.2), c(2, 1, 1.4), c(2, 4, 4.0)];
        assert_eq!(threshold_per_group(&costs, accept), 2);
        // Never exploring, the bandit keeps K = 1 at b = 2: it pays.
        assert_eq!(threshold_per_group_explored(&costs, accept, 0.0, true), 2);
        // Exploring a third of the time, the draws of K = 4 cost more than K = 1 saves.
        assert_eq!(threshold_per_group_explored(&costs, accept, 0.34, true), 1);
        // A plain arm's draws cost no more than plain decoding, so the same exploration
        // hurts less with one: at ε = 0.1, b = 2 still pays with it and not without.
        assert_eq!(threshold_per_group_explored(&costs, accept, 0.1, true), 2);
        assert_eq!(threshold_per_group_explored(&costs, accept, 0.1, false), 1);
    }
}
