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
//!
//! The head, `head.w: [vocab, d]` as the target holds it, is on the backend; the head's
//! products read it transposed ([`FrozenTables::by_head`]). A tied target (`tie_embeddings`)
//! keeps its head bitwise equal to its embedding (`model/tie.rs`), so its snapshot is that
//! one table, read both ways: embedding rows are gathered from it too
//! ([`Drafter::embed_rows`]), which halves the snapshot. An untied target keeps the two
//! tables.

use std::sync::Arc;

use super::{Drafter, FROZEN, Result};
use crate::model::ModelError;
use crate::model::{Gpt, ModelChunk};
use crate::tensor::{Backend, Gemm, IGNORE_TARGET};

/// The frozen embedding and head one or more drafters read (cloning shares them).
pub struct FrozenTables<B: Backend> {
    /// An untied target's `embed.tok: [vocab, d]`, on the host (it only gathers rows of the
    /// fc input); `None` for a tied target, whose rows come from `head`.
    pub tok: Option<Arc<Vec<f32>>>,
    /// On the backend that built it: `head.w: [vocab, d]` (a tied target's one table, its
    /// embedding's values too).
    pub head: Arc<B::Buf>,
    /// Target step of the last refresh (`None`: the target's initial values).
    pub step: Option<u64>,
}

impl<B: Backend> Clone for FrozenTables<B> {
    fn clone(&self) -> Self {
        FrozenTables {
            tok: self.tok.clone(),
            head: Arc::clone(&self.head),
            step: self.step,
        }
    }
}

impl<B: Backend> FrozenTables<B> {
    /// Whether this is a tied target's one table.
    pub fn tied(&self) -> bool {
        self.tok.is_none()
    }

    /// Whether `self` and `other` are the same tables (the same buffers, not equal values).
    pub fn same_as(&self, other: &Self) -> bool {
        let tok = match (&self.tok, &other.tok) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        };
        tok && Arc::ptr_eq(&self.head, &other.head) && self.step == other.step
    }

    /// Bytes the tables hold (each counted once however many drafters share it).
    pub fn bytes(&self, be: &B) -> usize {
        self.tok_bytes() + self.head_bytes(be)
    }

    /// Bytes of the host embedding (0 for a tied target's one table).
    pub fn tok_bytes(&self) -> usize {
        self.tok.as_ref().map_or(0, |t| 4 * t.len())
    }

    /// Bytes of the backend table (the head, or a tied target's one table).
    pub fn head_bytes(&self, be: &B) -> usize {
        be.dtype(&self.head).size() * be.len(&self.head)
    }

    /// A product written with the head's `W: [d, vocab]` as its `B` operand, as it reads the
    /// `[vocab, d]` table this holds: `B`'s transpose flips (no `[d, vocab]` copy is made).
    pub fn by_head(&self, g: Gemm) -> Gemm {
        Gemm {
            trans_b: !g.trans_b,
            ..g
        }
    }
}

impl<B: Backend> Drafter<B> {
    /// The frozen tables this drafter reads (shared, not copied).
    pub fn frozen(&self) -> FrozenTables<B> {
        self.frozen.clone()
    }

    /// Reads `tables` from now on, as another drafter of this process built them (a pointer
    /// swap): they must fit the target (one table if it is tied, two otherwise), and the
    /// head must be on memory this drafter's backend reads
    /// ([`Backend::shares_buffers_with`], checked by whoever hands them over).
    pub fn share_frozen(&mut self, tables: &FrozenTables<B>) -> Result<()> {
        let tied = self.target.tie_embeddings;
        if tables.tied() != tied {
            let (want, got) = match tied {
                true => ("one table (the target is tied)", "two"),
                false => ("two tables (the target is untied)", "one"),
            };
            return Err(ModelError::DrafterInput {
                what: "frozen tables",
                reason: format!("{got} given where the drafter reads {want}"),
            });
        }
        let size = self.target.vocab * self.target.d_model;
        let tok = tables.tok.as_ref().map(|t| (FROZEN[0], t.len()));
        let head = (FROZEN[usize::from(!tied)], self.be.len(&tables.head));
        for (name, got) in tok.into_iter().chain([head]) {
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

    /// The frozen embedding's rows `ids`, `[ids.len(), d_model]` on the host; a row of zeros
    /// for [`IGNORE_TARGET`]. A tied target's are gathered from its one table on the backend.
    pub(super) fn embed_rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let d = self.target.d_model;
        let known = |&t: &u32| t != IGNORE_TARGET;
        let mut rows = match &self.frozen.tok {
            Some(tok) => {
                let mut rows = vec![0.0; ids.len() * d];
                for (row, &t) in rows.chunks_exact_mut(d).zip(ids).filter(|(_, t)| known(t)) {
                    row.copy_from_slice(&tok[t as usize * d..][..d]);
                }
                return Ok(rows);
            }
            None => {
                let gather: Vec<u32> = ids.iter().map(|t| if known(t) { *t } else { 0 }).collect();
                self.head_rows(&gather)?
            }
        };
        for (row, _) in rows.chunks_exact_mut(d).zip(ids).filter(|(_, t)| !known(t)) {
            row.fill(0.0);
        }
        Ok(rows)
    }

    /// The head table's rows `ids` (each below the vocabulary), `[ids.len(), d_model]` on
    /// the host, gathered on the backend.
    pub(super) fn head_rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let (be, d) = (&self.be, self.target.d_model);
        let mut out = be.zeros(ids.len() * d, be.dtype(&self.frozen.head))?;
        be.embedding_fwd(&self.frozen.head, ids, &mut out, d)?;
        Ok(be.to_host(&out)?)
    }

