//! Checkpoints of an earlier [`VERSION`](super::VERSION), read into today's layout.
//!
//! Version 1 stored the LM head `head.w` (with its moments and master weights, and a
//! drafter's frozen copies of it) as `[d_model, vocab]`. Version 2 stores it as `[vocab,
//! d_model]`, the token embedding's layout (`model/tie.rs`). A version 1 checkpoint, whole
//! or sharded, is transposed as it is read, so it resumes and loads as before; it is never
//! rewritten. A sharded checkpoint's parts are read apart (a rank reads its own shard, the
//! drafter's file separately), so each part has its own upgrade.

use super::{ADAM_M_PREFIX, ADAM_V_PREFIX, Checkpoint, HostTensor, MASTER_PREFIX, VERSION};
use crate::model::GptConfig;
use crate::model::drafter::state::DrafterState;
use crate::model::tie::{HEAD, transpose};

/// Brings a checkpoint of an earlier version to the current layout and version (a no-op
/// for the current one).
pub(super) fn upgrade(ckpt: &mut Checkpoint) {
    let version = std::mem::replace(&mut ckpt.meta.version, VERSION);
    upgrade_tensors(version, &ckpt.meta.model, &mut ckpt.tensors);
    if let Some(drafter) = ckpt.drafter.as_mut() {
        upgrade_drafter(version, &ckpt.meta.model, drafter);
    }
}

/// Brings `tensors` (all of a checkpoint's, or one shard's) written by `version` to the
/// current layout.
pub(super) fn upgrade_tensors(version: u32, model: &GptConfig, tensors: &mut [HostTensor]) {
    if version != 1 {
        return;
    }
    let (d, v) = (model.d_model, model.vocab);
    let names = ["", ADAM_M_PREFIX, ADAM_V_PREFIX, MASTER_PREFIX].map(|p| format!("{p}{HEAD}"));
    for t in tensors.iter_mut().filter(|t| names.contains(&t.name)) {
        t.data = transpose(&t.data, d, v);
        t.shape = vec![v, d];
    }
}

/// Brings a drafter's state written by `version` beside a target of `model` to the current
/// layout: its frozen head, and a kept round's.
pub(super) fn upgrade_drafter(version: u32, model: &GptConfig, drafter: &mut DrafterState) {
    if version != 1 {
        return;
    }
    let (d, v) = (model.d_model, model.vocab);
    for t in drafter
        .weights
        .tensors
        .iter_mut()
        .filter(|t| t.name == HEAD)
    {
        t.values = transpose(&t.values, d, v);
        t.shape = vec![v, d];
    }
    if let Some((_, values)) = drafter.round.as_mut().and_then(|r| r.head.as_mut()) {
        *values = transpose(values, d, v);
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_model::{as_version_1, checkpoint, drafter, drafter_as_version_1};
    use super::super::{Checkpoint, HostTensor};
    use super::*;

    /// A checkpoint written by version 1 (its head and the head's moments `[d, vocab]`)
    /// loads as today's: the same values transposed, every other tensor bit for bit.
    #[test]
    fn a_version_1_checkpoint_loads_with_its_head_transposed() {
        let mut now = checkpoint(3);
        let (d, v) = (now.meta.model.d_model, now.meta.model.vocab);
        // The head's moments, unlike its values, so a mix-up shows.
        let value = now.tensors.iter().find(|t| t.name == HEAD).unwrap().clone();
        for (k, prefix) in [ADAM_M_PREFIX, ADAM_V_PREFIX].into_iter().enumerate() {
            if !now
                .tensors
                .iter()
                .any(|t| t.name == format!("{prefix}{HEAD}"))
            {
                let data = (0..d * v).map(|i| (i * (k + 2)) as f32).collect();
                let name = format!("{prefix}{HEAD}");
                now.tensors.push(HostTensor {
                    name,
                    data,
                    ..value.clone()
                });
            }
        }
        let mut old = now.clone();
        old.meta.version = 1;
        let moved = as_version_1(&old.meta.model, &mut old.tensors);
        assert_eq!(moved, 3, "head.w and its two moments");
        let dir = tempfile::tempdir().unwrap();
        old.save(dir.path()).unwrap();
        let back = Checkpoint::load(dir.path()).unwrap();
        assert_eq!(back.meta.version, VERSION);
        assert_eq!(back.tensors, now.tensors);
        // A version from the future is refused, naming it.
        old.meta.version = VERSION + 1;
        old.save(dir.path()).unwrap();
        let err = Checkpoint::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains(&format!("version {}", VERSION + 1)), "{err}");
    }

    /// A version 1 drafter's frozen head (kept where it lagged the target's) and a kept
    /// round's frozen head are transposed as the model's is; the drafter's other tensors
    /// and the round's frozen embedding are left as they are.
    #[test]
    fn a_version_1_drafters_frozen_heads_are_transposed() {
        let mut now = checkpoint(3);
        now.drafter = Some(drafter(&now.meta.model));
        // As version 1 wrote it: the two frozen heads `[d, vocab]`.
        let mut old = now.clone();
        old.meta.version = 1;
        drafter_as_version_1(&old.meta.model, old.drafter.as_mut().unwrap());
        assert_ne!(old.drafter, now.drafter);
        upgrade(&mut old);
        assert_eq!(old.meta.version, VERSION);
        assert_eq!(old.drafter, now.drafter);
    }
}
