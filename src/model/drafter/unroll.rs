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
//! The fed-back features are **detached** (data, as `h_t` is at step 1), as EAGLE-3's
//! recurrence is in effect, so step 1 is not pushed to predict features that are easy to draft
//! from rather than close to the target's. What a step's pairs attend to is
//! [`super::UnrollContext`]:
//! - `causal` (the default): the step's own other pairs, whose features are predictions too,
//!   where a proposal attends to the target's pairs before its chain; each step is a whole
//!   forward and backward of its own through the backends' causal attention, one step's
//!   stash at a time.
//! - `exact`: every query attends to its exact proposal context ([`super::masked`]): the
//!   target's real pairs before its chain (whose keys and values are constants to the
//!   unrolled steps), then its own chain's pairs, the keys and values of the earlier steps
//!   included, so the steps run forward one after the other and backward together, last to
//!   first ([`Drafter::unrolled_slice`]), every step's stash kept until then.
//!
//! Neither wins everywhere (`cargo bench --bench chain`, greedy chains in the training
//! rows' completions, and `pipefill bench rollout`): `exact` did better on one target and
//! not on another, and before the gradient into the real pairs' keys and values was stopped
//! (now always, see `drafter/masked.rs`) its first draft could collapse, so `causal` stays
//! the default until `pipefill bench rollout` says otherwise (docs/benchmarks.md,
//! "Training-time test: causal or exact context"). A variant that fed predictions only
//! along chains of `unroll` pairs from a real one did worse still.
//!
//! The unrolled losses are added to step 1's, per position (EAGLE-3 sums its steps' losses),
//! step `j`'s weighted `unroll_decay^(j−1)`, and the gradient is averaged over step 1's
//! pairs, so [`super::SliceStats::pairs`] and [`super::DrafterGrads::pairs`] still count the
//! slice's next-token pairs.

use super::masked::ChainAttention;
use super::net::LossSums;
use super::{DraftBatch, DraftRow, Drafter, Result};
use crate::data::SplitMix64;
use crate::model::ModelError;
use crate::model::layers::Layer;
use crate::model::layers::{activation, gradient, linear_bwd_input, linear_bwd_weight, linear_fwd};
use crate::tensor::{Backend, DType};

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

/// One unrolled step's forward: what its backward needs besides the layers' stashes, and its
/// outputs.
pub(super) struct UnrolledStep<B: Backend> {
    /// The attention's input (after `norm1`).
    a: B::Buf,
    /// The attention's output, before `wo`.
    o: B::Buf,
    /// The loss's gradient w.r.t. the step's predicted hidden states.
    df: B::Buf,
    /// The predicted hidden states `[rows, d_model]`.
    pub(super) f: B::Buf,
    pub(super) sums: LossSums,
}

impl<B: Backend> Drafter<B> {
    /// A slice of up to `steps` unrolled steps on `batch` (step 1 as laid out; the others
    /// rewrite it, see the module docs), forward then backward, the gradients accumulated
    /// into the parameters: step 1's loss sums and the pairs the later steps counted. On an
    /// error nothing stays stashed.
    pub(super) fn unrolled_slice(
        &mut self,
        batch: &mut DraftBatch,
        steps: usize,
    ) -> Result<(LossSums, usize)> {
        if let Some(reason) = self.config().unsupported_for(&self.target) {
            return Err(ModelError::DrafterConfig {
                field: "unroll_context",
                reason: reason.into(),
            });
        }
        let heads = self.target.heads;
        let mut chain =
            ChainAttention::new(batch.batch, batch.seq, heads, self.target.d_model / heads);
        let result = self
            .unrolled_forward(batch, steps, &mut chain)
            .and_then(|out| self.unrolled_backward(&out, &mut chain).map(|()| out));
        match result {
            Ok(out) => {
                let unrolled = out[1..].iter().map(|s| s.sums.pairs).sum();
                Ok((out[0].sums, unrolled))
            }
            Err(e) => {
                (0..steps).for_each(|s| self.discard(s));
                Err(e)
            }
        }
    }

