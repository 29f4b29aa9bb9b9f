//! Checkpoints: parameters (and optimizer moments) in a safetensors file, plus a small JSON
//! sidecar with everything else needed to resume: step, model config, optimizer scalars,
//! data stream state.
//!
//! A checkpoint is a directory holding `model.safetensors` and `checkpoint.json`. Both are
//! written atomically (a temporary file in the same directory, synced, then renamed over
//! the old one), the tensors first and the sidecar last: the sidecar records the tensor
//! file's exact size, its FNV-1a hash (the one every shard and drafter file carries) and its
//! tensor names, so a reader never mixes a new sidecar with a torn tensor file, and a
//! truncated, corrupted or foreign file is reported as such instead of loading garbage. A
//! sidecar without the hash (written before checkpoints carried one) is refused, saying so:
//! nothing would tell a flipped byte from a trained one. Tensors are stored as little-endian `f32` by name: parameters under their
//! model names (`blocks.3.attn.wq`), optimizer moments under prefixed names
//! ([`ADAM_M_PREFIX`], [`ADAM_V_PREFIX`]), so standard safetensors tools can read them.
//!
//! A run that trains the drafter in its bubbles also saves the drafter's state ([`drafter`]:
//! `drafter.safetensors`, listed in the sidecar with its size and hash), written before the
//! sidecar.
//!
//! Pipelined and data-parallel runs write the sharded form instead ([`sharded`]: one shard
//! per rank and a manifest written last), which reads back into the same [`Checkpoint`];
//! [`retain`] keeps only a run's newest few of them. [`files`] is how every file of a
//! checkpoint is written and read (plain names, regular files, sizes checked first).

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{AdamW, Gpt, GptConfig, OptimizerState, SlotState};
use crate::model::ModelError;
use crate::tensor::Backend;

pub mod drafter;
pub mod files;
mod migrate;
pub mod resume;
pub mod retain;
pub mod sharded;
pub mod sweep;
#[cfg(test)]
pub(crate) mod test_model;

pub use files::write_atomic;
use files::{MAX_META_BYTES, check_hash, read_bounded, read_exact, read_f32_tensors};

/// File name of the tensors inside a checkpoint directory.
pub const TENSOR_FILE: &str = "model.safetensors";
/// File name of the sidecar inside a checkpoint directory.
pub const META_FILE: &str = "checkpoint.json";
/// Name prefix of AdamW first moments.
pub const ADAM_M_PREFIX: &str = "optim.m.";
/// Name prefix of AdamW second moments.
pub const ADAM_V_PREFIX: &str = "optim.v.";
/// Name prefix of `f32` master weights (for `bf16` parameters).
pub const MASTER_PREFIX: &str = "optim.master.";
/// The sidecar's `format` value.
pub const FORMAT: &str = "pipefill-checkpoint";
/// The sidecar's current `version`: 2 since the LM head is `[vocab, d_model]`; a version 1
/// checkpoint is read into that layout (`checkpoint/migrate.rs`).
pub const VERSION: u32 = 2;

/// How a run stopped by a failed write ends its error: the checkpoint a resume would
/// continue from (`last`), or that there is none.
pub(crate) fn last_complete_note(last: Option<&Path>) -> String {
    match last {
        Some(dir) => format!("its last complete checkpoint is {}", dir.display()),
        None => "it has no complete checkpoint".to_string(),
    }
}

