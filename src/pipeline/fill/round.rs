//! What one replica's post of a drafter round carries: its gradients and the frozen copies
//! (the target's embedding and LM head) its rank deposited ([`Frozen`], [`RoundPost`]).

use crate::model::ModelChunk;
use crate::model::drafter::DrafterGrads;
use crate::tensor::Backend;
use std::sync::Arc;

/// A frozen copy deposited by the rank that holds it: `(target step, values)`.
pub(super) type Deposit = Option<(u64, Arc<Vec<f32>>)>;

#[derive(Clone, Default)]
pub(super) struct Frozen {
    pub(super) embed: Deposit,
    pub(super) head: Deposit,
}

impl Frozen {
    /// Takes the copies `chunk` holds, as of target step `step`.
    pub(super) fn take_from<C: Backend>(&mut self, chunk: &ModelChunk<C>, step: u64) {
        if let Ok(values) = chunk.param_values("embed.tok") {
            self.embed = Some((step, Arc::new(values)));
        }
        if let Ok(values) = chunk.param_values("head.w") {
            self.head = Some((step, Arc::new(values)));
        }
    }

    /// `grads` posted with these copies, as it travels between processes.
    pub(super) fn post(&self, grads: &DrafterGrads) -> RoundPost {
        let copy = |d: &Deposit| d.as_ref().map(|(s, v)| (*s, v.to_vec()));
        RoundPost {
            grads: grads.clone(),
            embed: copy(&self.embed),
            head: copy(&self.head),
        }
    }

    /// A post from another process: its copies and gradients.
    pub(super) fn of_post(post: RoundPost) -> (Frozen, DrafterGrads) {
        let arc = |d: Option<(u64, Vec<f32>)>| d.map(|(s, v)| (s, Arc::new(v)));
        let frozen = Frozen {
            embed: arc(post.embed),
            head: arc(post.head),
        };
        (frozen, post.grads)
    }

    /// Keeps, of each copy, the newer deposit.
    pub(super) fn merge(&mut self, other: Frozen) {
        for (mine, theirs) in [(&mut self.embed, other.embed), (&mut self.head, other.head)] {
            if let Some((step, values)) = theirs
                && mine.as_ref().is_none_or(|(s, _)| *s < step)
            {
                *mine = Some((step, values));
            }
        }
    }
}

/// One replica's post of a round as it travels between processes: its gradients and the
/// frozen copies its rank had deposited, `(target step, values)`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct RoundPost {
    pub grads: DrafterGrads,
    pub embed: Option<(u64, Vec<f32>)>,
    pub head: Option<(u64, Vec<f32>)>,
}
