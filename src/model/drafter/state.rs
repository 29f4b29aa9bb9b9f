//! The drafter's state in a checkpoint ([`DrafterState`]): what a run that trains the drafter
//! in its bubbles needs to continue from the same drafter instead of a fresh one.
//!
//! It holds one replica's trainable weights (with the drafter version and the target step of
//! its frozen tables; not the tables themselves, which a resumed run takes from the target's
//! checkpoint: `pipeline/fill/state.rs` says when they must travel anyway), its AdamW state,
//! every replica's row sampler (each replica draws its own stream), and the rows of the
//! training and held-out buffers (both generations, in order). The replicas of a pipelined
//! run apply the same update at every drafter step, so one replica's weights and optimizer
//! stand for all of them; gradients accumulated since the last drafter step (an open
//! exchange round) are not kept: the resumed run starts a fresh round at the saved version.
//! Under a planned placement ([`super::FillMode::Planned`]) the round of the step just
//! finished is complete but applied only at the end of the next step, so it is kept
//! ([`RoundState`]): a resumed run applies it where an uninterrupted run would.
//!
//! On disk ([`crate::model::checkpoint::drafter`]) the floats go into a safetensors file
//! under the names [`DrafterState::to_parts`] gives, and the rest (version, samplers, the
//! rows' targets and steps) into the checkpoint's JSON as [`DrafterMeta`].

use serde::{Deserialize, Serialize};

use super::Result;
use super::{DraftBuffer, DraftRow, DrafterGrads, DrafterTrainer, DrafterWeights, NamedTensor};
use crate::data::SplitMix64;
use crate::model::ModelError;
use crate::model::OptimizerState;
use crate::model::SlotState;
use crate::model::checkpoint::HostTensor;
use crate::tensor::Backend;

/// Name prefix of the drafter's weights in a checkpoint's drafter file.
pub const WEIGHT_PREFIX: &str = "drafter.w.";
/// Name prefixes of the drafter's AdamW first and second moments and master weights.
pub const ADAM_PREFIXES: [&str; 3] = ["drafter.m.", "drafter.v.", "drafter.master."];
/// Name prefix of a kept round's gradients (`drafter.round.{replica}.{param}`) and frozen
/// copies (`drafter.round.frozen.{param}`).
pub const ROUND_PREFIX: &str = "drafter.round.";

/// The rows of a [`DraftBuffer`], both generations.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BufferState {
    /// The target step whose rows are current.
    pub step: Option<u64>,
    /// The previous step's rows, oldest first.
    pub previous: Vec<DraftRow>,
    /// The current step's rows, oldest first.
    pub current: Vec<DraftRow>,
}

impl BufferState {
    /// A copy of `buffer`'s rows.
    pub fn of(buffer: &DraftBuffer) -> Self {
        let rows: Vec<DraftRow> = buffer.rows().cloned().collect();
        let (previous, current) = rows.split_at(buffer.previous_len());
        BufferState {
            step: buffer.step(),
            previous: previous.to_vec(),
            current: current.to_vec(),
        }
    }

    /// The rows of target steps before `step` only (rows of `step` and later that were
    /// arriving when the state was taken are dropped; a resumed run computes them again).
    pub fn before(&self, step: u64) -> Self {
        let keep = |rows: &[DraftRow]| rows.iter().filter(|r| r.step < step).cloned().collect();
        BufferState {
            step: self.step,
            previous: keep(&self.previous),
            current: keep(&self.current),
        }
    }

    /// Puts the rows back into an empty `buffer`, each generation under its own step.
    pub fn restore(&self, buffer: &mut DraftBuffer) -> Result<()> {
        if !buffer.is_empty() || buffer.step().is_some() {
            return Err(ModelError::DrafterInput {
                what: "buffer state",
                reason: "restored into a buffer that is already in use".into(),
            });
        }
        if let Some(first) = self.previous.first() {
            buffer.begin_step(first.step);
            for row in &self.previous {
                buffer.push(row.clone())?;
            }
        }
        if let Some(step) = self.step {
            buffer.begin_step(step);
        }
        for row in &self.current {
            buffer.push(row.clone())?;
        }
        Ok(())
    }

