//! Inference with a KV cache: the generation path of RL rollouts.
//!
//! Training chunks stash every activation for the backward; generation needs none of that,
//! but it must not recompute the whole prefix for each new token. This module is that
//! separate, inference-only path:
//! - [`attend`]: causal attention of a new position against a host cache (shared with
//!   the drafter's incremental proposals);
//! - `denormals`: the flushed subnormals its kernels compute with;
//! - [`kv`]: [`KvCache`], per-layer keys and values of every live sequence, with rollback;
//! - [`rowmul`]: few-row products that stream the weights once (decode, verification);
//! - [`stage`]: [`InferStage`], a stage's blocks rebuilt by parameter name from a
//!   [`ModelChunk`](crate::model::ModelChunk) or a [`Gpt`](crate::model::Gpt), running
//!   prefill, decode and multi-position verification of several sequences per call;
//! - [`tree`]: [`TreeStep`], spans verified as draft trees and the cache compaction that
//!   keeps a tree's accepted path.

pub mod attend;
mod denormals;
pub mod kv;
pub mod rowmul;
pub mod stage;
#[cfg(test)]
mod tests;
pub mod tree;

pub use kv::KvCache;
pub use stage::{InferStage, Span, StageInput, StageOutput, run_stages};
pub use tree::{Compaction, TreeStep};
