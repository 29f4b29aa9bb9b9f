//! The drafter's exchange between the processes of a launched run (see [`super`]): what
//! travels on [`FILL_CHANNEL`] ([`FillWire`]), what a stage thread sends at its step ends
//! ([`Peers`]), the sender thread and one receiver thread per peer.

use std::sync::Mutex;
use std::sync::mpsc::{Receiver, Sender};

use serde::{Deserialize, Serialize};

use super::channel::{FILL_CHANNEL, lock};
use crate::comm::frame;
use crate::comm::link::PeerLink;
use crate::comm::tcp::TcpMesh;
use crate::model::ModelError;
use crate::model::drafter::{DraftBufferHandle, DraftRow};
use crate::pipeline::error::PipelineError;
use crate::pipeline::fill::{DrafterFill, RoundPeers, RoundPost};

/// What travels on [`FILL_CHANNEL`].
#[derive(Serialize, Deserialize)]
pub(super) enum FillWire {
    /// A frozen copy's values (`embed.tok` or `head.w`) before the run.
    Seed { name: String, values: Vec<f32> },
    /// The rows the last stage captured in target step `step` (held out or for training).
    Rows {
        step: u64,
        held_out: bool,
        rows: Vec<RowWire>,
    },
    /// The sender's replica's post at the end of target step `step` (under the planned
    /// placement, its round of that step).
    Post { step: u64, post: RoundPost },
    /// The sender's run has ended: nothing follows.
    Done,
}

/// A [`DraftRow`] on the wire.
#[derive(Serialize, Deserialize)]
pub(super) struct RowWire {
    pub(super) hidden: Vec<f32>,
    pub(super) targets: Vec<u32>,
}

impl RowWire {
    pub(super) fn of(r: &DraftRow) -> Self {
        RowWire {
            hidden: r.hidden.clone(),
            targets: r.targets.clone(),
        }
    }

    pub(super) fn row(self, step: u64) -> DraftRow {
        DraftRow {
            hidden: self.hidden,
            targets: self.targets,
            step,
        }
    }
}

/// `result` of an exchange thread; a failure also ends the fill's waits for rounds, which
/// can then never complete.
pub(super) fn aborting(
    fill: &DrafterFill,
    result: Result<(), PipelineError>,
) -> Result<(), PipelineError> {
    if let Err(e) = &result {
        fill.abort(e.to_string());
    }
    result
}

pub(super) fn peer_err(rank: usize, peer: usize, e: impl std::fmt::Display) -> PipelineError {
    PipelineError::FillPeer {
        rank,
        peer,
        reason: e.to_string(),
    }
}

pub(super) fn encode(rank: usize, wire: &FillWire) -> Result<Vec<u8>, PipelineError> {
    frame::encode(wire).map_err(|e| PipelineError::FillPlan {
        rank,
        reason: format!("encoding a drafter message: {e}"),
    })
}

pub(super) fn decode(rank: usize, peer: usize, bytes: &[u8]) -> Result<FillWire, PipelineError> {
    frame::decode(bytes).map_err(|e| peer_err(rank, peer, format!("undecodable message: {e}")))
}

/// What the stage thread tells the other processes at the end of each of its target steps.
pub(super) struct Peers {
    pub(super) outbox: Mutex<Sender<FillWire>>,
    /// The training and held-out buffers, on the process of the last stage (whose rows go
    /// to every other process).
    pub(super) capture: Option<(DraftBufferHandle, DraftBufferHandle)>,
    /// Held-out rows taken so far (sent or dropped before the step end).
    pub(super) held_sent: Mutex<u64>,
}

impl RoundPeers for Peers {
    fn step_end(
        &self,
        _rank: usize,
        step: u64,
        post: Option<&RoundPost>,
    ) -> Result<(), ModelError> {
        let mut messages = Vec::new();
        if let Some((buffer, held_out)) = &self.capture {
            let wire = RowWire::of;
            let rows: Vec<RowWire> = buffer
                .lock()
                .rows()
                .filter(|r| r.step == step)
                .map(wire)
                .collect();
            // The held-out buffer is one generation that never turns over (its rows all
            // say step 0): what it took since the last step end is its newest rows.
            let held: Vec<RowWire> = {
                let held_out = held_out.lock();
                let taken = held_out.dropped() + held_out.len() as u64;
                let mut sent = lock(&self.held_sent);
                let new = (taken - *sent).min(held_out.len() as u64) as usize;
                *sent = taken;
                let skip = held_out.len() - new;
                held_out.rows().skip(skip).map(wire).collect()
            };
            // The training rows go even when there are none: the step turned the last
            // stage's buffer over, and every copy turns over with it. Rows go before the
            // post: under the planned placement a complete round then means its step's rows
            // are in everywhere.
            messages.push(FillWire::Rows {
                step,
                held_out: false,
                rows,
            });
            if !held.is_empty() {
                messages.push(FillWire::Rows {
                    step,
                    held_out: true,
                    rows: held,
                });
            }
        }
        messages.extend(post.cloned().map(|post| FillWire::Post { step, post }));
        let outbox = lock(&self.outbox);
        for m in messages {
            outbox.send(m).map_err(|_| ModelError::DrafterInput {
                what: "exchange",
                reason: "the sender to the other processes has stopped".into(),
            })?;
        }
        Ok(())
    }
}

/// The sender thread: every queued message to every peer, in order, until `Done`.
pub(super) fn send_all(
    rank: usize,
    mesh: &TcpMesh,
    peers: &[usize],
    rx: Receiver<FillWire>,
) -> Result<(), PipelineError> {
    for wire in rx {
        let done = matches!(wire, FillWire::Done);
        let bytes = encode(rank, &wire)?;
        for &peer in peers {
            mesh.send(peer, FILL_CHANNEL, &bytes)
                .map_err(|e| peer_err(rank, peer, mesh.failure().unwrap_or(e.to_string())))?;
        }
        if done {
            break;
        }
    }
    Ok(())
}

/// A receiver thread: `peer`'s rows into this process's buffers, its posts into the
/// exchange, until its `Done`.
pub(super) fn receive(
    rank: usize,
    peer: usize,
    mesh: &TcpMesh,
    fill: &DrafterFill,
) -> Result<(), PipelineError> {
    let drafter_err = |e: ModelError| peer_err(rank, peer, e);
    loop {
        let bytes = mesh
            .recv(peer, FILL_CHANNEL)
            .map_err(|e| peer_err(rank, peer, mesh.failure().unwrap_or(e.to_string())))?;
        match decode(rank, peer, &bytes)? {
            FillWire::Rows {
                step,
                held_out,
                rows,
            } => {
                // As on the last stage: the training buffer turns over by step, the
                // held-out one never does.
                let handle = if held_out {
                    fill.held_out()
                } else {
                    fill.buffer()
                };
                let mut buffer = handle.lock();
                if !held_out {
                    buffer.begin_step(step);
                }
                for r in rows {
                    buffer.push(r.row(step)).map_err(drafter_err)?;
                }
            }
            FillWire::Post { step, post } if fill.is_planned() => {
                fill.post_remote_at(step, post).map_err(drafter_err)?
            }
            FillWire::Post { post, .. } => fill.post_remote(post).map_err(drafter_err)?,
            FillWire::Done => return Ok(()),
            FillWire::Seed { name, .. } => {
                return Err(peer_err(
                    rank,
                    peer,
                    format!("sent seed {name} during the run"),
                ));
            }
        }
    }
}