    /// The hidden states of every row (previous generation first) as one
    /// `[positions, d_model]` tensor `{prefix}.hidden`, and the rest as metadata.
    fn to_parts(&self, prefix: &str, d_model: usize) -> (Vec<HostTensor>, BufferMeta) {
        let rows = self.previous.iter().chain(&self.current);
        let positions: usize = rows.clone().map(DraftRow::len).sum();
        let mut tensors = Vec::new();
        if positions > 0 {
            let mut hidden = Vec::with_capacity(positions * d_model);
            for r in rows.clone() {
                hidden.extend_from_slice(&r.hidden);
            }
            tensors.push(HostTensor {
                name: format!("{prefix}.hidden"),
                shape: vec![positions, d_model],
                data: hidden,
            });
        }
        let meta = BufferMeta {
            step: self.step,
            previous: self.previous.len(),
            rows: rows
                .map(|r| RowMeta {
                    step: r.step,
                    targets: r.targets.clone(),
                })
                .collect(),
        };
        (tensors, meta)
    }

    fn from_parts(
        prefix: &str,
        meta: &BufferMeta,
        tensors: &[HostTensor],
        d_model: usize,
    ) -> Result<Self> {
        let positions: usize = meta.rows.iter().map(|r| r.targets.len()).sum();
        let name = format!("{prefix}.hidden");
        let hidden: &[f32] = if positions == 0 {
            &[]
        } else {
            &find(tensors, &name)?.data
        };
        if hidden.len() != positions * d_model {
            return Err(bad(format!(
                "`{name}` has {} values, its {} rows need {}",
                hidden.len(),
                meta.rows.len(),
                positions * d_model
            )));
        }
        let mut rows = Vec::with_capacity(meta.rows.len());
        let mut at = 0;
        for r in &meta.rows {
            let n = r.targets.len();
            rows.push(DraftRow {
                hidden: hidden[at * d_model..(at + n) * d_model].to_vec(),
                targets: r.targets.clone(),
                step: r.step,
            });
            at += n;
        }
        if meta.previous > rows.len() {
            return Err(bad(format!(
                "{prefix}: {} previous rows of {}",
                meta.previous,
                rows.len()
            )));
        }
        let current = rows.split_off(meta.previous);
        Ok(BufferState {
            step: meta.step,
            previous: rows,
            current,
        })
    }
}

/// A buffer's rows without their floats.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BufferMeta {
    pub step: Option<u64>,
    /// How many of `rows` are the previous generation's (they come first).
    pub previous: usize,
    pub rows: Vec<RowMeta>,
}

/// One row without its floats.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RowMeta {
    pub step: u64,
    pub targets: Vec<u32>,
}

/// What a checkpoint stores of the drafter besides its floats (its JSON part).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterMeta {
    /// Drafter optimizer steps taken.
    pub version: u64,
    /// Target step of the frozen tables' last refresh.
    pub frozen_step: Option<u64>,
    /// AdamW's step counter.
    pub optimizer_step: u64,
    /// Each replica's row sampler, by replica.
    pub samplers: Vec<SplitMix64>,
    pub buffer: BufferMeta,
    pub held_out: BufferMeta,
    /// The kept round of a planned placement (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<RoundMeta>,
}

/// A kept round without its floats.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoundMeta {
    pub step: u64,
    /// The drafter version the gradients were posted at.
    pub version: u64,
    /// Pairs counted by each replica, by replica.
    pub pairs: Vec<usize>,
    /// The gradients' parameter names, in order.
    pub params: Vec<String>,
    /// Target steps of the frozen copies posted with the round.
    pub embed_step: Option<u64>,
    pub head_step: Option<u64>,
}

/// A planned placement's round that every replica posted and none applied yet (see the
/// module docs): each replica's gradients, by replica, and the frozen copies posted with it,
/// `(target step, values)`.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundState {
    /// The target step whose slices it holds.
    pub step: u64,
    pub grads: Vec<DrafterGrads>,
    pub embed: Option<(u64, Vec<f32>)>,
    pub head: Option<(u64, Vec<f32>)>,
}

