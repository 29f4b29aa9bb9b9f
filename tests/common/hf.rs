//! The Hugging Face fixtures (tests/fixtures/hf/, written by scripts/hf_fixtures.py): where
//! one is, a scratch copy of one to break, and one imported.

use std::path::{Path, PathBuf};

use pipefill::model::hf::HfModel;
use pipefill::model::{Cut, Gpt};
use pipefill::tensor::CpuBackend;

/// The directory of fixture `name`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// A copy of fixture `name` in a temporary directory.
pub fn copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    std::fs::create_dir(&dir).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    (tmp, dir)
}

/// Edits the config.json of model directory `dir` in place with `f`.
pub fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
}

/// Fixture `name` opened, and imported as a one-stage model on the CPU.
pub fn open(name: &str) -> (HfModel, Gpt<CpuBackend>) {
    let model = HfModel::open(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let gpt = model
        .gpt(CpuBackend::new(1).unwrap(), &Cut::Even(1))
        .unwrap();
    (model, gpt)
}
