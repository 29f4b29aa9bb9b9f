//! Checkpoints ([`crate::model::drafter::state`]): the drafter a resumed run continues from.
//!
//! Under the measured placement the state is whatever the replicas hold when it is taken.
//! Under the planned one ([`super::planned`]) it is what they held at the end of the step the
//! checkpoint follows: each replica's sampler as it ended that step, the round it posted (to
//! be applied at the end of the next step), and only rows of steps up to it, so a resumed run
//! continues exactly as an uninterrupted one would.
//!
//! The frozen tables are not saved: the next step's slices read those deposited at the end of
//! the step the checkpoint follows, that is the target's weights in the same checkpoint, which
//! a resumed run's replicas are seeded with. The one exception is a planned run whose
//! `refresh_every` deposited nothing at that step: its tables lag the target's, so they go
//! into the file with the weights. Under the measured placement (not reproducible anyway) a
//! resumed run reads the target's.

use std::sync::Arc;

use super::{DrafterFill, Frozen, lock};
use crate::model::ModelError;
use crate::model::drafter::state::{BufferState, DrafterState, RoundState};
use crate::model::drafter::{DrafterWeights, FROZEN};

impl DrafterFill {
    /// The drafter's state now: replica 0's weights, version and optimizer (every replica
    /// applies the same updates), every replica's row sampler, and both buffers' rows.
    /// Gradients of an open exchange round are not part of it; under the planned placement
    /// the posted round of the last step every rank ended is. In a multi-process run that is
    /// the last step this process's rank ended, and the round and rows are what this process
    /// holds now: the other processes' posts and the last stage's rows are gathered with
    /// their shards ([`DrafterFill::checkpoint_round`], [`DrafterFill::checkpoint_rows`]).
    pub fn export_state(&self) -> Result<DrafterState, ModelError> {
        // In one process every rank has posted the kept round when a checkpoint is taken;
        // across processes the others' posts are gathered with their shards instead.
        let kept = match &self.planned {
            Some(planned) => {
                let local = self.local.get().copied();
                let next = planned.resume_step(local);
                let round = match local {
                    Some(_) => planned.round_so_far(next),
                    None => planned.kept_round(next)?,
                };
                Some((next, round))
            }
            None => None,
        };
        let (weights, optimizer) = {
            let replica = lock(&self.replicas[0]);
            let (mut weights, optimizer) = replica.trainer.export_state()?;
            // The tables the next step reads are the target's weights in the same checkpoint
            // unless no refresh was due at its last step (planned, `refresh_every` > 1): only
            // then do they travel in the file.
            if let Some((next, _)) = &kept
                && !next.is_multiple_of(self.refresh_every)
            {
                weights.tensors.extend(replica.trainer.frozen_tensors()?);
            }
            (weights, optimizer)
        };
        let buffer = BufferState::of(&self.buffer.lock());
        let held_out = BufferState::of(&self.held_out.lock());
        let (Some(planned), Some((next, round))) = (&self.planned, kept) else {
            let samplers = self
                .replicas
                .iter()
                .map(|r| lock(r).trainer.sampler())
                .collect();
            return Ok(DrafterState {
                weights,
                optimizer,
                samplers,
                buffer,
                held_out,
                round: None,
            });
        };
        Ok(DrafterState {
            weights,
            optimizer,
            samplers: planned.samplers(),
            buffer: buffer.before(next),
            held_out: held_out.before(next),
            round,
        })
    }

    /// Under the planned placement in a multi-process run, what this process holds of the
    /// round a checkpoint taken now keeps (at least its own replica's post).
    pub fn checkpoint_round(&self) -> Option<RoundState> {
        let planned = self.planned.as_ref()?;
        planned.round_so_far(planned.resume_step(self.local.get().copied()))
    }

    /// Under the planned placement, this process's training and held-out rows as a
    /// checkpoint taken now keeps them: exact on the process that captures them (the last
    /// stage's), whose stage thread takes them at its step end.
    pub fn checkpoint_rows(&self) -> Option<(BufferState, BufferState)> {
        let planned = self.planned.as_ref()?;
        let next = planned.resume_step(self.local.get().copied());
        let buffer = BufferState::of(&self.buffer.lock()).before(next);
        let held_out = BufferState::of(&self.held_out.lock()).before(next);
        Some((buffer, held_out))
    }

    /// Continues from `state` before the run starts: every replica takes its weights, version
    /// and optimizer and its own sampler (and the frozen tables when the file has them: the
    /// seeds, the target's, otherwise), the buffers their rows, and the board
    /// the weights (so the held-out measurement and the rollout engine see them at once).
    /// Under the planned placement the kept round is posted again and rows of the run's own
    /// steps are left out.
    pub fn import_state(&self, state: &DrafterState) -> Result<(), ModelError> {
        samplers_fit(state, self.ranks)?;
        // Tables in the file (lagging the target's, or written before they were shared) are
        // taken once and shared; otherwise the replicas keep their seeds, the target's.
        let (weights, tables) = split_tables(&state.weights);
        for (replica, &sampler) in self.replicas.iter().zip(&state.samplers) {
            let mut replica = lock(replica);
            (replica.trainer).import_state(&weights, &state.optimizer, sampler)?;
            self.adopt(&mut replica, &tables)?;
        }
        let (buffer, held_out) = match &self.planned {
            Some(planned) => {
                planned.restore(&state.samplers, state.round.as_ref())?;
                let start = planned.start();
                (state.buffer.before(start), state.held_out.before(start))
            }
            None => (state.buffer.clone(), state.held_out.clone()),
        };
        buffer.restore(&mut self.buffer.lock())?;
        held_out.restore(&mut self.held_out.lock())?;
        self.board
            .publish(state.weights.version, state.weights.clone());
        Ok(())
    }
}

/// `weights` without the frozen tables, and the tables it carried as deposits of its frozen
/// step.
fn split_tables(weights: &DrafterWeights) -> (DrafterWeights, Frozen) {
    let step = weights.frozen_step.unwrap_or(0);
    let mut tables = Frozen::default();
    let mut rest = weights.clone();
    rest.tensors.retain(|t| {
        let slot = match t.name.as_str() {
            n if n == FROZEN[0] => &mut tables.embed,
            n if n == FROZEN[1] => &mut tables.head,
            _ => return true,
        };
        *slot = Some((step, Arc::new(t.values.clone())));
        false
    });
    (rest, tables)
}

/// Whether a checkpointed drafter `state` fits a run of `ranks` ranks: one sampler each.
pub(crate) fn samplers_fit(state: &DrafterState, ranks: usize) -> Result<(), ModelError> {
    if state.samplers.len() == ranks {
        return Ok(());
    }
    Err(ModelError::DrafterInput {
        what: "checkpointed state",
        reason: format!(
            "has {} replicas' samplers, this run has {ranks} ranks",
            state.samplers.len()
        ),
    })
}