/// One named tensor on the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostTensor {
    pub name: String,
    /// Logical shape, row-major.
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Everything in a checkpoint except the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointMeta {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`] of the writer.
    pub version: u32,
    /// Optimizer steps completed; training resumes at this step index.
    pub step: u64,
    /// The model's shape and initialisation seed.
    pub model: GptConfig,
    /// AdamW's own step counter (bias corrections).
    pub optimizer_step: u64,
    /// Seed of the data stream; step `k`'s data is a function of `(data_seed, k)`, so this
    /// and `step` are the whole data RNG state.
    pub data_seed: u64,
    /// Free-form facts about the run (job file text, schedule, ...).
    #[serde(default)]
    pub notes: HashMap<String, String>,
    /// Size in bytes of the tensor file this sidecar belongs to.
    pub tensor_bytes: u64,
    /// FNV-1a 64 of the tensor file's bytes, hex ([`sharded::fingerprint`]). Always written;
    /// a sidecar without it is refused by [`Checkpoint::load`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_hash: Option<String>,
    /// Names of the tensors, in file order.
    pub tensors: Vec<String>,
    /// The drafter's file, when the run trained one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter: Option<drafter::DrafterEntry>,
}

/// A checkpoint in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub meta: CheckpointMeta,
    /// Parameters and optimizer state, by name.
    pub tensors: Vec<HostTensor>,
    /// The drafter trained in the bubbles (`filler = "drafter"`), if the run had one.
    pub drafter: Option<crate::model::drafter::state::DrafterState>,
}

impl Checkpoint {
    /// A checkpoint of `tensors` at `step` (the sidecar's size and names are filled on save).
    pub fn new(
        step: u64,
        model: GptConfig,
        optimizer_step: u64,
        data_seed: u64,
        tensors: Vec<HostTensor>,
    ) -> Self {
        Self {
            meta: CheckpointMeta {
                format: FORMAT.into(),
                version: VERSION,
                step,
                model,
                optimizer_step,
                data_seed,
                notes: HashMap::new(),
                tensor_bytes: 0,
                tensor_hash: None,
                tensors: Vec::new(),
                drafter: None,
            },
            tensors,
            drafter: None,
        }
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&HostTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// A checkpoint of every parameter of `model` and the whole state of `optimizer`, at
    /// `step` of the data stream seeded by `data_seed`.
    pub fn capture<B: Backend>(
        model: &Gpt<B>,
        optimizer: &AdamW<B>,
        step: u64,
        data_seed: u64,
    ) -> Result<Self, ModelError> {
        let state = optimizer.state(model.chunks()[0].backend())?;
        Self::capture_with(model, state, step, data_seed)
    }

    /// [`Checkpoint::capture`] at the end of a run: the optimizer's moments move into the
    /// checkpoint ([`AdamW::take_state`]) instead of being copied beside the live ones.
    pub fn capture_final<B: Backend>(
        model: &Gpt<B>,
        optimizer: &mut AdamW<B>,
        step: u64,
        data_seed: u64,
    ) -> Result<Self, ModelError> {
        let state = optimizer.take_state(model.chunks()[0].backend())?;
        Self::capture_with(model, state, step, data_seed)
    }

    fn capture_with<B: Backend>(
        model: &Gpt<B>,
        state: OptimizerState,
        step: u64,
        data_seed: u64,
    ) -> Result<Self, ModelError> {
        let mut tensors = Vec::new();
        for p in model.params() {
            tensors.push(HostTensor {
                name: p.name.clone(),
                shape: p.shape.clone(),
                data: model.param_values(&p.name)?,
            });
        }
        Ok(sharded::from_owned_state(
            model.config().clone(),
            data_seed,
            step,
            tensors,
            state,
        ))
    }

    /// The optimizer state stored in the checkpoint (moments by parameter name).
    pub fn optimizer_state(&self) -> Result<OptimizerState, ModelError> {
        let mut state = OptimizerState {
            step: self.meta.optimizer_step,
            ..OptimizerState::default()
        };
        for t in &self.tensors {
            if let Some(name) = t.name.strip_prefix(ADAM_M_PREFIX) {
                let v = self
                    .tensor(&format!("{ADAM_V_PREFIX}{name}"))
                    .ok_or_else(|| {
                        ModelError::Mismatch(format!(
                            "`{}` has no second moment `{ADAM_V_PREFIX}{name}`",
                            t.name
                        ))
                    })?;
                let master = self
                    .tensor(&format!("{MASTER_PREFIX}{name}"))
                    .map(|m| m.data.clone());
                state.slots.insert(
                    name.to_string(),
                    SlotState {
                        m: t.data.clone(),
                        v: v.data.clone(),
                        master,
                    },
                );
            }
        }
        Ok(state)
    }

    /// Loads the parameters into `model` and the optimizer state into `optimizer`. The
    /// model's shape and the data seed must match the checkpoint's, and every parameter of
    /// the model must be present with its shape.
    pub fn restore<B: Backend>(
        &self,
        model: &mut Gpt<B>,
        optimizer: &mut AdamW<B>,
        data_seed: u64,
    ) -> Result<(), ModelError> {
        self.restore_model(model, data_seed)?;
        let be = model.chunks()[0].backend().clone();
        optimizer.load_state(&be, &self.optimizer_state()?)?;
        Ok(())
    }

    /// The parameter half of [`Checkpoint::restore`], with the same checks: for a caller
    /// that takes the moments as [`Checkpoint::optimizer_state`] (a pipeline hands each
    /// rank its share) rather than through an optimizer on the model's backend.
    pub fn restore_model<B: Backend>(
        &self,
        model: &mut Gpt<B>,
        data_seed: u64,
    ) -> Result<(), ModelError> {
        if &self.meta.model != model.config() {
            return Err(ModelError::Mismatch(format!(
                "its model differs from this run's in {}",
                config_diff(&self.meta.model, model.config())
            )));
        }
        if self.meta.data_seed != data_seed {
            return Err(ModelError::Mismatch(format!(
                "it was trained on data seed {}, this run has {data_seed}",
                self.meta.data_seed
            )));
        }
        let shapes: Vec<(String, Vec<usize>)> = model
            .params()
            .into_iter()
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect();
        for (name, shape) in shapes {
            let t = self
                .tensor(&name)
                .ok_or_else(|| ModelError::Mismatch(format!("parameter `{name}` is missing")))?;
            if t.shape != shape {
                return Err(ModelError::Mismatch(format!(
                    "parameter `{name}` has shape {:?}, the model {shape:?}",
                    t.shape
                )));
            }
            model.set_param(&name, &t.data)?;
        }
        Ok(())
    }

    /// Writes the checkpoint into directory `dir` (created if needed), atomically.
    pub fn save(&mut self, dir: &Path) -> Result<(), ModelError> {
        fs::create_dir_all(dir).map_err(|error| ModelError::CheckpointIo {
            path: dir.to_path_buf(),
            error,
        })?;
        let (bytes, hash) =
            files::write_tensor_file(&dir.join(TENSOR_FILE), &self.tensors, FORMAT)?;
        self.meta.tensor_bytes = bytes;
        self.meta.tensor_hash = Some(hash);
        self.meta.tensors = self.tensors.iter().map(|t| t.name.clone()).collect();
        self.meta.drafter = match &self.drafter {
            Some(state) => Some(drafter::save_drafter(dir, state, &self.meta.model)?),
            None => None,
        };
        let json = serde_json::to_vec_pretty(&self.meta).expect("the sidecar always serializes");
        write_atomic(&dir.join(META_FILE), &json)
    }

    /// Reads the checkpoint in directory `dir`, checking that the two files belong together
    /// (the tensor file's size before it is read, then its hash).
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let meta_path = dir.join(META_FILE);
        let text = read_bounded(&meta_path, MAX_META_BYTES)?;
        let meta: CheckpointMeta =
            serde_json::from_slice(&text).map_err(|e| ModelError::BadMeta {
                path: meta_path.clone(),
                reason: e.to_string(),
            })?;
        if meta.format != FORMAT || !(1..=VERSION).contains(&meta.version) {
            return Err(ModelError::BadMeta {
                path: meta_path,
                reason: format!(
                    "format {:?} version {}, expected {FORMAT:?} version 1 to {VERSION}",
                    meta.format, meta.version
                ),
            });
        }
        let Some(hash) = &meta.tensor_hash else {
            return Err(ModelError::BadMeta {
                path: meta_path,
                reason: format!(
                    "no `tensor_hash` for {TENSOR_FILE}: it was written by a version of pipefill \
                     before checkpoints carried a hash, and its tensors cannot be checked; \
                     resume from a checkpoint this version wrote"
                ),
            });
        };
        let tensor_path = dir.join(TENSOR_FILE);
        let file = read_exact(&tensor_path, meta.tensor_bytes)?;
        check_hash(&tensor_path, &file, hash, &meta_path)?;
        let tensors = read_f32_tensors(&tensor_path, &file, &meta.tensors)?;
        let drafter = match &meta.drafter {
            Some(entry) => Some(drafter::load_listed(dir, &meta_path, entry, &meta.model)?),
            None => None,
        };
        let mut ckpt = Self {
            meta,
            tensors,
            drafter,
        };
        migrate::upgrade(&mut ckpt);
        Ok(ckpt)
    }
}

/// The fields in which two model configs differ: `layers (checkpoint 1, run 2), ...`.
fn config_diff(saved: &GptConfig, run: &GptConfig) -> String {
    let (a, b) = (
        serde_json::to_value(saved).expect("a GptConfig serializes"),
        serde_json::to_value(run).expect("a GptConfig serializes"),
    );
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return format!("{saved:?} vs {run:?}");
    };
    a.iter()
        .filter(|(k, v)| b.get(*k) != Some(*v))
        .map(|(k, v)| {
            let other = b.get(k).map_or("-".to_string(), ToString::to_string);
            format!("`{k}` (checkpoint {v}, run {other})")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Checkpoint {
        let tensors = vec![
            HostTensor {
                name: "embed.tokens".into(),
                shape: vec![3, 2],
                data: vec![1.0, -2.5, f32::MIN_POSITIVE, 3.0e-39, -0.0, 7.125],
            },
            HostTensor {
                name: format!("{ADAM_M_PREFIX}embed.tokens"),
                shape: vec![3, 2],
                data: vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
            },
        ];
        let mut c = Checkpoint::new(12, GptConfig::default(), 12, 99, tensors);
        c.meta.notes.insert("schedule".into(), "none".into());
        c
    }

    #[test]
    fn round_trip_is_bitwise() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = sample();
        c.save(dir.path()).unwrap();
        let back = Checkpoint::load(dir.path()).unwrap();
        assert_eq!(back.meta, c.meta);
        for (a, b) in c.tensors.iter().zip(&back.tensors) {
            assert_eq!(a.name, b.name);
            assert_eq!(a.shape, b.shape);
            let bits = |t: &HostTensor| t.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(a), bits(b));
        }
        // Saving again over it leaves no temporary files behind.
        c.save(dir.path()).unwrap();
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn truncated_or_foreign_files_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        sample().save(dir.path()).unwrap();
        let tensor_path = dir.path().join(TENSOR_FILE);
        let full = fs::read(&tensor_path).unwrap();
        fs::write(&tensor_path, &full[..full.len() - 5]).unwrap();
        let err = Checkpoint::load(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("truncated") && err.contains(TENSOR_FILE),
            "{err}"
        );

        // Same size, one byte flipped in a tensor, or garbage: the hash the sidecar records.
        let mut flipped = full.clone();
        *flipped.last_mut().unwrap() ^= 1;
        for bytes in [flipped, vec![0xAB; full.len()]] {
            fs::write(&tensor_path, bytes).unwrap();
            let err = Checkpoint::load(dir.path()).unwrap_err().to_string();
            assert!(
                err.contains("corrupted") && err.contains(TENSOR_FILE) && err.contains(META_FILE),
                "{err}"
            );
        }

        fs::write(dir.path().join(META_FILE), b"{\"hello\": 1}").unwrap();
        let err = Checkpoint::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("not a pipefill checkpoint"), "{err}");

        let err = Checkpoint::load(&dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(META_FILE), "{err}");
    }
}
