//! The drafter in a launched run's checkpoints: each rank of replica 0 snapshots its own part
//! on its stage thread at the step's end ([`super::LaunchFill::snapshot`]), and rank 0's
//! writer assembles the drafter's state from its own snapshot and the others' ([`assemble`]),
//! which travel with their shards' acknowledgements.
//!
//! Why gathered rather than waited for: under the planned placement the state after step `s`
//! holds round `s` of every replica and the rows of step `s`, and rank 0 may end step `s`
//! before the other processes' posts and the last stage's rows have reached it. Waiting for
//! them on rank 0's stage thread could deadlock (a peer's step end may need rank 0's next
//! forwards first); waiting on the writer thread would race with the next step's rows. Each
//! rank's own part, taken on its own stage thread at its own step end, is exact.

use serde::{Deserialize, Serialize};

use super::exchange::RowWire;
use crate::data::SplitMix64;
use crate::model::drafter::DrafterGrads;
use crate::model::drafter::state::{BufferState, DrafterState, RoundState};

/// A rank's part of the drafter in a checkpoint ([`super::LaunchFill::snapshot`]).
pub enum DrafterSnap {
    /// Rank 0's: the whole state as its process knows it.
    State(Box<DrafterState>),
    /// Any other rank's.
    Peer(Box<PeerSnap>),
}

/// What a rank other than 0 adds to a checkpoint's drafter.
#[derive(Serialize, Deserialize)]
pub struct PeerSnap {
    /// Its replica's row sampler.
    sampler: SplitMix64,
    /// Planned placement: the posts of the kept round its process holds (its own among them).
    round: Option<RoundWire>,
    /// Planned placement, on the last stage's rank: the training and held-out rows.
    rows: Option<(BufferWire, BufferWire)>,
}

impl PeerSnap {
    pub(super) fn new(
        sampler: SplitMix64,
        round: Option<RoundState>,
        rows: Option<(BufferState, BufferState)>,
    ) -> Self {
        PeerSnap {
            sampler,
            round: round.map(RoundWire::of),
            rows: rows.map(|(b, h)| (BufferWire::of(&b), BufferWire::of(&h))),
        }
    }
}

/// A [`RoundState`] on the wire.
#[derive(Serialize, Deserialize)]
struct RoundWire {
    step: u64,
    grads: Vec<DrafterGrads>,
    embed: Option<(u64, Vec<f32>)>,
    head: Option<(u64, Vec<f32>)>,
}

impl RoundWire {
    fn of(r: RoundState) -> Self {
        RoundWire {
            step: r.step,
            grads: r.grads,
            embed: r.embed,
            head: r.head,
        }
    }
}

/// A [`BufferState`] on the wire: the current step, the rows with their steps, and how many
/// of them are the previous generation.
#[derive(Serialize, Deserialize)]
struct BufferWire {
    step: Option<u64>,
    previous: usize,
    rows: Vec<(u64, RowWire)>,
}

impl BufferWire {
    fn of(b: &BufferState) -> Self {
        BufferWire {
            step: b.step,
            previous: b.previous.len(),
            rows: b
                .previous
                .iter()
                .chain(&b.current)
                .map(|r| (r.step, RowWire::of(r)))
                .collect(),
        }
    }

    fn state(self) -> BufferState {
        let mut rows: Vec<_> = self.rows.into_iter().map(|(s, r)| r.row(s)).collect();
        let current = rows.split_off(self.previous.min(rows.len()));
        BufferState {
            step: self.step,
            previous: rows,
            current,
        }
    }
}

/// Rank 0's writer: the drafter's state from rank 0's own `state` and the other ranks'
/// snapshots `(rank, snapshot)`: their samplers, the last stage's rows, and the kept round
/// made whole from every process's posts. Errors name the rank at fault.
pub fn assemble(
    mut state: DrafterState,
    peers: Vec<(usize, PeerSnap)>,
) -> Result<DrafterState, (usize, String)> {
    let replicas = state.samplers.len();
    for (from, snap) in peers {
        let slot = state.samplers.get_mut(from).ok_or_else(|| {
            (
                from,
                format!("is not one of the {replicas} drafter replicas"),
            )
        })?;
        *slot = snap.sampler;
        if let Some((buffer, held_out)) = snap.rows {
            state.buffer = buffer.state();
            state.held_out = held_out.state();
        }
        let Some(theirs) = snap.round else {
            continue;
        };
        let round = state.round.get_or_insert_with(|| RoundState {
            step: theirs.step,
            grads: Vec::new(),
            embed: None,
            head: None,
        });
        if round.step != theirs.step {
            return Err((
                from,
                format!(
                    "kept the round of step {}, rank 0 that of step {}",
                    theirs.step, round.step
                ),
            ));
        }
        for g in theirs.grads {
            if !round.grads.iter().any(|h| h.replica == g.replica) {
                round.grads.push(g);
            }
        }
        // Each copy has one holder, so posts agree on it: keep the newest.
        for (mine, new) in [
            (&mut round.embed, theirs.embed),
            (&mut round.head, theirs.head),
        ] {
            if let Some((step, values)) = new
                && mine.as_ref().is_none_or(|(s, _)| *s < step)
            {
                *mine = Some((step, values));
            }
        }
    }
    if let Some(round) = &mut state.round {
        round.grads.sort_by_key(|g| g.replica);
        let have: Vec<usize> = round.grads.iter().map(|g| g.replica).collect();
        if have != (0..replicas).collect::<Vec<_>>() {
            return Err((
                0,
                format!(
                    "the kept round of step {} has the posts of replicas {have:?} of {replicas}",
                    round.step
                ),
            ));
        }
    }
    Ok(state)
}