    /// The forward of up to `steps` unrolled steps (micro-batch `s` for step `s + 1`), each
    /// with its loss's gradient; stops early when no pair is that many predictions deep.
    pub(super) fn unrolled_forward(
        &mut self,
        batch: &mut DraftBatch,
        steps: usize,
        chain: &mut ChainAttention,
    ) -> Result<Vec<UnrolledStep<B>>> {
        let be = self.be.clone();
        let (d, rows, shape) = (self.target.d_model, batch.rows(), batch.shape());
        batch.check_inputs(d)?;
        let unroller = Unroller::new(batch, d);
        let mut out: Vec<UnrolledStep<B>> = Vec::with_capacity(steps);
        for s in 0..steps {
            // No pair is that many predictions deep: the later steps have none either.
            if let Some(prev) = out.last()
                && unroller.advance(batch, &be.to_host(&prev.f)?) == 0
            {
                break;
            }
            let x = be.from_host(&batch.inputs, be.storage_dtype())?;
            let z = self.fc.forward(&be, s, &x, rows)?;
            let a = self.block.norm1.forward(&be, s, &z, shape)?;
            let attn = &self.block.attn;
            let project =
                |w| -> Result<Vec<f32>> { Ok(be.to_host(&linear_fwd(&be, &a, w, rows)?)?) };
            let o = chain.forward(project(&attn.wq)?, project(&attn.wk)?, project(&attn.wv)?);
            let o = be.from_host(&o, be.storage_dtype())?;
            let y = linear_fwd(&be, &o, &attn.wo, rows)?;
            let h = activation(&be, rows * d, |h| Ok(be.add(&z, &y, h)?))?;
            let c = self.block.norm2.forward(&be, s, &h, shape)?;
            let m = self.block.mlp.forward(&be, s, &c, shape)?;
            let f = activation(&be, rows * d, |f| Ok(be.add(&h, &m, f)?))?;
            let logits = self.logits(&f, rows)?;
            let weight = self.config.unroll_decay.powi(s as i32);
            let (sums, df) = self.loss_grad_weighted(batch, &f, &logits, weight)?;
            out.push(UnrolledStep { a, o, df, f, sums });
        }
        Ok(out)
    }

    /// The backward of [`Drafter::unrolled_forward`]'s steps, last to first (a step's keys
    /// and values get gradients from every later step's queries), through the block into fc.
    fn unrolled_backward(
        &mut self,
        steps: &[UnrolledStep<B>],
        chain: &mut ChainAttention,
    ) -> Result<()> {
        let be = self.be.clone();
        let d = self.target.d_model;
        for (s, st) in steps.iter().enumerate().rev() {
            let rows = be.len(&st.f) / d;
            let dc = self.block.mlp.backward_input(&be, s, &st.df)?;
            let mut dh = self.block.norm2.backward_input(&be, s, &dc)?;
            be.axpy(1.0, &st.df, &mut dh)?;
            let attn = &mut self.block.attn;
            let d_o = gradient(&be, rows * d, |d_o| {
                linear_bwd_input(&be, &dh, &attn.wo, d_o, rows, false)
            })?;
            linear_bwd_weight(&be, &st.o, &dh, &mut attn.wo, rows)?;
            let dq = chain.backward(s, &be.to_host(&d_o)?);
            let (dk, dv) = chain.kv_grads(s);
            let da = gradient(&be, rows * d, |da| {
                let projections = [(dq, &mut attn.wq), (dk, &mut attn.wk), (dv, &mut attn.wv)];
                for (i, (g, w)) in projections.into_iter().enumerate() {
                    let g = be.from_host(&g, DType::F32)?;
                    linear_bwd_input(&be, &g, w, da, rows, i > 0)?;
                    linear_bwd_weight(&be, &st.a, &g, w, rows)?;
                }
                Ok(())
            })?;
            let mut dz = self.block.norm1.backward_input(&be, s, &da)?;
            be.axpy(1.0, &dh, &mut dz)?;
            self.fc.backward_input(&be, s, &dz, false)?;
            self.block.mlp.backward_weight(&be, s)?;
            self.block.norm2.backward_weight(&be, s)?;
            self.block.norm1.backward_weight(&be, s)?;
            self.fc.backward_weight(&be, s)?;
        }
        Ok(())
    }

    /// Drafts `k` tokens greedily after every position `t` of each row's greedy tail (see
    /// [`greedy_tail`]; context: the row's pairs up to `t`, cut to `window` as a proposal cuts
    /// it) that has `k` known tokens after it, and counts how deep each chain matches the
    /// row's own next tokens. On rows of a rollout at temperature 0 the tail is the
    /// completion, whose tokens are the target's greedy ones, so this is what greedy
    /// verification would accept; a prompt's tokens are not the target's to choose, and no
    /// proposal drafts them.
    pub fn chain_acceptance(&mut self, rows: &[DraftRow], k: usize) -> Result<ChainStats> {
        let (d, v) = (self.target.d_model, self.target.vocab);
        if k == 0 {
            return Err(ModelError::DrafterInput {
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
            for t in greedy_tail(row, &self.target_argmax(row)?)..row.len().saturating_sub(k) {
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

/// Where the greedy tail of `row` starts: the longest suffix in which every known token is
/// the target's argmax there (`greedy[t]`, [`Drafter::target_argmax`]), i.e. the completion
/// of a greedy rollout (and any prompt tokens before it that the target would have chosen
/// too).
pub fn greedy_tail(row: &DraftRow, greedy: &[usize]) -> usize {
    let mut start = row.len();
    while start > 0 {
        let t = start - 1;
        let x = row.targets[t];
        if x != crate::tensor::IGNORE_TARGET && greedy.get(t) != Some(&(x as usize)) {
            break;
        }
        start = t;
    }
    start
}
