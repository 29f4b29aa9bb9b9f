//! What `--resume PATH` continues from ([`ResumePoint`]), and one rank's share of a sharded
//! checkpoint ([`RankShard`]).
//!
//! A multi-process rank reads only its own shard, but every rank checks the manifest against
//! its layout and job, and the size of every shard the manifest lists (a `stat`, no read):
//! a truncated shard is then refused by every rank at once, with the same error naming the
//! file, instead of by its owner alone while the others wait for it at the rendezvous. A
//! shard's hash is checked by the rank that reads it; before a launched job's rank 0 touches
//! its run directory it also streams every listed file through its hash
//! ([`verify_files`]), so a corrupted shard of another rank fails the start before any file
//! of the run changes.

use std::fs;
use std::path::{Path, PathBuf};

use super::drafter::load_drafter;
use super::files::{MAX_META_BYTES, read_bounded, stat_listed, verify_listed};
use super::migrate::{upgrade_drafter, upgrade_tensors};
use super::sharded::{
    CHECKPOINTS_DIR, Layout, MANIFEST_FILE, Manifest, latest, read_shard, shard_field,
};
use super::{Checkpoint, CheckpointMeta, FORMAT, HostTensor, META_FILE, VERSION};
use crate::model::ModelError;
use crate::model::drafter::state::DrafterState;

/// Name of the final whole-model checkpoint directory inside a run directory.
pub const FINAL_DIR: &str = "checkpoint";

/// A checkpoint to resume from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumePoint {
    /// A sharded checkpoint directory (complete: it has its manifest).
    Sharded(PathBuf),
    /// A whole-model checkpoint directory.
    Whole(PathBuf),
}

impl ResumePoint {
    /// The checkpoint `path` names: a sharded checkpoint directory, a whole-model one, or a
    /// run directory — then the newest of its complete sharded `checkpoints/step-N/` and its
    /// final `checkpoint/` (the sharded one when both are at the same step). A checkpoint
    /// directory without its manifest is refused, never read: it is one a run did not finish
    /// writing.
    pub fn find(path: &Path) -> Result<Self, ModelError> {
        if path.join(MANIFEST_FILE).is_file() {
            return Ok(ResumePoint::Sharded(path.to_path_buf()));
        }
        if path.join(META_FILE).is_file() {
            return Ok(ResumePoint::Whole(path.to_path_buf()));
        }
        if has_shards(path) {
            // Manifest::read names the missing manifest and what it means.
            Manifest::read(path)?;
        }
        let newest = latest(path)?;
        let whole = path.join(FINAL_DIR);
        let whole_step = match whole.join(META_FILE).is_file() {
            true => Some(Checkpoint::load(&whole)?.meta.step),
            false => None,
        };
        let bad = |reason: String| {
            Err(ModelError::BadMeta {
                path: path.to_path_buf(),
                reason,
            })
        };
        match (newest, whole_step) {
            (Some(dir), Some(step)) if step > Manifest::read(&dir)?.step => {
                Ok(ResumePoint::Whole(whole))
            }
            (Some(dir), _) => Ok(ResumePoint::Sharded(dir)),
            (None, Some(_)) => Ok(ResumePoint::Whole(whole)),
            (None, None) if path.join(CHECKPOINTS_DIR).is_dir() => bad(format!(
                "no complete checkpoint in {CHECKPOINTS_DIR}/ (none has its {MANIFEST_FILE}: the \
                 run stopped while writing them) and no {FINAL_DIR}/"
            )),
            (None, None) => bad(format!(
                "not a checkpoint or a run directory with one (no {MANIFEST_FILE}, {META_FILE}, \
                 {CHECKPOINTS_DIR}/ or {FINAL_DIR}/)"
            )),
        }
    }

    /// The checkpoint's directory.
    pub fn dir(&self) -> &Path {
        match self {
            ResumePoint::Sharded(d) | ResumePoint::Whole(d) => d,
        }
    }

    /// The step it resumes at (read from its manifest or sidecar; the tensors are not read).
    pub fn step(&self) -> Result<u64, ModelError> {
        match self {
            ResumePoint::Sharded(dir) => Ok(Manifest::read(dir)?.step),
            ResumePoint::Whole(dir) => {
                let path = dir.join(META_FILE);
                let text = read_bounded(&path, MAX_META_BYTES)?;
                let meta: CheckpointMeta =
                    serde_json::from_slice(&text).map_err(|e| ModelError::BadMeta {
                        path,
                        reason: e.to_string(),
                    })?;
                Ok(meta.step)
            }
        }
    }
}

