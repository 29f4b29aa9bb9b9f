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

/// Rewrites `tensors` of a model of `config` as version 1 stored them: the LM head and its
/// optimizer tensors `[d_model, vocab]`. Returns how many it rewrote.
pub(crate) fn as_version_1(config: &GptConfig, tensors: &mut [super::HostTensor]) -> usize {
    let (d, v) = (config.d_model, config.vocab);
    let head = crate::model::tie::HEAD;
    let mut moved = 0;
    for t in tensors
        .iter_mut()
        .filter(|t| t.name == head || t.name.ends_with(&format!(".{head}")))
    {
        t.data = crate::model::tie::transpose(&t.data, v, d);
        t.shape = vec![d, v];
        moved += 1;
    }
    moved
}

/// A drafter's state beside a target of `config`: its frozen head kept (it lagged the
/// target's) and a kept round with frozen embedding and head, each of distinct values.
pub(crate) fn drafter(config: &GptConfig) -> crate::model::drafter::state::DrafterState {
    use crate::model::drafter::state::{DrafterState, RoundState};
    use crate::model::drafter::{DrafterWeights, NamedTensor};
    use crate::model::tie::HEAD;
    let (d, v) = (config.d_model, config.vocab);
    let values = |n: usize, k: f32| (0..n).map(|i| k * i as f32).collect::<Vec<_>>();
    let tensor = |name: &str, shape: Vec<usize>, k: f32| NamedTensor {
        name: name.into(),
        values: values(shape.iter().product(), k),
        shape,
    };
    DrafterState {
        weights: DrafterWeights {
            version: 4,
            frozen_step: Some(2),
            tensors: vec![
                tensor("fc.w", vec![2 * d, d], -1.0),
                tensor(HEAD, vec![v, d], 1.0),
                tensor("embed.tok", vec![v, d], 0.5),
            ],
        },
        optimizer: Default::default(),
        samplers: Vec::new(),
        buffer: Default::default(),
        held_out: Default::default(),
        round: Some(RoundState {
            step: 3,
            grads: Vec::new(),
            embed: Some((2, values(v * d, 0.25))),
            head: Some((2, values(v * d, 2.0))),
        }),
    }
}

/// `state` as version 1 stored it: the frozen head and a kept round's `[d_model, vocab]`.
pub(crate) fn drafter_as_version_1(
    config: &GptConfig,
    state: &mut crate::model::drafter::state::DrafterState,
) {
    use crate::model::tie::{HEAD, transpose};
    let (d, v) = (config.d_model, config.vocab);
    for t in state.weights.tensors.iter_mut().filter(|t| t.name == HEAD) {
        t.values = transpose(&t.values, v, d);
        t.shape = vec![d, v];
    }
    if let Some((_, values)) = state.round.as_mut().and_then(|r| r.head.as_mut()) {
        *values = transpose(values, v, d);
    }
}
