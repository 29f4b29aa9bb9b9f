//! [`RlConfig`]: the `[rl]` section of a job file, read by `pipefill rl`.
//!
//! The model, data families, schedule, stages and clock are the job's own sections; this
//! section says how many RL steps to run, what each step samples and how it updates.

use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use crate::data::reward::Reward;
use crate::model::drafter::TreeShape;

/// The `[rl]` section: GRPO rollouts and update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RlConfig {
    /// RL steps (one rollout batch and one pipelined update each).
    pub steps: u64,
    /// Prompts per step.
    pub prompts: usize,
    /// Completions sampled per prompt (the GRPO group size G).
    pub group: usize,
    /// Sampling temperature of the rollouts (> 0).
    pub temperature: f32,
    /// Most tokens generated per completion (prompt plus completion must fit
    /// `model.seq_len`; longer prompts are skipped).
    pub max_new_tokens: usize,
    /// How a completion of a JSONL `prompt`/`answer` record is scored: `"numeric"` (the
    /// number after GSM8K's `####`, else the last number), `"exact"` (trimmed texts equal)
    /// or `"boxed"` (MATH's last `\boxed{}`). Synthetic tasks use their own checker.
    pub reward: Reward,
    /// Clip range ε of the policy ratio.
    pub clip: f32,
    /// Weight β of the k3 KL penalty to the frozen initial policy (0: none). With β > 0 the
    /// reference's log-probs are computed once per rollout batch and the update's head
    /// takes the per-token GRPO loss ([`crate::rl::update::GrpoTokenLoss`]).
    pub kl_coef: f32,
    /// Learning rate of the RL updates (constant).
    pub lr: f32,
    /// Supervised steps on the same tasks before RL when no `--init` run is given; unset,
    /// [`RlConfig::warmup`] chooses: none for a pretrained policy (`--model`), where the
    /// synthetic tasks would only pull it away from what it knows, else [`WARMUP_STEPS`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<u64>,
    /// Speculative decoding in the rollouts (lossless: the samples' distribution is the
    /// same either way).
    pub speculation: bool,
    /// Longest draft chain the rollout engine may choose (with `draft_tree`: deepest tree).
    pub draft_k: usize,
    /// Draft trees instead of chains (`[rl.draft_tree]`: `branch`, `width`, `nodes`; the
    /// bandit's K is the depth). Off by default: on the CPU a tree's extra accepted tokens
    /// did not pay for its dearer verification (docs/benchmarks.md, "Why the defaults").
    pub draft_tree: Option<DraftTreeConfig>,
    /// Speculate only while at most this many sequences are still generating: a number, or
    /// `"auto"` (the default) to derive it from the policy's and drafter's step costs,
    /// measured once at the start, and the drafter's acceptance measured every step
    /// ([`crate::rl::calibrate`]).
    pub spec_threshold: SpecThreshold,
    /// Drafter training slices on each step's rollouts.
    pub drafter_slices: usize,
    /// AdamW learning rate of the drafter during RL when it starts trained (the `--init`
    /// run's drafter, from its bubbles); an untrained drafter learns at `drafter.lr`. A
    /// trained drafter only has to follow a slowly moving policy on each step's few rows,
    /// hence a tenth of `drafter.lr` (docs/benchmarks.md, "Why the defaults").
    pub drafter_lr: f32,
    /// Seed of the prompt stream and of sampling.
    pub seed: u64,
    /// Internal tuning (`[rl.advanced]`).
    pub advanced: RolloutTuning,
}

/// `[rl.advanced]`: the rollout engine's internal tuning, not a job's intent. Every field has
/// the default the engine was measured with; a job sets one only to experiment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutTuning {
    /// A plain decode step (K = 0) among the bandit's arms, so that in each live-batch bucket
    /// below the threshold it learns, from the rollouts' own step costs, whether speculating
    /// pays there at all.
    pub plain_arm: bool,
    /// Where the drafter's per-step work (`rl.drafter_slices` slices on the step's rollouts,
    /// and the held-out evaluation) runs: `"idle"` (the default) in the rollout stages' idle
    /// time (the long tail), routed by a `FillerRouter` with the verification passes, what
    /// the gaps did not take carried into the next step's idle budget (at most one step's
    /// budget carried, the rest dropped and counted), so the drafter trains only in idle
    /// time; `"idle-then-after"` in the idle time, the rest after the rollout on the step's
    /// critical path; `"after"` all of it after the rollout.
    pub drafter_work: DrafterTiming,
    /// Fewest positions (sequences × rows each: 1 decoding, K+1 verifying) a group step
    /// carries: the rollout engine merges groups smaller than this instead of sending
    /// them through the stages one behind another, since each group step reads every
    /// stage's weights. 1 (the default) keeps `stages` groups however small they get: while
    /// the weights sit in the cache, more groups in flight use more cores; merging pays once
    /// they outgrow it (docs/benchmarks.md, "Why the defaults").
    pub min_group_rows: usize,
}

