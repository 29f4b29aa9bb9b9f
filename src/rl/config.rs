//! [`RlConfig`]: the `[rl]` section of a job file, read by `pipefill rl`.
//!
//! The model, data families, schedule, stages and clock are the job's own sections; this
//! section says how many RL steps to run, what each step samples and how it updates.

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;
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
    /// Clip range ε of the policy ratio.
    pub clip: f32,
    /// Weight β of the k3 KL penalty to the frozen initial policy (0: none). With β > 0 the
    /// reference's log-probs are computed once per rollout batch and the update's head
    /// takes the per-token GRPO loss ([`super::grpo::GrpoTokenLoss`]).
    pub kl_coef: f32,
    /// Learning rate of the RL updates (constant).
    pub lr: f32,
    /// Supervised steps on the same tasks before RL when no `--init` run is given.
    pub warmup_steps: u64,
    /// Speculative decoding in the rollouts (lossless: the samples' distribution is the
    /// same either way).
    pub speculation: bool,
    /// Longest draft chain the rollout engine may choose (with `draft_tree`: deepest tree).
    pub draft_k: usize,
    /// Draft trees instead of chains (`[rl.draft_tree]`: `branch`, `width`, `nodes`; the
    /// bandit's K is the depth). Off by default: on the 2-core CPU a 12-node tree accepted
    /// 3.23 tokens against the chain's 2.82 but cost 1.92x a decode to verify against
    /// 1.18x (`pipefill bench rollout --tree`), so chains won.
    pub draft_tree: Option<DraftTreeConfig>,
    /// Speculate only while at most this many sequences are still generating (default
    /// [`DEFAULT_SPEC_THRESHOLD`](crate::rl::rollout::DEFAULT_SPEC_THRESHOLD), derived by
    /// `pipefill bench rollout`).
    pub spec_threshold: usize,
    /// Drafter training slices on each step's rollouts.
    pub drafter_slices: usize,
    /// AdamW learning rate of the drafter during RL when it starts trained (the `--init`
    /// run's drafter, from its bubbles); an untrained drafter learns at `drafter.lr`. A
    /// trained drafter only has to follow a slowly moving policy, on each step's few rows
    /// (the prompts of one step): at `drafter.lr` (3e-3, sized to learn from scratch) each
    /// step's update chases those rows and acceptance fell below the untouched drafter's
    /// (examples/rl-longtail.toml); a tenth of it keeps improving on the next step's rows.
    pub drafter_lr: f32,
    /// Run those slices in the rollout stages' idle time (the long tail), routed by a
    /// `FillerRouter` with the verification passes; what does not fit runs after the
    /// rollout. `false`: all of them after the rollout.
    pub idle_fill: bool,
    /// Seed of the prompt stream and of sampling.
    pub seed: u64,
}

impl Default for RlConfig {
    fn default() -> Self {
        Self {
            steps: 20,
            prompts: 4,
            group: 4,
            temperature: 1.0,
            max_new_tokens: 48,
            clip: 0.2,
            kl_coef: 0.0,
            lr: 3e-4,
            warmup_steps: 200,
            speculation: true,
            draft_k: 4,
            draft_tree: None,
            spec_threshold: crate::rl::rollout::DEFAULT_SPEC_THRESHOLD,
            drafter_slices: 16,
            drafter_lr: 3e-4,
            idle_fill: true,
            seed: 0,
        }
    }
}

impl RlConfig {
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
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_bad_values_name_the_field() {
        RlConfig::default().validate(64).unwrap();
        let cases = [
            (
                RlConfig {
                    group: 1,
                    ..RlConfig::default()
                },
                "rl.group",
            ),
            (
                RlConfig {
                    prompts: 0,
                    ..RlConfig::default()
                },
                "rl.prompts",
            ),
            (
                RlConfig {
                    temperature: 0.0,
                    ..RlConfig::default()
                },
                "rl.temperature",
            ),
            (
                RlConfig {
                    max_new_tokens: 64,
                    ..RlConfig::default()
                },
                "rl.max_new_tokens",
            ),
            (
                RlConfig {
                    clip: 1.5,
                    ..RlConfig::default()
                },
                "rl.clip",
            ),
            (
                RlConfig {
                    kl_coef: -0.1,
                    ..RlConfig::default()
                },
                "rl.kl_coef",
            ),
            (
                RlConfig {
                    lr: -1.0,
                    ..RlConfig::default()
                },
                "rl.lr",
            ),
            (
                RlConfig {
                    drafter_lr: f32::NAN,
                    ..RlConfig::default()
                },
                "rl.drafter_lr",
            ),
            (
                RlConfig {
                    draft_tree: Some(DraftTreeConfig {
                        nodes: 0,
                        ..DraftTreeConfig::default()
                    }),
                    ..RlConfig::default()
                },
                "rl.draft_tree.nodes",
            ),
            (
                RlConfig {
                    draft_tree: Some(DraftTreeConfig {
                        nodes: 40,
                        ..DraftTreeConfig::default()
                    }),
                    ..RlConfig::default()
                },
                "rl.draft_tree.nodes",
            ),
        ];
        for (cfg, field) in cases {
            let err = cfg.validate(64).unwrap_err().to_string();
            assert!(err.starts_with(&format!("invalid `{field}`")), "{err}");
        }
    }
}