impl RoundState {
    fn to_parts(&self) -> (Vec<HostTensor>, RoundMeta) {
        let mut tensors = Vec::new();
        for g in &self.grads {
            for t in &g.tensors {
                tensors.push(HostTensor {
                    name: format!("{ROUND_PREFIX}{}.{}", g.replica, t.name),
                    shape: t.shape.clone(),
                    data: t.values.clone(),
                });
            }
        }
        for (name, copy) in [("embed.tok", &self.embed), ("head.w", &self.head)] {
            if let Some((_, values)) = copy {
                tensors.push(HostTensor {
                    name: format!("{ROUND_PREFIX}frozen.{name}"),
                    shape: vec![values.len()],
                    data: values.clone(),
                });
            }
        }
        let meta = RoundMeta {
            step: self.step,
            version: self.grads.first().map_or(0, |g| g.version),
            pairs: self.grads.iter().map(|g| g.pairs).collect(),
            params: self.grads.first().map_or_else(Vec::new, |g| {
                g.tensors.iter().map(|t| t.name.clone()).collect()
            }),
            embed_step: self.embed.as_ref().map(|(s, _)| *s),
            head_step: self.head.as_ref().map(|(s, _)| *s),
        };
        (tensors, meta)
    }

    fn from_parts(meta: &RoundMeta, tensors: &[HostTensor]) -> Result<Self> {
        let mut grads = Vec::with_capacity(meta.pairs.len());
        for (replica, &pairs) in meta.pairs.iter().enumerate() {
            let tensors = meta
                .params
                .iter()
                .map(|name| {
                    let t = find(tensors, &format!("{ROUND_PREFIX}{replica}.{name}"))?;
                    Ok(NamedTensor {
                        name: name.clone(),
                        shape: t.shape.clone(),
                        values: t.data.clone(),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            grads.push(DrafterGrads {
                version: meta.version,
                replica,
                pairs,
                tensors,
            });
        }
        let copy = |name: &str, step: Option<u64>| -> Result<Option<(u64, Vec<f32>)>> {
            step.map(|s| {
                let t = find(tensors, &format!("{ROUND_PREFIX}frozen.{name}"))?;
                Ok((s, t.data.clone()))
            })
            .transpose()
        };
        Ok(RoundState {
            step: meta.step,
            grads,
            embed: copy("embed.tok", meta.embed_step)?,
            head: copy("head.w", meta.head_step)?,
        })
    }
}

/// The drafter's state (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct DrafterState {
    /// Trainable weights, version and frozen step (of replica 0; the replicas hold the same).
    /// The frozen tables only where they lag the target's weights in the same checkpoint,
    /// or in a file written before the tables were shared.
    pub weights: DrafterWeights,
    pub optimizer: OptimizerState,
    /// Each replica's row sampler, by replica.
    pub samplers: Vec<SplitMix64>,
    pub buffer: BufferState,
    pub held_out: BufferState,
    /// The kept round of a planned placement.
    pub round: Option<RoundState>,
}

impl DrafterState {
    /// The floats as named tensors and the rest as [`DrafterMeta`]; `d_model` is the
    /// target's (the rows' width).
    pub fn to_parts(&self, d_model: usize) -> (Vec<HostTensor>, DrafterMeta) {
        let mut tensors: Vec<HostTensor> = self
            .weights
            .tensors
            .iter()
            .map(|t| HostTensor {
                name: format!("{WEIGHT_PREFIX}{}", t.name),
                shape: t.shape.clone(),
                data: t.values.clone(),
            })
            .collect();
        let shape_of = |name: &str| {
            self.weights
                .tensors
                .iter()
                .find(|t| t.name == name)
                .map(|t| t.shape.clone())
        };
        for (name, slot) in &self.optimizer.slots {
            let parts = [Some(&slot.m), Some(&slot.v), slot.master.as_ref()];
            for (prefix, data) in ADAM_PREFIXES.iter().zip(parts) {
                if let Some(data) = data {
                    tensors.push(HostTensor {
                        name: format!("{prefix}{name}"),
                        shape: shape_of(name).unwrap_or_else(|| vec![data.len()]),
                        data: data.clone(),
                    });
                }
            }
        }
        let (buffer, buffer_meta) = self.buffer.to_parts("drafter.buffer", d_model);
        let (held, held_meta) = self.held_out.to_parts("drafter.held_out", d_model);
        tensors.extend(buffer);
        tensors.extend(held);
        let round = self.round.as_ref().map(|r| {
            let (t, meta) = r.to_parts();
            tensors.extend(t);
            meta
        });
        let meta = DrafterMeta {
            round,
            version: self.weights.version,
            frozen_step: self.weights.frozen_step,
            optimizer_step: self.optimizer.step,
            samplers: self.samplers.clone(),
            buffer: buffer_meta,
            held_out: held_meta,
        };
        (tensors, meta)
    }

    /// The state [`DrafterState::to_parts`] split.
    pub fn from_parts(meta: &DrafterMeta, tensors: &[HostTensor], d_model: usize) -> Result<Self> {
        if let Some(t) = tensors.iter().find(|t| t.name.ends_with(".probs")) {
            return Err(bad(format!(
                "`{}`: a drafter file of the older format, whose buffer kept next-token \
                 distributions; this version keeps hidden states only and cannot resume it: \
                 resume from a checkpoint this version wrote",
                t.name
            )));
        }
        let weights = DrafterWeights {
            version: meta.version,
            frozen_step: meta.frozen_step,
            tensors: tensors
                .iter()
                .filter_map(|t| {
                    t.name.strip_prefix(WEIGHT_PREFIX).map(|name| NamedTensor {
                        name: name.to_string(),
                        shape: t.shape.clone(),
                        values: t.data.clone(),
                    })
                })
                .collect(),
        };
        let mut optimizer = OptimizerState {
            step: meta.optimizer_step,
            ..OptimizerState::default()
        };
        for t in tensors {
            let Some(name) = t.name.strip_prefix(ADAM_PREFIXES[0]) else {
                continue;
            };
            let v = find(tensors, &format!("{}{name}", ADAM_PREFIXES[1]))?;
            let master = tensors
                .iter()
                .find(|m| m.name == format!("{}{name}", ADAM_PREFIXES[2]))
                .map(|m| m.data.clone());
            optimizer.slots.insert(
                name.to_string(),
                SlotState {
                    m: t.data.clone(),
                    v: v.data.clone(),
                    master,
                },
            );
        }
        Ok(DrafterState {
            weights,
            optimizer,
            samplers: meta.samplers.clone(),
            buffer: BufferState::from_parts("drafter.buffer", &meta.buffer, tensors, d_model)?,
            held_out: BufferState::from_parts(
                "drafter.held_out",
                &meta.held_out,
                tensors,
                d_model,
            )?,
            round: meta
                .round
                .as_ref()
                .map(|r| RoundState::from_parts(r, tensors))
                .transpose()?,
        })
    }
}

fn bad(reason: String) -> ModelError {
    ModelError::DrafterInput {
        what: "checkpointed state",
        reason,
    }
}

fn find<'a>(tensors: &'a [HostTensor], name: &str) -> Result<&'a HostTensor> {
    tensors
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| bad(format!("no tensor `{name}`")))
}

impl<B: Backend> DrafterTrainer<B> {
    /// This replica's weights (with version and frozen step) and optimizer state, as a
    /// checkpoint stores them.
    pub fn export_state(&self) -> Result<(DrafterWeights, OptimizerState)> {
        Ok((self.weights()?, self.optimizer_state()?))
    }

    /// Continues from a checkpoint's weights (version and frozen copies included), optimizer
    /// state and this replica's sampler.
    pub fn import_state(
        &mut self,
        weights: &DrafterWeights,
        optimizer: &OptimizerState,
        sampler: SplitMix64,
    ) -> Result<()> {
        self.load_weights(weights)?;
        self.load_optimizer_state(optimizer)?;
        self.set_sampler(sampler);
        Ok(())
    }
}

#[cfg(test)]
#[path = "tests/state.rs"]
mod tests;
