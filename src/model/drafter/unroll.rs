//! Training-time test: a slice unrolled over `drafter.unroll` drafter steps, and the chain
//! acceptance that measures what it is for ([`Drafter::chain_acceptance`]).
//!
//! Why: a proposal feeds the drafter's own predicted hidden state forward, so from the second
//! draft on the drafter reads inputs it never saw in training (one-step training only ever
//! shows it the target's `h_t`), and the chain drifts. EAGLE-3's "training-time test" trains
//! on those inputs too. Step 1 of a slice is the one-step slice, unchanged. Step `j ≥ 2`
//! rewrites the same batch in place ([`Unroller::advance`]): the pair at position `t` becomes
//! `(f̂^{j−1}_t, x_{t+1})`, where `f̂^{j−1}_t` is step `j − 1`'s prediction of `h_t` made at
//! position `t − 1`: exactly the pair a proposal runs at depth `j`, with the row's true token
//! where a proposal has its own draft. The targets stay the target's `h_{t+1}` and `p_{t+1}`;
//! a pair counts at step `j` only when it is `j − 1` predictions deep (the `j − 1` pairs
//! before it are real ones), so every counted pair trains the depth it names.
//!
//! Two simplifications, both deliberate:
//! - The fed-back features are **detached** (data, as `h_t` is at step 1), as EAGLE-3's
//!   recurrence is in effect. Each step is then a whole forward, `backward_input`,
//!   `backward_weight` of its own (the split backward the filler relies on, and one step's
//!   stash at a time), and step 1 is not pushed to predict features that are easy to draft
//!   from rather than close to the target's.
//! - The causal context of a step-`j` pair is the step's other pairs, whose features are
//!   predictions too, where a proposal attends to the target's own pairs before the chain.
//!   The exact context needs a per-query attention mask (EAGLE-3's), which the backends'
//!   causal attention does not have; the query's own input, the drift that matters most, is
//!   the proposal's. A variant that fed predictions only along chains of `unroll` pairs from
//!   a real one (so the first chain of a window had the exact context) did worse on
//!   `pipefill bench rollout` (acceptance length 2.66 at K=4 with `unroll = 2`, against 3.07
//!   for this one and 2.82 without unrolling): fewer trained pairs per step.
//!
//! The unrolled losses are added to step 1's, per position (EAGLE-3 sums its steps' losses),
//! and the gradient is averaged over step 1's pairs, so [`super::SliceStats::pairs`] and
//! [`super::DrafterGrads::pairs`] still count the slice's next-token pairs.

use super::{DraftBatch, DraftRow, Drafter, DrafterError, Result};
use crate::data::SplitMix64;
use crate::tensor::Backend;

/// Rewrites a slice's batch into the batch of its next unrolled step.
pub(super) struct Unroller {
    /// Step 1's mask: which positions hold a real pair.
    first: Vec<bool>,
    d_model: usize,
}

impl Unroller {
    /// For `batch` as step 1 ran it.
    pub(super) fn new(batch: &DraftBatch, d_model: usize) -> Self {
        Unroller {
            first: batch.mask.clone(),
            d_model,
        }
    }

    /// Turns the batch of step `j − 1`, whose forward predicted `f: [rows, d_model]`, into the
    /// batch of step `j` (see the module docs); returns the pairs it counts.
    pub(super) fn advance(&self, batch: &mut DraftBatch, f: &[f32]) -> usize {
        let (d, seq) = (self.d_model, batch.seq);
        for b in 0..batch.batch {
            // From the end, so that position `p − 1`'s mask is still step `j − 1`'s.
            for p in (0..seq).rev() {
                let at = b * seq + p;
                let from = (p > 0 && self.first[at - 1]).then(|| at - 1);
                if let Some(prev) = from {
                    batch.inputs[at * 2 * d + d..(at + 1) * 2 * d]
                        .copy_from_slice(&f[prev * d..(prev + 1) * d]);
                }
                batch.mask[at] = self.first[at] && from.is_some_and(|prev| batch.mask[prev]);
            }
        }
        batch.pairs()
    }
}

/// Greedy chain acceptance of a drafter's proposals along rows (see
/// [`Drafter::chain_acceptance`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ChainStats {
    /// Proposals made.
    pub proposals: usize,
    /// `accepted[j]`: proposals whose first `j + 1` drafts all equal the row's next tokens.
    pub accepted: Vec<usize>,
}

impl ChainStats {
    /// Mean tokens a greedy verification emits per proposal: accepted drafts + the bonus token.
    pub fn acceptance_length(&self) -> f64 {
        let accepted: usize = self.accepted.iter().sum();
        1.0 + accepted as f64 / self.proposals.max(1) as f64
    }

    /// The chance that draft `depth` (from 1) is accepted given that the ones before it were.
    pub fn conditional(&self, depth: usize) -> f64 {
        let before = match depth {
            0 => return f64::NAN,
            1 => self.proposals,
            _ => self.accepted[depth - 2],
        };
        self.accepted[depth - 1] as f64 / before.max(1) as f64
    }
}

impl<B: Backend> Drafter<B> {
    /// Drafts `k` tokens greedily after every position `t` of each row (context: the row's
    /// pairs up to `t`, cut to `window` as a proposal cuts it) that has `k` known tokens after
    /// it, and counts how deep each chain matches the row's own next tokens. On rows that are
    /// the target's greedy generations (a rollout's rows at temperature 0) those are the
    /// target's greedy tokens, so this is what greedy verification would accept.
    pub fn chain_acceptance(&mut self, rows: &[DraftRow], k: usize) -> Result<ChainStats> {
        let (d, v) = (self.target.d_model, self.target.vocab);
        if k == 0 {
            return Err(DrafterError::Input {
                what: "chain acceptance",
                reason: "k must be at least 1".into(),
            });
        }
        let mut stats = ChainStats {
            proposals: 0,
            accepted: vec![0; k],
        };
        let mut rng = SplitMix64::new(0);
        for row in rows {
            row.check(d, v)?;
            // Position t's chain predicts targets[t + 1 ..= t + k].
            for t in 0..row.len().saturating_sub(k) {
                let next = &row.targets[t + 1..=t + k];
                if row.targets[..=t]
                    .iter()
                    .chain(next)
                    .any(|&x| x as usize >= v)
                {
                    continue;
                }
                let ctx = super::DraftContext {
                    hidden: &row.hidden[..(t + 1) * d],
                    tokens: &row.targets[..=t],
                };
                let chain = self.propose(&[ctx], k, 0.0, &mut rng)?;
                stats.proposals += 1;
                let depth = chain[0].tokens.iter().zip(next).take_while(|(a, b)| a == b);
                for (j, _) in depth.enumerate() {
                    stats.accepted[j] += 1;
                }
            }
        }
        Ok(stats)
    }
}