impl Default for RolloutTuning {
    fn default() -> Self {
        Self {
            plain_arm: true,
            drafter_work: DrafterTiming::Idle,
            min_group_rows: 1,
        }
    }
}

impl Default for RlConfig {
    fn default() -> Self {
        Self {
            steps: 20,
            prompts: 4,
            group: 4,
            temperature: 1.0,
            max_new_tokens: 48,
            reward: Reward::Numeric,
            clip: 0.2,
            kl_coef: 0.0,
            lr: 3e-4,
            warmup_steps: None,
            speculation: true,
            draft_k: 4,
            draft_tree: None,
            spec_threshold: SpecThreshold::Auto,
            drafter_slices: 16,
            drafter_lr: 3e-4,
            seed: 0,
            advanced: RolloutTuning::default(),
        }
    }
}

/// `rl.warmup_steps` of a policy that is not pretrained: the synthetic job's.
pub const WARMUP_STEPS: u64 = 200;

impl RlConfig {
    /// Supervised warm-up steps before RL: `warmup_steps`, or without it none for a
    /// `pretrained` policy (the job's `model.from`) and [`WARMUP_STEPS`] otherwise.
    pub fn warmup(&self, pretrained: bool) -> u64 {
        self.warmup_steps
            .unwrap_or(if pretrained { 0 } else { WARMUP_STEPS })
    }

    /// Checks that the policy starts trained: from an `--init` run (`init_given`), from a
    /// `pretrained` model, or after its warm-up's supervised steps.
    pub fn check_trained(&self, init_given: bool, pretrained: bool) -> Result<(), ConfigError> {
        match init_given || pretrained || self.warmup(pretrained) > 0 {
            true => Ok(()),
            false => Err(ConfigError::UntrainedPolicy),
        }
    }

    /// Sequences per step: `prompts × group` (one micro-batch each in the update).
    pub fn sequences(&self) -> usize {
        self.prompts * self.group
    }

    /// Checks the values a deserializer cannot; the error names the field as `rl.<field>`.
    pub fn validate(&self, seq_len: usize) -> Result<(), ConfigError> {
        let bad = |field: &str, reason: String| {
            Err(ConfigError::Invalid {
                field: format!("rl.{field}"),
                reason,
            })
        };
        if self.steps == 0 {
            return bad("steps", "must be at least 1".into());
        }
        if self.prompts == 0 {
            return bad("prompts", "must be at least 1".into());
        }
        if self.advanced.min_group_rows == 0 {
            return bad("advanced.min_group_rows", "must be at least 1".into());
        }
        if self.group < 2 {
            return bad(
                "group",
                format!(
                    "is {}: GRPO compares completions within a group, so it needs at least 2",
                    self.group
                ),
            );
        }
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return bad(
                "temperature",
                format!("must be a positive number, got {}", self.temperature),
            );
        }
        if self.max_new_tokens == 0 || self.max_new_tokens >= seq_len {
            return bad(
                "max_new_tokens",
                format!(
                    "is {}: must be at least 1 and leave room for a prompt in model.seq_len = \
                     {seq_len}",
                    self.max_new_tokens
                ),
            );
        }
        if !(self.clip.is_finite() && self.clip > 0.0 && self.clip < 1.0) {
            return bad("clip", format!("must be in (0, 1), got {}", self.clip));
        }
        if !(self.kl_coef.is_finite() && self.kl_coef >= 0.0) {
            return bad(
                "kl_coef",
                format!("must be a finite number ≥ 0, got {}", self.kl_coef),
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", format!("must be a positive number, got {}", self.lr));
        }
        if !(self.drafter_lr.is_finite() && self.drafter_lr >= 0.0) {
            return bad(
                "drafter_lr",
                format!("must be a finite number ≥ 0, got {}", self.drafter_lr),
            );
        }
        if self.draft_k == 0 {
            return bad("draft_k", "must be at least 1".into());
        }
        if let Some((field, why)) = self.tree_shape().and_then(|t| t.check()) {
            let field = match field {
                "depth" => "draft_k",
                "branch" => "draft_tree.branch",
                "width" => "draft_tree.width",
                _ => "draft_tree.nodes",
            };
            return bad(field, why);
        }
        Ok(())
    }

