//! Activation recomputation (gradient checkpointing): what a forward keeps for its backward,
//! and what the input-gradient backward (I) computes again instead.
//!
//! - [`Recompute::None`]: every layer keeps what its I needs (the attention probabilities
//!   included, `heads × seq` per token: the part that grows with the square of the sequence).
//! - [`Recompute::Selective`]: attention keeps its projections `q`, `k`, `v` only; its I
//!   runs the attention kernel again for the probabilities and the output (Megatron-LM's
//!   `--recompute-granularity selective`, "core attention").
//! - [`Recompute::Full`]: a chunk keeps each block's input only; its I runs the block's
//!   forward again, then the block's I (Megatron-LM's `full` with one block per checkpoint).
//!   The rerun stops short of the block's output, which nothing reads: the MLP's down
//!   projection is not run again (a quarter to a third of a block's multiply-adds).
//!
//! The backward stays split: I recomputes, computes the input gradient, and keeps what W
//! needs (the weights' inputs and the projections' output gradients), as without
//! recomputation. So recomputation shrinks what is held from F to I, not from I to W: a
//! schedule that defers W's holds their stash in every mode ([`BlockStash`]). The kernels
//! are deterministic, so a recomputed forward is bitwise the first one and training is
//! bitwise the same in every mode.
//!
//! [`RecomputeSetting`] is the job's `train.recompute`: one mode for every rank, or one per
//! pipeline rank (a rank holding the first stages keeps the most micro-batches in flight).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::GptConfig;

/// What a forward keeps and its I recomputes (module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Recompute {
    /// Keep everything the backward needs.
    #[default]
    None,
    /// Recompute attention's probabilities and output (the `seq²` part).
    Selective,
    /// Keep each block's input only; recompute the block's forward before its I.
    Full,
}

impl Recompute {
    /// Every mode, least recomputation first.
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

    /// The name a job file uses.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }

    /// The mode called `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Elements per token that one block holds in this mode, for sequences of `seq`
    /// positions ([`BlockStash`]).
    pub fn block_stash(self, config: &GptConfig, seq: usize) -> BlockStash {
        // Saturating: a size too large to count is the memory estimate's error to name.
        let n = |x: usize| x as u64;
        let (d, kv, hidden) = (
            n(config.d_model),
            n(config.kv_dim()),
            n(config.mlp_hidden()),
        );
        let gate = if config.activation.is_gated() {
            hidden
        } else {
            0
        };
        let probs = n(config.heads).saturating_mul(n(seq));
        let sum = |xs: &[u64]| xs.iter().fold(0u64, |a, &x| a.saturating_add(x));
        let times = |k: u64, x: u64| x.saturating_mul(k);
        // RMSNorm: its input and one rstd per row; attention: its input, q, k, v (k and v
        // repeated to `heads`), probabilities and output; the MLP: its input, `x·W1` and
        // the activation (and when gated silu(x·W1) and the up projection).
        let norms = times(2, d.saturating_add(1));
        let attn_core = sum(&[probs, d]);
        let attn = sum(&[times(4, d), attn_core]);
        let mlp = sum(&[d, times(2, hidden), times(2, gate)]);
        let all = sum(&[norms, attn, mlp]);
        // W: each norm its input, rstd and output gradient; attention its input, output,
        // output gradient and the projections' gradients (k, v at kv width); the MLP its
        // input, the activation, the gradients of `x·W1` (and of the up projection) and its
        // output gradient.
        let for_w = sum(&[
            times(2, times(2, d).saturating_add(1)),
            times(4, d),
            times(2, kv),
            times(2, d),
            times(2, hidden),
            gate,
        ]);
        let (forward, transient) = match self {
            Recompute::None => (all, 0),
            Recompute::Selective => (all.saturating_sub(attn_core), attn_core),
            Recompute::Full => (d, all),
        };
        BlockStash {
            forward,
            for_w,
            transient,
        }
    }

