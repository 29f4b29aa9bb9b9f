//! A stage reads only its own tensors from a Hugging Face directory (issue 21: memory per
//! rank ∝ its stage). The sharded Qwen2 fixture (2 layers, 3 shards) cut into 2 stages puts
//! the embedding and layer 0 in stage 0 and layer 1, the final norm and the head in stage 1.
//! Loading one stage reads exactly the bytes of its own tensors (the weight files count what
//! they read), and a stage loads bit for bit the same when every other tensor's bytes are
//! garbage.

use std::path::{Path, PathBuf};

use pipefill::model::hf::{HfModel, hf_name};
use pipefill::model::{Cut, ModelChunk};
use pipefill::tensor::CpuBackend;

mod common;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/qwen2")
}

fn chunk(model: &HfModel, stage: usize) -> ModelChunk<CpuBackend> {
    model
        .chunk(CpuBackend::new(1).unwrap(), &Cut::Even(2), stage)
        .unwrap()
}

fn values(c: &ModelChunk<CpuBackend>) -> Vec<(String, Vec<u32>)> {
    common::job::named_bits(c.param_names(), |n| c.param_values(n).unwrap())
}

/// The Hugging Face names of a stage's parameters.
fn hf_names(c: &ModelChunk<CpuBackend>) -> Vec<String> {
    c.param_names()
        .iter()
        .map(|n| hf_name(n).unwrap().0)
        .collect()
}

#[test]
fn a_stage_reads_exactly_its_own_tensors() {
    let model = HfModel::open(&fixture()).unwrap();
    let total: u64 = model
        .files()
        .names()
        .map(|n| model.files().data_bytes(n).unwrap())
        .sum();
    let mut read_before = 0;
    let mut own_sum = 0;
    for stage in 0..2 {
        let c = chunk(&model, stage);
        let own: u64 = hf_names(&c)
            .iter()
            .map(|n| model.files().data_bytes(n).unwrap())
            .sum();
        let read = model.files().bytes_read() - read_before;
        assert_eq!(
            read, own,
            "stage {stage} read {read} bytes, its tensors hold {own}"
        );
        // Well under the whole model: under three quarters of its bytes.
        assert!(4 * own < 3 * total, "stage {stage}: {own} of {total}");
        read_before += read;
        own_sum += own;
    }
    // The two stages together read the model once.
    assert_eq!(own_sum, total);
}

#[test]
fn a_stage_loads_the_same_when_other_stages_tensors_are_garbage() {
    let pristine = HfModel::open(&fixture()).unwrap();
    let want: Vec<_> = (0..2).map(|s| values(&chunk(&pristine, s))).collect();
    for (stage, want) in want.iter().enumerate() {
        let keep = hf_names(&chunk(&pristine, stage));
        // A copy whose every other tensor's bytes are 0xFF (NaN as f32).
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("qwen2");
        std::fs::create_dir(&dir).unwrap();
        for e in std::fs::read_dir(fixture()).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().to_string();
            let mut bytes = std::fs::read(e.path()).unwrap();
            if name.ends_with(".safetensors") {
                let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
                let meta: serde_json::Value =
                    serde_json::from_slice(&bytes[8..8 + header]).unwrap();
                for (tensor, info) in meta.as_object().unwrap() {
                    if tensor == "__metadata__" || keep.contains(tensor) {
                        continue;
                    }
                    let range = info["data_offsets"].as_array().unwrap();
                    let (a, b) = (range[0].as_u64().unwrap(), range[1].as_u64().unwrap());
                    bytes[8 + header + a as usize..8 + header + b as usize].fill(0xFF);
                }
            }
            std::fs::write(dir.join(&name), bytes).unwrap();
        }
        let spoiled = HfModel::open(&dir).unwrap();
        assert_eq!(&values(&chunk(&spoiled, stage)), want, "stage {stage}");
        let other = values(&chunk(&spoiled, 1 - stage));
        assert!(
            other
                .iter()
                .all(|(_, bits)| bits.iter().all(|&b| f32::from_bits(b).is_nan())),
            "stage {}'s tensors were not spoiled",
            1 - stage
        );
    }
}
