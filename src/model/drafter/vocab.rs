//! A reduced draft vocabulary (EAGLE-3's "d2t" map): proposals score only the `n` target
//! tokens the drafter's rows use most, through the columns of the frozen head that hold
//! them, instead of the whole vocabulary.
//!
//! Why: a drafted token's cost is the block (a few `d × d` products) plus the head
//! (`d × vocab`); at a real vocabulary (49K, 152K) the head is most of it. The tokens a
//! model actually emits are concentrated, so a few thousand columns draft nearly every
//! token the full head would (docs/benchmarks.md, "Drafter at a real vocabulary").
//!
//! Losslessness does not depend on it: a drafted token's `q` is still a distribution over
//! the whole vocabulary (0 outside the draft vocabulary, which is never drafted), and
//! acceptance compares the target's `p` with that `q`. Training is unchanged (its soft
//! targets and loss stay over the whole vocabulary).

use super::{DraftRow, Drafter, Result};
use crate::model::ModelError;
use crate::tensor::{Backend, IGNORE_TARGET};

/// The draft vocabulary: target ids, ascending, and the head's columns for them.
pub(super) struct DraftVocab<B: Backend> {
    pub(super) ids: Vec<u32>,
    /// `[d_model, ids.len()]`: column `j` is the frozen head's column `ids[j]`.
    pub(super) head: B::Buf,
}

/// The `n` most frequent known tokens of `rows` (ties: the lower id first), topped up with
/// the lowest ids not seen when fewer than `n` occur; ascending. `n` is capped at `vocab`.
pub fn frequent_tokens<'a>(
    rows: impl IntoIterator<Item = &'a DraftRow>,
    vocab: usize,
    n: usize,
) -> Vec<u32> {
    let mut counts = vec![0u64; vocab];
    for row in rows {
        for &t in &row.targets {
            if t != IGNORE_TARGET && (t as usize) < vocab {
                counts[t as usize] += 1;
            }
        }
    }
    let mut order: Vec<u32> = (0..vocab as u32).collect();
    // Stable: equal counts keep ascending ids, and unseen ids follow the seen ones.
    order.sort_by_key(|&t| std::cmp::Reverse(counts[t as usize]));
    order.truncate(n.min(vocab));
    order.sort_unstable();
    order
}

impl<B: Backend> Drafter<B> {
    /// Proposals draft from `ids` alone (see the module docs), or from the whole vocabulary
    /// with `None`. The ids must be distinct and inside the vocabulary; at least one.
    pub fn set_draft_vocab(&mut self, ids: Option<&[u32]>) -> Result<()> {
        self.packs.invalidate();
        self.draft = None;
        let Some(ids) = ids else {
            return Ok(());
        };
        let v = self.target.vocab;
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let reason = if ids.is_empty() {
            Some("no token".to_string())
        } else if sorted.len() != ids.len() {
            Some("a token is listed twice".to_string())
        } else {
            sorted
                .last()
                .filter(|&&t| t as usize >= v)
                .map(|t| format!("token {t} is outside the vocabulary {v}"))
        };
        if let Some(reason) = reason {
            return Err(ModelError::DrafterInput {
                what: "draft vocabulary",
                reason,
            });
        }
        self.draft = Some(self.draft_head(sorted)?);
        Ok(())
    }

    /// The draft vocabulary's ids, if one is set.
    pub fn draft_vocab(&self) -> Option<&[u32]> {
        self.draft.as_ref().map(|d| d.ids.as_slice())
    }

    /// Gathers the frozen head's columns `ids` (again after every refresh of the head): its
    /// `[vocab, d]` table's rows `ids`, gathered and transposed.
    pub(super) fn draft_head(&self, ids: Vec<u32>) -> Result<DraftVocab<B>> {
        let (d, n) = (self.target.d_model, ids.len());
        let cols = crate::model::tie::transpose(&self.head_rows(&ids)?, n, d);
        let head = self.be.from_host(&cols, self.be.storage_dtype())?;
        Ok(DraftVocab { ids, head })
    }

    /// Full-vocabulary logits `[rows, vocab]` from the draft vocabulary's `[rows, n]`:
    /// −∞ outside it, so that a softmax gives those tokens 0 and no argmax picks them.
    pub(super) fn scatter_draft(&self, ids: &[u32], reduced: &[f32], rows: usize) -> Vec<f32> {
        let (v, n) = (self.target.vocab, ids.len());
        let mut out = vec![f32::NEG_INFINITY; rows * v];
        for (r, z) in reduced.chunks_exact(n).take(rows).enumerate() {
            for (&t, &x) in ids.iter().zip(z) {
                out[r * v + t as usize] = x;
            }
        }
        out
    }
}
