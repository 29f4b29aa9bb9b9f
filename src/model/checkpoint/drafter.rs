//! The drafter's part of a checkpoint: [`DRAFTER_FILE`] (its floats, named as
//! [`DrafterState::to_parts`] names them) and a [`DrafterEntry`] in the manifest (sharded) or
//! sidecar (whole) that lists it with its size, hash and the JSON part of the state. The file
//! is written before the manifest or sidecar, so a complete checkpoint never names a drafter
//! file that is not there; a file that does not match its entry is refused, naming it, and so
//! is an entry whose name is not a plain file name in the checkpoint's directory.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::files::{MANIFEST_FILE, SHARDED_FORMAT};
use super::files::{read_listed_tensors, write_tensor_file};
use crate::model::GptConfig;
use crate::model::ModelError;
use crate::model::drafter::state::{DrafterMeta, DrafterState};

/// File name of the drafter's tensors inside a checkpoint directory.
pub const DRAFTER_FILE: &str = "drafter.safetensors";

/// The drafter file of a checkpoint, as its manifest or sidecar records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterEntry {
    /// File name inside the checkpoint directory.
    pub file: String,
    /// Exact size in bytes.
    pub bytes: u64,
    /// FNV-1a 64 of the file's bytes, hex.
    pub hash: String,
    /// Tensor names, in file order.
    pub tensors: Vec<String>,
    /// Everything but the floats.
    pub state: DrafterMeta,
}

/// Writes `state` of a drafter of target `model` into `dir` (atomically); returns the entry
/// the manifest or sidecar records.
pub fn save_drafter(
    dir: &Path,
    state: &DrafterState,
    model: &GptConfig,
) -> Result<DrafterEntry, ModelError> {
    let (tensors, meta) = state.to_parts(model.d_model);
    std::fs::create_dir_all(dir).map_err(|error| ModelError::CheckpointIo {
        path: dir.to_path_buf(),
        error,
    })?;
    let (bytes, hash) = write_tensor_file(&dir.join(DRAFTER_FILE), &tensors, SHARDED_FORMAT)?;
    Ok(DrafterEntry {
        file: DRAFTER_FILE.into(),
        bytes,
        hash,
        tensors: tensors.into_iter().map(|t| t.name).collect(),
        state: meta,
    })
}

/// Reads the drafter state `entry` of the manifest in `dir` records, for a drafter of target
/// `model`.
pub fn load_drafter(
    dir: &Path,
    entry: &DrafterEntry,
    model: &GptConfig,
) -> Result<DrafterState, ModelError> {
    load_listed(dir, &dir.join(MANIFEST_FILE), entry, model)
}

/// Reads the drafter state `entry` of `listing` (the manifest or sidecar) records in `dir`:
/// its file name, size and hash are checked before the state is parsed.
pub(super) fn load_listed(
    dir: &Path,
    listing: &Path,
    entry: &DrafterEntry,
    model: &GptConfig,
) -> Result<DrafterState, ModelError> {
    let path = dir.join(&entry.file);
    let listed = (entry.file.as_str(), entry.bytes, entry.hash.as_str());
    let tensors = read_listed_tensors(dir, listing, "drafter.file", listed, &entry.tensors)?;
    DrafterState::from_parts(&entry.state, &tensors, model.d_model).map_err(|e| {
        ModelError::BadTensors {
            path,
            reason: e.to_string(),
        }
    })
}
