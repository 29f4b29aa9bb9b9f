//! Sharded checkpoints: one safetensors shard per rank and a JSON manifest, for pipelined
//! and data-parallel runs.
//!
//! A sharded checkpoint is a directory holding `rank-NNNNN.safetensors` for every rank of
//! the job and [`MANIFEST_FILE`]. Each rank's shard holds the parameters of the stages the
//! plan places on it and their AdamW moments, under the names of the whole-model checkpoint
//! ([`super::Checkpoint`]); data-parallel replicas hold the same stages, so their shards
//! carry the same tensors. The manifest is written **last**, through a temporary file and a
//! rename, once every shard is on disk: it records the step, the layout (world = dp × pp,
//! the stage → rank map), a fingerprint of the job settings that decide the trajectory, and
//! every shard's size and FNV-1a hash. A directory without a manifest is a checkpoint that
//! was never finished and is never picked up ([`latest`]); a shard whose size or hash
//! differs from the manifest's, or a manifest of another layout or job, is refused with an
//! error naming the file and the figure.
//!
//! In memory a sharded checkpoint is read back into the whole-model [`Checkpoint`], which
//! both trainers resume from.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::drafter::{DrafterEntry, load_drafter, save_drafter};
pub use super::files::{Fnv1a, MANIFEST_FILE, SHARDED_FORMAT, fingerprint};
use super::files::{MAX_META_BYTES, check_listed, read_bounded, read_listed_tensors};
use super::{
    ADAM_M_PREFIX, ADAM_V_PREFIX, Checkpoint, CheckpointMeta, FORMAT, HostTensor, MASTER_PREFIX,
    VERSION, write_atomic,
};
use crate::model::ModelError;
use crate::model::{Cut, GptConfig, ModelChunk};
use crate::tensor::CpuBackend;

/// Name of the sub-directory of a run directory that holds its checkpoints.
pub const CHECKPOINTS_DIR: &str = "checkpoints";

/// Where the stages of a job live: `dp` replicas of a pipeline of `pp` ranks, global rank
/// `replica × pp + pipeline rank`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Stage → pipeline rank (the plan's placement).
    pub stage_rank: Vec<usize>,
}

impl Layout {
    /// Ranks of one pipeline.
    pub fn pp(&self) -> usize {
        self.stage_rank.iter().max().map_or(0, |r| r + 1)
    }

    /// Ranks of the job.
    pub fn world(&self) -> usize {
        self.dp * self.pp()
    }
}

/// One shard as the manifest records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// The global rank that wrote it.
    pub rank: usize,
    /// File name inside the checkpoint directory.
    pub file: String,
    /// Exact size in bytes.
    pub bytes: u64,
    /// FNV-1a 64 of the file's bytes, hex.
    pub hash: String,
    /// Tensor names, in file order.
    pub tensors: Vec<String>,
}

/// The manifest of a sharded checkpoint (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`SHARDED_FORMAT`].
    pub format: String,
    /// [`VERSION`] of the writer.
    pub version: u32,
    /// Optimizer steps completed; training resumes at this step index.
    pub step: u64,
    pub world: usize,
    pub layout: Layout,
    /// Fingerprint of the job settings that decide the trajectory (the caller's choice of
    /// fields, e.g. [`fingerprint`] of their JSON); a resume must present the same.
    pub config_hash: String,
    pub model: GptConfig,
    /// AdamW's own step counter (bias corrections).
    pub optimizer_step: u64,
    /// Seed of the data stream (with `step`, the whole data order state).
    pub data_seed: u64,
    #[serde(default)]
    pub notes: HashMap<String, String>,
    /// Replicas whose ranks wrote a shard: 1 when replica 0's ranks stand for the others
    /// (a multi-process run; the replicas hold bitwise the same state), `dp` when every
    /// replica wrote its own copy. Absent in manifests written before the field: every replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas_saved: Option<usize>,
    /// One entry per saved rank (`0..replicas_saved × pp`), by rank.
    pub shards: Vec<ShardEntry>,
    /// The drafter's file, when the run trained one in its bubbles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter: Option<DrafterEntry>,
}

