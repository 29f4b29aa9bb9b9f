//! A small model and its checkpoints, for the tests of checkpoints and of the run directory
//! that holds them (one copy instead of one per test file).

use std::path::Path;

use super::Checkpoint;
use super::sharded::{Layout, Manifest, param_stages, save_sharded};
use crate::model::{AdamW, AdamWConfig, Cut, Gpt, GptConfig};
use crate::tensor::CpuBackend;

/// A 2-layer model of width 8 over 50 tokens.
pub(crate) fn small() -> GptConfig {
    GptConfig {
        vocab: 50,
        d_model: 8,
        heads: 2,
        layers: 2,
        seq_len: 8,
        ..GptConfig::default()
    }
}

/// A fresh [`small`] model's whole checkpoint, as after `step` steps (data seed 5).
pub(crate) fn checkpoint(step: u64) -> Checkpoint {
    let gpt = Gpt::new(&small(), CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
    Checkpoint::capture(&gpt, &AdamW::new(AdamWConfig::default()), step, 5).unwrap()
}

/// [`checkpoint`]`(step)` saved sharded into `dir`, its stages placed as `layout` says, for
/// the job of hash `hash`; its manifest.
pub(crate) fn save(dir: &Path, step: u64, layout: &Layout, hash: &str) -> Manifest {
    let stages = param_stages(&small(), layout.stage_rank.len()).unwrap();
    save_sharded(dir, &checkpoint(step), layout, &stages, hash).unwrap()
}