    /// The drafter's tree shape at the deepest K, when trees are on.
    pub fn tree_shape(&self) -> Option<TreeShape> {
        self.draft_tree.map(|t| TreeShape {
            depth: self.draft_k,
            branch: t.branch,
            width: t.width,
            nodes: t.nodes,
        })
    }
}

/// `rl.advanced.drafter_work`: where the drafter's per-step work runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DrafterTiming {
    /// In the rollout's idle gaps; the rest carried to the next step's.
    #[default]
    Idle,
    /// In the rollout's idle gaps; the rest after the rollout.
    IdleThenAfter,
    /// After the rollout.
    After,
}

/// Where the drafter work the rollout's idle gaps did not take goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrafterLeftover {
    /// Into the next step's idle budget (capped at one step's budget): nothing after the
    /// rollout.
    Defer,
    /// Run after the rollout on the caller's thread (on the step's critical path).
    After,
}

impl DrafterTiming {
    /// The setting as written in a job file.
    pub fn as_str(self) -> &'static str {
        match self {
            DrafterTiming::Idle => "idle",
            DrafterTiming::IdleThenAfter => "idle-then-after",
            DrafterTiming::After => "after",
        }
    }

    /// Whether the rollout's idle gaps take drafter work at all.
    pub fn in_idle_time(self) -> bool {
        self != DrafterTiming::After
    }

    /// Where what the gaps did not take goes (with `After`, all of it goes after).
    pub fn leftover(self) -> DrafterLeftover {
        match self {
            DrafterTiming::Idle => DrafterLeftover::Defer,
            DrafterTiming::IdleThenAfter | DrafterTiming::After => DrafterLeftover::After,
        }
    }
}

impl<'de> Deserialize<'de> for DrafterTiming {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const EXPECTED: &str = "\"idle\" (in the rollout's idle time, the rest carried to the \
                                next step's), \"idle-then-after\" (the rest after the rollout) or \
                                \"after\" (all after the rollout)";
        impl serde::de::Visitor<'_> for V {
            type Value = DrafterTiming;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<DrafterTiming, E> {
                match s.trim() {
                    "idle" => Ok(DrafterTiming::Idle),
                    "idle-then-after" => Ok(DrafterTiming::IdleThenAfter),
                    "after" => Ok(DrafterTiming::After),
                    other => Err(E::custom(format!(
                        "drafter_work is {other:?}: expected {EXPECTED}"
                    ))),
                }
            }
        }
        d.deserialize_str(V)
    }
}

/// `rl.spec_threshold`: a live-batch size, or `"auto"` (calibrated from measurement).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpecThreshold {
    /// Derived from measured step costs and acceptance ([`crate::rl::calibrate`]).
    #[default]
    Auto,
    /// Speculate while at most this many sequences are live.
    Live(usize),
}

impl std::fmt::Display for SpecThreshold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpecThreshold::Auto => f.write_str("auto"),
            SpecThreshold::Live(n) => write!(f, "{n}"),
        }
    }
}

impl Serialize for SpecThreshold {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            SpecThreshold::Auto => s.serialize_str("auto"),
            SpecThreshold::Live(n) => s.serialize_u64(*n as u64),
        }
    }
}

impl<'de> Deserialize<'de> for SpecThreshold {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const EXPECTED: &str = "a live-batch size (an integer ≥ 0) or \"auto\"";
        impl serde::de::Visitor<'_> for V {
            type Value = SpecThreshold;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<SpecThreshold, E> {
                usize::try_from(n)
                    .map(SpecThreshold::Live)
                    .map_err(|_| E::custom(format!("spec_threshold {n} is too large")))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<SpecThreshold, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!(
                        "spec_threshold is {n}: expected {EXPECTED}"
                    ))),
                }
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<SpecThreshold, E> {
                match s.trim() {
                    "auto" => Ok(SpecThreshold::Auto),
                    other => Err(E::custom(format!(
                        "spec_threshold is {other:?}: expected {EXPECTED}"
                    ))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// `[rl.draft_tree]`: the shape of the draft trees (see [`TreeShape`]; its depth is the
/// bandit's K, at most `rl.draft_k`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DraftTreeConfig {
    /// Children per expanded node (the drafter's top tokens).
    pub branch: usize,
    /// Nodes expanded per level.
    pub width: usize,
    /// Nodes a tree keeps (the target verifies `nodes + 1` rows).
    pub nodes: usize,
}

impl Default for DraftTreeConfig {
    fn default() -> Self {
        let t = TreeShape::default();
        DraftTreeConfig {
            branch: t.branch,
            width: t.width,
            nodes: t.nodes,
        }
    }
}

#[cfg(test)]
#[path = "rl_tests.rs"]
mod tests;