/// The shard file name of global rank `rank`.
pub fn shard_file(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// The directory of the checkpoint of `step` inside run directory `run_dir`.
pub fn step_dir(run_dir: &Path, step: u64) -> PathBuf {
    run_dir
        .join(CHECKPOINTS_DIR)
        .join(format!("step-{step:08}"))
}

/// Which stage each parameter of `model` cut into `stages` chunks belongs to.
pub fn param_stages(
    model: &GptConfig,
    stages: usize,
) -> Result<HashMap<String, usize>, ModelError> {
    let be = CpuBackend::new(1).map_err(ModelError::from)?;
    let cut = Cut::Even(stages);
    let mut owner = HashMap::new();
    for s in 0..stages {
        let chunk = ModelChunk::new(model, be.clone(), &cut, s)?;
        owner.extend(chunk.param_names().into_iter().map(|n| (n, s)));
    }
    Ok(owner)
}

/// The parameter a checkpoint tensor belongs to: itself, or the one whose moment it is.
fn param_of(tensor: &str) -> &str {
    [ADAM_M_PREFIX, ADAM_V_PREFIX, MASTER_PREFIX]
        .iter()
        .find_map(|p| tensor.strip_prefix(p))
        .unwrap_or(tensor)
}

/// Writes `tensors` as global rank `rank`'s shard in `dir` (atomically) and returns its
/// manifest entry. In a multi-process job every rank calls this for itself; rank 0 then
/// writes the manifest from every rank's entry.
pub fn write_shard(
    dir: &Path,
    rank: usize,
    tensors: &[HostTensor],
) -> Result<ShardEntry, ModelError> {
    write_shard_refs(dir, rank, &tensors.iter().collect::<Vec<_>>())
}

/// [`write_shard`] of tensors held elsewhere (no copy is made: the file is streamed).
fn write_shard_refs(
    dir: &Path,
    rank: usize,
    tensors: &[&HostTensor],
) -> Result<ShardEntry, ModelError> {
    fs::create_dir_all(dir).map_err(|error| ModelError::CheckpointIo {
        path: dir.to_path_buf(),
        error,
    })?;
    let file = shard_file(rank);
    let (bytes, hash) = super::files::write_tensor_refs(&dir.join(&file), tensors, SHARDED_FORMAT)?;
    Ok(ShardEntry {
        rank,
        file,
        bytes,
        hash,
        tensors: tensors.iter().map(|t| t.name.clone()).collect(),
    })
}

impl Manifest {
    /// The files the manifest lists beside itself: every shard, and the drafter's.
    pub fn files(&self) -> impl Iterator<Item = &String> {
        self.shards
            .iter()
            .map(|s| &s.file)
            .chain(self.drafter.as_ref().map(|d| &d.file))
    }

    /// Writes the manifest into `dir`, atomically. Call it only once every shard it lists
    /// is written: its presence is what makes the checkpoint complete.
    pub fn write(&self, dir: &Path) -> Result<(), ModelError> {
        let json = serde_json::to_vec_pretty(self).expect("a manifest always serializes");
        write_atomic(&dir.join(MANIFEST_FILE), &json)
    }

    /// Reads the manifest of the checkpoint in `dir`. The names it gives its files must be
    /// plain file names, and their sizes at most [`super::files::MAX_FILE_BYTES`]: a
    /// manifest that points outside its directory is refused before any file is looked at.
    pub fn read(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join(MANIFEST_FILE);
        if !path.exists() {
            return Err(ModelError::BadMeta {
                path,
                reason: "no manifest: the checkpoint is incomplete (a run stopped while \
                         writing it) or this is not a sharded checkpoint"
                    .into(),
            });
        }
        let text = read_bounded(&path, MAX_META_BYTES)?;
        let manifest: Manifest =
            serde_json::from_slice(&text).map_err(|e| ModelError::BadMeta {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        // Version 1 is read into today's layout by `super::migrate`.
        if manifest.format != SHARDED_FORMAT || !(1..=VERSION).contains(&manifest.version) {
            return Err(ModelError::BadMeta {
                path,
                reason: format!(
                    "format {:?} version {}, expected {SHARDED_FORMAT:?} version 1 to {VERSION}",
                    manifest.format, manifest.version
                ),
            });
        }
        for (i, shard) in manifest.shards.iter().enumerate() {
            check_listed(&path, &shard_field(i), &shard.file, shard.bytes)?;
        }
        if let Some(d) = &manifest.drafter {
            check_listed(&path, "drafter.file", &d.file, d.bytes)?;
        }
        Ok(manifest)
    }

    /// Refuses a manifest that does not list one shard per saved rank, in rank order (the
    /// manifest read from `dir`, named in the error).
    pub fn check_shards(&self, dir: &Path) -> Result<(), ModelError> {
        let saved = self.replicas_saved.unwrap_or(self.layout.dp);
        let expected = saved * self.layout.pp();
        let ranks: Vec<usize> = self.shards.iter().map(|s| s.rank).collect();
        if saved == 0 || saved > self.layout.dp || ranks != (0..expected).collect::<Vec<_>>() {
            return Err(ModelError::BadMeta {
                path: dir.join(MANIFEST_FILE),
                reason: format!(
                    "lists shards of ranks {ranks:?} for {saved} saved replica(s) of dp {}, \
                     expected one per rank 0..{expected}",
                    self.layout.dp
                ),
            });
        }
        Ok(())
    }

    /// Refuses a manifest written by another layout or job.
    pub fn check(&self, layout: &Layout, config_hash: &str) -> Result<(), ModelError> {
        let mismatch = |what: String| Err(ModelError::Mismatch(what));
        if self.world != layout.world() {
            return mismatch(format!(
                "it was written by {} ranks (dp {} × pp {}), this run has {} (dp {} × pp {})",
                self.world,
                self.layout.dp,
                self.layout.pp(),
                layout.world(),
                layout.dp,
                layout.pp()
            ));
        }
        if self.layout != *layout {
            return mismatch(format!(
                "its stage → rank map is {:?} with dp {}, this run's {:?} with dp {}",
                self.layout.stage_rank, self.layout.dp, layout.stage_rank, layout.dp
            ));
        }
        if self.config_hash != config_hash {
            return mismatch(format!(
                "its job settings (fingerprint {}) differ from this run's ({config_hash})",
                self.config_hash
            ));
        }
        Ok(())
    }
}

/// Writes `checkpoint` into `dir` as one shard per rank of `layout` and then the manifest.
/// `stage_of` maps every parameter name to its stage ([`param_stages`]).
pub fn save_sharded(
    dir: &Path,
    checkpoint: &Checkpoint,
    layout: &Layout,
    stage_of: &HashMap<String, usize>,
    config_hash: &str,
) -> Result<Manifest, ModelError> {
    remove_manifest(dir)?;
    let pp = layout.pp();
    // The tensors stay where they are: each shard is streamed from references to them.
    let mut per_rank: Vec<Vec<&HostTensor>> = vec![Vec::new(); pp];
    for t in &checkpoint.tensors {
        let param = param_of(&t.name);
        let &stage = stage_of.get(param).ok_or_else(|| {
            ModelError::Mismatch(format!(
                "tensor `{}` belongs to no stage of the layout (unknown parameter `{param}`)",
                t.name
            ))
        })?;
        let &rank = layout.stage_rank.get(stage).ok_or_else(|| {
            ModelError::Mismatch(format!(
                "parameter `{param}` is in stage {stage}, the layout places {} stages",
                layout.stage_rank.len()
            ))
        })?;
        per_rank[rank].push(t);
    }
    let mut shards = Vec::with_capacity(layout.world());
    for replica in 0..layout.dp {
        for (r, tensors) in per_rank.iter().enumerate() {
            shards.push(write_shard_refs(dir, replica * pp + r, tensors)?);
        }
    }
    let drafter = match &checkpoint.drafter {
        Some(state) => Some(save_drafter(dir, state, &checkpoint.meta.model)?),
        None => None,
    };
    let meta = &checkpoint.meta;
    let manifest = Manifest {
        format: SHARDED_FORMAT.into(),
        version: VERSION,
        step: meta.step,
        world: layout.world(),
        layout: layout.clone(),
        config_hash: config_hash.to_string(),
        model: meta.model.clone(),
        optimizer_step: meta.optimizer_step,
        data_seed: meta.data_seed,
        notes: meta.notes.clone(),
        replicas_saved: Some(layout.dp),
        shards,
        drafter,
    };
    manifest.write(dir)?;
    Ok(manifest)
}

/// Removes the manifest of the checkpoint in `dir`, if any. Saving over an older checkpoint
/// starts with this, so that until the new manifest is written the directory reads as
/// incomplete, never as the old manifest over new shards.
pub fn remove_manifest(dir: &Path) -> Result<(), ModelError> {
    match fs::remove_file(dir.join(MANIFEST_FILE)) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            Err(ModelError::CheckpointIo {
                path: dir.join(MANIFEST_FILE),
                error,
            })
        }
        _ => Ok(()),
    }
}

/// A whole-model checkpoint of `params` (in model order) and `optimizer` after `step`
/// steps, for a run whose state is held by its ranks rather than by one [`crate::model::Gpt`].
/// Moments are stored as [`super::Checkpoint::capture`] stores them. The moments are copied;
/// [`from_owned_state`] moves them instead.
pub fn from_state(
    model: GptConfig,
    data_seed: u64,
    step: u64,
    params: Vec<HostTensor>,
    optimizer: &crate::model::OptimizerState,
) -> Checkpoint {
    from_owned_state(model, data_seed, step, params, optimizer.clone())
}

/// [`from_state`] taking the optimizer state: its moments become the checkpoint's tensors
/// without a copy (a checkpoint writer holds the state once, not twice).
pub fn from_owned_state(
    model: GptConfig,
    data_seed: u64,
    step: u64,
    params: Vec<HostTensor>,
    optimizer: crate::model::OptimizerState,
) -> Checkpoint {
    let mut tensors = params;
    let shapes: HashMap<String, Vec<usize>> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    for (name, slot) in optimizer.slots {
        let shape = shapes
            .get(&name)
            .cloned()
            .unwrap_or_else(|| vec![slot.m.len()]);
        let mut push = |prefix: &str, data: Vec<f32>| {
            tensors.push(HostTensor {
                name: format!("{prefix}{name}"),
                shape: shape.clone(),
                data,
            })
        };
        push(ADAM_M_PREFIX, slot.m);
        push(ADAM_V_PREFIX, slot.v);
        if let Some(master) = slot.master {
            push(MASTER_PREFIX, master);
        }
    }
    Checkpoint::new(step, model, optimizer.step, data_seed, tensors)
}

/// Reads one shard, checking its name, size and hash against `entry` (the manifest's
/// `shards[entry.rank]`) before its tensors are parsed.
pub(super) fn read_shard(dir: &Path, entry: &ShardEntry) -> Result<Vec<HostTensor>, ModelError> {
    read_listed_tensors(
        dir,
        &dir.join(MANIFEST_FILE),
        &shard_field(entry.rank),
        (&entry.file, entry.bytes, &entry.hash),
        &entry.tensors,
    )
}

/// The manifest field that names rank `rank`'s shard file.
pub(super) fn shard_field(rank: usize) -> String {
    format!("shards[{rank}].file")
}

/// Reads the sharded checkpoint in `dir` back into a whole-model [`Checkpoint`], after
/// checking the manifest against this run's `layout` and `config_hash` and every shard
/// against the manifest. Replicas' shards are all verified; the first replica's tensors
/// are used (the replicas hold bitwise the same state).
pub fn load_sharded(
    dir: &Path,
    layout: &Layout,
    config_hash: &str,
) -> Result<Checkpoint, ModelError> {
    let manifest = Manifest::read(dir)?;
    manifest.check(layout, config_hash)?;
    manifest.check_shards(dir)?;
    let drafter = match &manifest.drafter {
        Some(entry) => Some(load_drafter(dir, entry, &manifest.model)?),
        None => None,
    };
    let pp = layout.pp();
    let mut tensors = Vec::new();
    for entry in &manifest.shards {
        let shard = read_shard(dir, entry)?;
        if entry.rank < pp {
            tensors.extend(shard);
        }
    }
    let mut ckpt = Checkpoint {
        meta: CheckpointMeta {
            format: FORMAT.into(),
            version: manifest.version,
            step: manifest.step,
            model: manifest.model,
            optimizer_step: manifest.optimizer_step,
            data_seed: manifest.data_seed,
            notes: manifest.notes,
            tensor_bytes: 0,
            tensor_hash: None,
            tensors: tensors.iter().map(|t| t.name.clone()).collect(),
            drafter: None,
        },
        tensors,
        drafter,
    };
    super::migrate::upgrade(&mut ckpt);
    Ok(ckpt)
}

/// The newest complete checkpoint of run directory `run_dir` (the highest step whose
/// directory has a manifest), or `None`. Directories without a manifest are skipped: they
/// are checkpoints a run never finished writing.
pub fn latest(run_dir: &Path) -> Result<Option<PathBuf>, ModelError> {
    let root = run_dir.join(CHECKPOINTS_DIR);
    let entries = match fs::read_dir(&root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(ModelError::CheckpointIo { path: root, error }),
    };
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in entries {
        let entry = entry.map_err(|error| ModelError::CheckpointIo {
            path: root.clone(),
            error,
        })?;
        let name = entry.file_name();
        let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        let path = entry.path();
        if path.join(MANIFEST_FILE).is_file() && best.as_ref().is_none_or(|(s, _)| step > *s) {
            best = Some((step, path));
        }
    }
    Ok(best.map(|(_, p)| p))
}

#[cfg(test)]
#[path = "sharded_tests.rs"]
mod tests;
