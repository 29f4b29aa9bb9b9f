//! Reinforcement-learning rollouts on the pipeline (issue 6).
//!
//! - `rollout`: the rollout engine — batched KV-cache generation through the pipeline
//!   stages (prefill, then decode), groups of sequences flowing one behind another so the
//!   stages stay busy while the live batch shrinks into its long tail.
//! - `accept`: the lossless acceptance rules of speculative decoding (greedy prefix match
//!   plus a bonus token; rejection sampling with `min(1, p/q)`), pure functions.
//! - `speculative`: the draft-then-verify loop (a `Proposer` proposes a chain of K tokens,
//!   the target verifies all K+1 positions in one multi-position pass, rejected positions
//!   roll back the KV caches).
//! - `tree`: the lossless acceptance of a draft tree (greedy walk; sequential rejection
//!   over a node's distinct children, zeroing each rejected one).
//! - `bandit`: the bucketed epsilon-greedy choice of K per live-batch-size bucket.
//! - `calibrate`: the measured step costs that decide below which live batch speculation
//!   pays (`rl.spec_threshold = "auto"`).
//! - `update`: the GRPO update's step as pipeline micro-batches (sequences packed several
//!   per micro-batch) and the head's per-token loss that weighs them.
//! - `launched`: one rank's part of a launched `pipefill rl` (rank 0 rolls out and
//!   broadcasts; every rank runs its stages of the update through the pipeline's executor).
//! - `warm_up`: where the policy starts without an `--init` run (supervised steps, or a
//!   pretrained model as it is).
//!
//! The KV-cache inference path itself (no activations stashed for backward) lives in
//! [`crate::model::infer`].

pub mod accept;
pub mod bandit;
pub mod calibrate;
pub mod error;
pub mod generator;
/// The RL settings live with the job's ([`crate::config::rl`]).
pub use crate::config::rl as config;
pub use error::RlError;
pub mod grpo;
pub mod launched;
pub mod prompts;
pub mod reward;
pub mod rollout;
pub mod speculative;
pub(crate) mod step;
pub mod step_metrics;
pub mod trainer;
pub mod trainer_rollout;
pub mod trainer_spec;
pub mod tree;
pub mod update;
pub mod warm_up;