    /// The share of a block's forward multiply-adds its I runs again in this mode, for
    /// sequences of `seq` positions: 0, the attention kernel's (`2·seq·d` per token against
    /// the projections' and the MLP's), or all but the MLP's down projection (whose output
    /// I does not read: [`super::layers::Layer::refill`]).
    pub fn rerun_share(self, config: &GptConfig, seq: usize) -> f64 {
        let d = config.d_model as f64;
        let kv = config.kv_dim() as f64;
        let hidden = config.mlp_hidden() as f64;
        let mlp = if config.activation.is_gated() {
            3.0
        } else {
            2.0
        } * d
            * hidden;
        // Causal attention: scores and the weighted sum, each about seq/2 · d per token.
        let core = seq as f64 * d;
        let block = 2.0 * d * d + 2.0 * d * kv + core + mlp;
        match self {
            Recompute::None => 0.0,
            Recompute::Selective => core / block,
            Recompute::Full => (block - d * hidden) / block,
        }
    }
}

impl Recompute {
    /// This mode's cost and saving as shares of a stage's forward, for the schedule's cost
    /// model ([`pipefill_schedules::Recomputation`]): the forward keeps its share of the
    /// blocks' stash, and I reruns [`Recompute::rerun_share`] of the forward.
    pub fn recomputation(
        self,
        config: &GptConfig,
        seq: usize,
    ) -> pipefill_schedules::Recomputation {
        let none = Recompute::None.block_stash(config, seq).forward.max(1) as f64;
        pipefill_schedules::Recomputation {
            name: self.name().into(),
            keep: self.block_stash(config, seq).forward as f64 / none,
            rerun: self.rerun_share(config, seq),
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Elements per token that one block holds for one micro-batch, by phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockStash {
    /// From F until I.
    pub forward: u64,
    /// From I until W (the same in every mode).
    pub for_w: u64,
    /// Held for a moment during I: the recomputed part of one block.
    pub transient: u64,
}

/// `train.recompute`: one mode for every pipeline rank, or one per rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RecomputeSetting {
    Every(Recompute),
    PerRank(Vec<Recompute>),
}

impl Default for RecomputeSetting {
    fn default() -> Self {
        RecomputeSetting::Every(Recompute::None)
    }
}

impl RecomputeSetting {
    /// Whether it is the default (left out of a serialized job, so that a job without it
    /// serializes as before it existed).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// The mode of pipeline rank `rank` (a per-rank list is checked against the ranks by
    /// [`RecomputeSetting::check`]; past its end, the last entry).
    pub fn of_rank(&self, rank: usize) -> Recompute {
        match self {
            RecomputeSetting::Every(m) => *m,
            RecomputeSetting::PerRank(list) => {
                list.get(rank).or(list.last()).copied().unwrap_or_default()
            }
        }
    }

    /// The mode of the whole model on one device (the reference trainer): the most
    /// recomputation any rank does, since that device holds every rank's layers.
    pub fn strongest(&self) -> Recompute {
        match self {
            RecomputeSetting::Every(m) => *m,
            RecomputeSetting::PerRank(list) => list.iter().copied().max().unwrap_or_default(),
        }
    }

    /// Why the setting does not fit a pipeline of `ranks` ranks: a per-rank list has one
    /// entry per rank.
    pub fn check(&self, ranks: usize) -> Result<(), String> {
        match self {
            RecomputeSetting::PerRank(list) if list.len() != ranks => Err(format!(
                "has {} entries; a per-rank list needs one per pipeline rank ({ranks})",
                list.len()
            )),
            _ => Ok(()),
        }
    }
}

impl Serialize for RecomputeSetting {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            RecomputeSetting::Every(m) => s.serialize_str(m.name()),
            RecomputeSetting::PerRank(list) => s.collect_seq(list.iter().map(|m| m.name())),
        }
    }
}

const EXPECTED: &str = "\"none\", \"selective\" or \"full\", or a list of them, one per rank";

fn mode<E: serde::de::Error>(name: &str) -> Result<Recompute, E> {
    Recompute::from_name(name).ok_or_else(|| {
        E::custom(format!(
            "unknown recompute mode `{name}`, expected {EXPECTED}"
        ))
    })
}

impl<'de> Deserialize<'de> for RecomputeSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = RecomputeSetting;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                mode(v).map(RecomputeSetting::Every)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut list = Vec::new();
                while let Some(name) = seq.next_element::<String>()? {
                    list.push(mode(&name)?);
                }
                if list.is_empty() {
                    return Err(serde::de::Error::custom(format!(
                        "an empty list, expected {EXPECTED}"
                    )));
                }
                Ok(RecomputeSetting::PerRank(list))
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl Serialize for Recompute {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Recompute {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        mode(&name)
    }
}