/// The checkpoint a resume of run directory `run_dir` would continue from
/// ([`ResumePoint::find`]), if it has one: what an error that stops a run names.
pub fn last_complete(run_dir: &Path) -> Option<PathBuf> {
    ResumePoint::find(run_dir)
        .ok()
        .map(|point| point.dir().to_path_buf())
}

/// Whether `dir` holds shard files (`rank-NNNNN.safetensors`).
fn has_shards(dir: &Path) -> bool {
    fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("rank-") && name.ends_with(".safetensors")
        })
    })
}

/// One rank's share of a sharded checkpoint: the parameters of the stages its layout places
/// on it, their optimizer moments, and the manifest's scalars.
#[derive(Debug, Clone)]
pub struct RankShard {
    pub manifest: Manifest,
    /// The shard file read.
    pub path: PathBuf,
    /// In today's layout, whatever `manifest.version` wrote them (upgraded as read).
    pub tensors: Vec<HostTensor>,
}

impl RankShard {
    /// Global rank `rank`'s shard of the checkpoint in `dir`, written by this `layout` and
    /// job (`config_hash`, see [`crate::config::JobConfig::fingerprint`]). A rank of a replica
    /// that saved no shard of its own reads replica 0's rank of the same pipeline place.
    pub fn load(
        dir: &Path,
        layout: &Layout,
        config_hash: &str,
        rank: usize,
    ) -> Result<Self, ModelError> {
        let manifest = Manifest::read(dir)?;
        manifest.check(layout, config_hash)?;
        manifest.check_shards(dir)?;
        let listing = dir.join(MANIFEST_FILE);
        for entry in &manifest.shards {
            let field = shard_field(entry.rank);
            stat_listed(dir, &listing, &field, &entry.file, entry.bytes)?;
        }
        let index = match rank < manifest.shards.len() {
            true => rank,
            false => rank % layout.pp(),
        };
        let entry = &manifest.shards[index];
        let mut tensors = read_shard(dir, entry)?;
        upgrade_tensors(manifest.version, &manifest.model, &mut tensors);
        Ok(RankShard {
            path: dir.join(&entry.file),
            tensors,
            manifest,
        })
    }

    /// The drafter's state the manifest lists beside the shards, if any (a launched run's
    /// drafter is its own file, not part of any rank's shard), in today's layout.
    pub fn drafter(&self) -> Result<Option<DrafterState>, ModelError> {
        let (Some(entry), Some(dir)) = (&self.manifest.drafter, self.path.parent()) else {
            return Ok(None);
        };
        let model = &self.manifest.model;
        let mut drafter = load_drafter(dir, entry, model)?;
        upgrade_drafter(self.manifest.version, model, &mut drafter);
        Ok(Some(drafter))
    }

    /// The shard as a (partial) whole-model [`Checkpoint`]: its tensors under their model
    /// names, with the manifest's step, model, optimizer step and data seed.
    pub fn checkpoint(&self) -> Checkpoint {
        let m = &self.manifest;
        Checkpoint {
            meta: CheckpointMeta {
                format: FORMAT.into(),
                version: VERSION,
                step: m.step,
                model: m.model.clone(),
                optimizer_step: m.optimizer_step,
                data_seed: m.data_seed,
                notes: m.notes.clone(),
                tensor_bytes: 0,
                tensor_hash: None,
                tensors: self.tensors.iter().map(|t| t.name.clone()).collect(),
                drafter: None,
            },
            tensors: self.tensors.clone(),
            // Read apart by [`RankShard::drafter`].
            drafter: None,
        }
    }
}

/// Checks every file the manifest in `dir` lists (each shard, and the drafter's) against its
/// size and hash without holding any of it (`super::files::verify_listed`). The first
/// mismatch is the error, naming the file.
pub fn verify_files(dir: &Path) -> Result<(), ModelError> {
    let manifest = Manifest::read(dir)?;
    let listing = dir.join(MANIFEST_FILE);
    for s in &manifest.shards {
        verify_listed(
            dir,
            &listing,
            &shard_field(s.rank),
            (&s.file, s.bytes, &s.hash),
        )?;
    }
    if let Some(d) = &manifest.drafter {
        verify_listed(dir, &listing, "drafter.file", (&d.file, d.bytes, &d.hash))?;
    }
    Ok(())
}

#[cfg(test)]
#[path = "resume_tests.rs"]
mod tests;
