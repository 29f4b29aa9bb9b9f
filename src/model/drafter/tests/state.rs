//! The drafter's checkpointed state: saved == restored bit for bit, and a trainer restored
//! from it continues exactly as the original does.

use super::*;
use crate::model::checkpoint::drafter::{load_drafter, save_drafter};
use crate::model::drafter::{DraftBufferHandle, Drafter, DrafterConfig, FROZEN};
use crate::model::{Cut, Gpt, GptConfig, Shape};
use crate::tensor::CpuBackend;

fn target() -> GptConfig {
    GptConfig {
        vocab: 11,
        d_model: 8,
        heads: 2,
        layers: 2,
        seq_len: 8,
        mlp_ratio: 2,
        seed: 5,
        ..GptConfig::default()
    }
}

fn config() -> DrafterConfig {
    DrafterConfig {
        batch_rows: 2,
        accumulation: 1,
        ..DrafterConfig::default()
    }
}

/// A buffer holding two target steps' rows, captured from the target's forwards.
fn filled_buffer() -> (Gpt<CpuBackend>, DraftBufferHandle) {
    let be = CpuBackend::new(1).unwrap();
    let mut gpt = Gpt::new(&target(), be, &Cut::Even(1)).unwrap();
    let buffer = DraftBufferHandle::new(&target(), &config());
    let last = gpt.chunks_mut().last_mut().unwrap();
    last.set_draft_sink(Some(buffer.clone())).unwrap();
    for step in 0..2u32 {
        buffer.begin_step(u64::from(step));
        let ids: Vec<u32> = (0..16).map(|i| (i * 3 + step) % 11).collect();
        let targets: Vec<u32> = (0..16).map(|i| (i * 5 + 1 + step) % 11).collect();
        let shape = Shape { batch: 2, seq: 8 };
        gpt.forward_backward(0, shape, &ids, &targets, 1.0).unwrap();
    }
    (gpt, buffer)
}

fn trainer(gpt: &Gpt<CpuBackend>, buffer: &DraftBufferHandle) -> DrafterTrainer<CpuBackend> {
    let mut drafter = Drafter::new(&target(), &config(), CpuBackend::new(1).unwrap()).unwrap();
    drafter.refresh_from_gpt(gpt, 1).unwrap();
    DrafterTrainer::new(drafter, buffer.clone(), 0, 1).unwrap()
}

fn state_of(t: &DrafterTrainer<CpuBackend>, buffer: &DraftBufferHandle) -> DrafterState {
    let (weights, optimizer) = t.export_state().unwrap();
    DrafterState {
        weights,
        optimizer,
        samplers: vec![t.sampler()],
        buffer: BufferState::of(&buffer.lock()),
        held_out: BufferState::default(),
        round: None,
    }
}

fn weight_bits(w: &DrafterWeights) -> Vec<(String, Vec<u32>)> {
    w.tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.values.iter().map(|x| x.to_bits()).collect(),
            )
        })
        .collect()
}

#[test]
fn saved_state_is_restored_bitwise_and_the_restored_trainer_continues_identically() {
    let (gpt, buffer) = filled_buffer();
    let mut original = trainer(&gpt, &buffer);
    for _ in 0..3 {
        original.slice().unwrap();
    }
    assert_eq!(original.version(), 3, "one step per slice");
    let saved = state_of(&original, &buffer);
    assert_eq!(saved.buffer.previous.len(), 2);
    assert_eq!(saved.buffer.current.len(), 2);
    assert!(
        saved
            .optimizer
            .slots
            .values()
            .any(|s| s.m.iter().any(|&m| m != 0.0))
    );

    let dir = tempfile::tempdir().unwrap();
    let entry = save_drafter(dir.path(), &saved, &target()).unwrap();
    assert_eq!(entry.state.version, 3);
    let back = load_drafter(dir.path(), &entry, &target()).unwrap();
    assert_eq!(back, saved);
    assert_eq!(weight_bits(&back.weights), weight_bits(&saved.weights));

    // A fresh trainer on a fresh buffer, restored, continues exactly as the original.
    let fresh_buffer = DraftBufferHandle::new(&target(), &config());
    back.buffer.restore(&mut fresh_buffer.lock()).unwrap();
    let mut restored = trainer(&gpt, &fresh_buffer);
    restored
        .import_state(&back.weights, &back.optimizer, back.samplers[0])
        .unwrap();
    assert_eq!(state_of(&restored, &fresh_buffer), saved);
    for _ in 0..2 {
        let (a, b) = (original.slice().unwrap(), restored.slice().unwrap());
        assert_eq!(a.loss.to_bits(), b.loss.to_bits());
    }
    assert_eq!(restored.version(), 5);
    assert_eq!(
        weight_bits(&restored.weights().unwrap()),
        weight_bits(&original.weights().unwrap())
    );

    // A restore into a buffer already in use is refused.
    let err = back.buffer.restore(&mut buffer.lock()).unwrap_err();
    assert!(err.to_string().contains("already in use"), "{err}");
}