    /// The frozen tables on the host as the target holds them: `embed.tok` and `head.w`,
    /// both `[vocab, d]` (a tied target's one table twice).
    pub(super) fn host_tables(&self) -> Result<[Vec<f32>; 2]> {
        let table = self.be.to_host(&self.frozen.head)?;
        Ok(match &self.frozen.tok {
            Some(tok) => [tok.to_vec(), table],
            None => [table.clone(), table],
        })
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

    /// Whether a refresh that brings table `name` (and the embedding too when `with_embed`)
    /// needs it: a tied target's head is its embedding, bitwise, so it is read
    /// only when the embedding does not come with it.
    pub(crate) fn takes(&self, name: &str, with_embed: bool) -> bool {
        !(self.target.tie_embeddings && name == FROZEN[1] && with_embed)
    }

    /// Marks the tables as of target step `step` without changing them: a tied target's
    /// head deposit, whose values its embedding's deposit brought.
    pub(crate) fn refresh_step(&mut self, step: u64) {
        self.frozen.step = Some(step);
    }

    /// Overwrites the frozen table `name` (`embed.tok` or `head.w`) with the target's values
    /// at target step `step` (a copy: drafters sharing the old tables keep them). A tied
    /// target's one table takes either.
    pub fn refresh(&mut self, name: &str, values: &[f32], step: u64) -> Result<()> {
        self.check_frozen(name, values.len())?;
        self.replace(name, || Ok(Arc::new(values.to_vec())), step)
    }

    /// [`Drafter::refresh`] from values already on the host behind an `Arc` (a deposit the
    /// process's drafters share): an untied target's embedding is taken as it is, without a
    /// copy.
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

    /// Replaces table `name` (checked) with `host()`'s values, uploaded for the head and for
    /// a tied target's one table (from either copy: the same values).
    fn replace(
        &mut self,
        name: &str,
        host: impl FnOnce() -> Result<Arc<Vec<f32>>>,
        step: u64,
    ) -> Result<()> {
        self.packs.invalidate();
        let tied = self.target.tie_embeddings;
        if name == FROZEN[0] && !tied {
            self.frozen.tok = Some(host()?);
        } else {
            let values = host()?;
            let head = self.be.from_host(&values, self.be.storage_dtype())?;
            self.frozen.head = Arc::new(head);
            if let Some(draft) = self.draft.take() {
                self.draft = Some(self.draft_head(draft.ids)?);
            }
        }
        self.frozen.step = Some(step);
        Ok(())
    }

    /// Refreshes whichever frozen tables `chunk` holds (the first chunk has the embedding,
    /// the last the head; a tied target's head is read only where the embedding is not);
    /// returns how many it held.
    pub fn refresh_from_chunk<C: Backend>(
        &mut self,
        chunk: &ModelChunk<C>,
        step: u64,
    ) -> Result<usize> {
        let with_embed = chunk.param(FROZEN[0]).is_ok();
        let mut n = 0;
        for name in FROZEN {
            if chunk.param(name).is_err() {
                continue;
            }
            n += 1;
            if self.takes(name, with_embed) {
                let values = chunk.param_values(name)?;
                self.check_frozen(name, values.len())?;
                self.replace(name, || Ok(Arc::new(values)), step)?;
            }
        }
        Ok(n)
    }

    /// Refreshes the frozen tables from a whole model.
    pub fn refresh_from_gpt<C: Backend>(&mut self, gpt: &Gpt<C>, step: u64) -> Result<()> {
        for name in FROZEN {
            if !self.takes(name, true) {
                continue;
            }
            let values = gpt.param_values(name)?;
            self.check_frozen(name, values.len())?;
            self.replace(name, || Ok(Arc::new(values)), step)?;
        }
        Ok(())
    }
}
