//! The drafter's frozen embedding and LM head ([`FrozenTables`]): the target's `embed.tok`
//! and `head.w` as of a refresh, held behind `Arc`s so that every drafter of a process (the
//! replicas of a pipelined run, the rollout engine's trainer and proposer) reads one copy.
//!
//! They are never trained and never saved with the drafter: a refresh takes them from the
//! target, a load of saved weights leaves them as they are, and a resumed run takes them
//! from the target's checkpoint.
//!
//! Why a copy at all, and not the target's own buffers: the target's optimizer overwrites
//! its parameters in place at every step while drafter slices run in other ranks' bubbles
//! (and `refresh_every` may keep the tables a few steps behind), so the drafter reads a
//! snapshot, one per process. A refresh copies once where the values cross from the target
//! (its chunk, or a post from another process); every other drafter of the process takes
//! the same `Arc`s ([`Drafter::share_frozen`]).

use std::sync::Arc;

use super::{Drafter, FROZEN, Result};
use crate::model::ModelError;
use crate::model::{Gpt, ModelChunk};
use crate::tensor::Backend;

/// The frozen embedding and head one or more drafters read (cloning shares them).
pub struct FrozenTables<B: Backend> {
    /// `embed.tok: [vocab, d]`, on the host: it only gathers rows of the fc input.
    pub tok: Arc<Vec<f32>>,
    /// `head.w: [d, vocab]`, on the backend that built it.
    pub head: Arc<B::Buf>,
    /// Target step of the last refresh (`None`: the target's initial values).
    pub step: Option<u64>,
}

impl<B: Backend> Clone for FrozenTables<B> {
    fn clone(&self) -> Self {
        FrozenTables {
            tok: Arc::clone(&self.tok),
            head: Arc::clone(&self.head),
            step: self.step,
        }
    }
}

impl<B: Backend> FrozenTables<B> {
    /// Whether `self` and `other` are the same tables (the same buffers, not equal values).
    pub fn same_as(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.tok, &other.tok)
            && Arc::ptr_eq(&self.head, &other.head)
            && self.step == other.step
    }

    /// Bytes the two tables hold (each counted once however many drafters share it).
    pub fn bytes(&self, be: &B) -> usize {
        let element = match be.dtype(&self.head) {
            crate::tensor::DType::F32 => 4,
            crate::tensor::DType::Bf16 => 2,
        };
        4 * self.tok.len() + element * be.len(&self.head)
    }
}

impl<B: Backend> Drafter<B> {
    /// The frozen tables this drafter reads (shared, not copied).
    pub fn frozen(&self) -> FrozenTables<B> {
        self.frozen.clone()
    }

    /// Reads `tables` from now on, as another drafter of this process built them (a pointer
    /// swap): they must fit the target, and the head must be on memory this drafter's
    /// backend reads ([`Backend::shares_buffers_with`], checked by whoever hands them over).
    pub fn share_frozen(&mut self, tables: &FrozenTables<B>) -> Result<()> {
        let size = self.target.vocab * self.target.d_model;
        for (name, got) in [
            (FROZEN[0], tables.tok.len()),
            (FROZEN[1], self.be.len(&tables.head)),
        ] {
            if got != size {
                let name = name.to_string();
                return Err(ModelError::ParamLen {
                    name,
                    expected: size,
                    got,
                });
            }
        }
        let head_changed = !Arc::ptr_eq(&self.frozen.head, &tables.head);
        self.frozen = tables.clone();
        self.packs.invalidate();
        if head_changed && let Some(draft) = self.draft.take() {
            self.draft = Some(self.draft_head(draft.ids)?);
        }
        Ok(())
    }

    /// Target step of the frozen tables' last refresh (`None`: never refreshed).
    pub fn frozen_step(&self) -> Option<u64> {
        self.frozen.step
    }

    /// Whether the frozen tables are due for a refresh at target step `target_step`
    /// (never refreshed, or `refresh_every` steps since the last one).
    pub fn needs_refresh(&self, target_step: u64) -> bool {
        self.frozen
            .step
            .is_none_or(|s| target_step >= s.saturating_add(self.config.refresh_every))
    }

    /// Overwrites the frozen table `name` (`embed.tok` or `head.w`) with the target's values
    /// at target step `step` (a copy: drafters sharing the old tables keep them).
    pub fn refresh(&mut self, name: &str, values: &[f32], step: u64) -> Result<()> {
        self.check_frozen(name, values.len())?;
        self.replace(name, || Ok(Arc::new(values.to_vec())), step)
    }

    /// [`Drafter::refresh`] from values already on the host behind an `Arc` (a deposit the
    /// process's drafters share): the embedding is taken as it is, without a copy.
    pub fn refresh_shared(&mut self, name: &str, values: &Arc<Vec<f32>>, step: u64) -> Result<()> {
        self.check_frozen(name, values.len())?;
        self.replace(name, || Ok(Arc::clone(values)), step)
    }

    fn check_frozen(&self, name: &str, len: usize) -> Result<()> {
        let expected = self.target.vocab * self.target.d_model;
        if !FROZEN.contains(&name) {
            return Err(ModelError::UnknownParam(name.to_string()));
        }
        if len != expected {
            let name = name.to_string();
            return Err(ModelError::ParamLen {
                name,
                expected,
                got: len,
            });
        }
        Ok(())
    }

    /// Replaces table `name` (checked) with `host()`'s values, uploaded for the head.
    fn replace(
        &mut self,
        name: &str,
        host: impl FnOnce() -> Result<Arc<Vec<f32>>>,
        step: u64,
    ) -> Result<()> {
        self.packs.invalidate();
        if name == FROZEN[0] {
            self.frozen.tok = host()?;
        } else {
            let head = self.be.from_host(&host()?, self.be.storage_dtype())?;
            self.frozen.head = Arc::new(head);
            if let Some(draft) = self.draft.take() {
                self.draft = Some(self.draft_head(draft.ids)?);
            }
        }
        self.frozen.step = Some(step);
        Ok(())
    }

    /// Refreshes whichever frozen tables `chunk` holds (the first chunk has the embedding,
    /// the last the head); returns how many it held.
    pub fn refresh_from_chunk<C: Backend>(
        &mut self,
        chunk: &ModelChunk<C>,
        step: u64,
    ) -> Result<usize> {
        let mut n = 0;
        for name in FROZEN {
            if let Ok(values) = chunk.param_values(name) {
                self.check_frozen(name, values.len())?;
                self.replace(name, || Ok(Arc::new(values)), step)?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Refreshes both frozen tables from a whole model.
    pub fn refresh_from_gpt<C: Backend>(&mut self, gpt: &Gpt<C>, step: u64) -> Result<()> {
        for name in FROZEN {
            let values = gpt.param_values(name)?;
            self.check_frozen(name, values.len())?;
            self.replace(name, || Ok(Arc::new(values)), step)?;
        }
        Ok(())
    }
}