#[test]
fn a_drafter_file_that_does_not_match_its_entry_is_refused() {
    let (gpt, buffer) = filled_buffer();
    let t = trainer(&gpt, &buffer);
    let dir = tempfile::tempdir().unwrap();
    let entry = save_drafter(dir.path(), &state_of(&t, &buffer), &target()).unwrap();
    let path = dir.path().join(&entry.file);
    let mut bytes = std::fs::read(&path).unwrap();
    *bytes.last_mut().unwrap() ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let err = load_drafter(dir.path(), &entry, &target())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("drafter.safetensors") && err.contains("corrupted"),
        "{err}"
    );
}

#[test]
fn rows_are_saved_without_distributions_and_an_older_file_with_them_is_refused() {
    let (gpt, buffer) = filled_buffer();
    let t = trainer(&gpt, &buffer);
    let d = target().d_model;
    let (mut tensors, meta) = state_of(&t, &buffer).to_parts(d);
    let positions: usize = buffer.lock().rows().map(DraftRow::len).sum();
    let rows = tensors.iter().find(|t| t.name == "drafter.buffer.hidden");
    assert_eq!(rows.unwrap().shape, [positions, d]);
    assert!(tensors.iter().all(|t| !t.name.ends_with(".probs")));
    // The older format kept each position's next-token distribution beside its hidden state.
    tensors.push(HostTensor {
        name: "drafter.buffer.probs".into(),
        shape: vec![positions, target().vocab],
        data: vec![0.0; positions * target().vocab],
    });
    let err = DrafterState::from_parts(&meta, &tensors, d).unwrap_err();
    assert!(err.to_string().contains("older format"), "{err}");
}

#[test]
fn the_file_keeps_no_frozen_tables_and_an_older_file_with_them_still_loads() {
    let (gpt, buffer) = filled_buffer();
    let mut t = trainer(&gpt, &buffer);
    t.slice().unwrap();
    let d = target().d_model;
    let (mut tensors, meta) = state_of(&t, &buffer).to_parts(d);
    assert!(
        tensors
            .iter()
            .all(|t| !FROZEN.iter().any(|f| t.name.ends_with(f))),
        "the drafter's file holds a frozen table"
    );
    // The file's parts, and a drafter restored from them on a fresh trainer of the target.
    let parts = |tensors: &[HostTensor]| DrafterState::from_parts(&meta, tensors, d).unwrap();
    let restore = |state: &DrafterState| {
        let mut restored = trainer(&gpt, &buffer);
        restored
            .import_state(&state.weights, &state.optimizer, state.samplers[0])
            .unwrap();
        restored
    };
    // A restored drafter reads the tables of the target it drafts for.
    let restored = restore(&parts(&tensors));
    assert_eq!(
        restored.drafter().frozen_tensors().unwrap(),
        t.drafter().frozen_tensors().unwrap()
    );
    assert_eq!(restored.weights().unwrap(), t.weights().unwrap());

    // A file written before the tables were shared keeps them with the weights: it loads,
    // and the drafter reads its tables (checked), as it did.
    let older: Vec<HostTensor> = t
        .drafter()
        .frozen_tensors()
        .unwrap()
        .into_iter()
        .map(|f| HostTensor {
            name: format!("{WEIGHT_PREFIX}{}", f.name),
            shape: f.shape,
            data: f.values.iter().map(|x| 2.0 * x).collect(),
        })
        .collect();
    tensors.extend(older.iter().cloned());
    let state = parts(&tensors);
    let mut restored = restore(&state);
    let tables = restored.drafter().frozen_tensors().unwrap();
    assert_eq!(tables[0].values, older[0].data);
    assert_eq!(tables[1].values, older[1].data);
    assert_eq!(restored.drafter().frozen_step(), meta.frozen_step);

    // One table without the other, or a table of the wrong size, is refused.
    let mut one = state.weights.clone();
    one.tensors.retain(|t| t.name != FROZEN[1]);
    let err = restored.load_weights(&one).unwrap_err().to_string();
    assert!(err.contains("come as a pair"), "{err}");
    let mut short = state.weights.clone();
    short.tensors.iter_mut().for_each(|t| {
        if t.name == FROZEN[0] {
            t.values.pop();
        }
    });
    let err = restored.load_weights(&short).unwrap_err().to_string();
    assert!(err.contains(FROZEN[0]), "{err}");
}
