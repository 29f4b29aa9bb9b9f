//! One sequence as the rollout driver keeps it ([`Seq`]: its tokens, the target's hidden
//! states so far, its sampling stream), and what is derived from it: its
//! drafter-training row and what the proposer sees of it.

use crate::data::SplitMix64;
use crate::model::drafter::{DraftContext, DraftRow};
use crate::model::infer::Compaction;
use crate::tensor::IGNORE_TARGET;

/// One request's sequence while it is generated.
pub(super) struct Seq {
    pub(super) tokens: Vec<u32>,
    pub(super) prompt: usize,
    /// Longest the sequence may grow (prompt + max_new, at most the model's positions).
    pub(super) cap: usize,
    pub(super) done: bool,
    /// Final hidden states of positions `0..tokens.len() - 1`, `[.., d_model]`.
    pub(super) hidden: Vec<f32>,
    pub(super) rng: SplitMix64,
    /// The stages' caches still hold a verified tree's other branches: the next step
    /// keeps only the accepted path.
    pub(super) compact: Option<Compaction>,
}

/// A sequence's drafter-training row: its final hidden states and next tokens (`None` before
/// it has two tokens).
pub(super) fn draft_row(s: &Seq, d: usize, step: u64) -> Option<DraftRow> {
    if s.tokens.len() <= 1 {
        return None;
    }
    // Position p's hidden state predicts token p + 1; the last token was never fed.
    let len = (s.tokens.len() - 1).min(s.hidden.len() / d);
    let mut targets: Vec<u32> = s.tokens[1..=len].to_vec();
    if targets.is_empty() {
        targets.push(IGNORE_TARGET);
    }
    Some(DraftRow {
        hidden: s.hidden[..len * d].to_vec(),
        targets,
        step,
    })
}

/// What the proposer sees of sequences `members` (see [`DraftContext`]).
pub(super) fn contexts<'s>(seqs: &'s [Seq], members: &[usize], d: usize) -> Vec<DraftContext<'s>> {
    members
        .iter()
        .map(|&i| {
            let s = &seqs[i];
            let n = s.tokens.len() - 1;
            DraftContext {
                hidden: &s.hidden[..n * d],
                tokens: &s.tokens[1..],
            }
        })
        .collect()
}
