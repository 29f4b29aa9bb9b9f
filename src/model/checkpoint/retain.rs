//! How many of a run's periodic checkpoints stay on disk (`checkpoint_keep`).
//!
//! A run that saves a sharded checkpoint every step would otherwise keep all of them. Its
//! checkpoint writer — the in-process pipeline's ([`crate::pipeline::shared`]) and rank 0's
//! of a launched job ([`crate::pipeline::mesh`]) alike — tells its [`Retention`] each time a
//! checkpoint is **complete** (its manifest written), and the retention then deletes this
//! run's older complete checkpoints beyond the newest `keep`. So:
//!
//! - a checkpoint is deleted only once `keep` newer ones are complete; one still being
//!   written (no manifest yet) is never counted, so its predecessors stay;
//! - only checkpoints this run completed are deleted (a run resumed from step `s` into its
//!   own run directory continues that run: its complete checkpoints of steps up to `s`
//!   with the same job fingerprint count as this run's, [`Retention::continuing`]); the
//!   retention remembers them, and
//!   checks before deleting that the directory is still `checkpoints/step-NNNNNNNN/` (the exact
//!   name [`super::sharded::step_dir`] gives), a real directory, whose manifest still has
//!   that step and this job's fingerprint. Checkpoints of earlier runs in the same run
//!   directory, and anything else there, are left alone;
//! - a deletion removes the manifest first (from then on the directory reads as
//!   incomplete, never as a complete checkpoint with shards missing), then exactly the files
//!   the manifest lists, then the directory if nothing else is left in it;
//! - `keep = 0` keeps every checkpoint.
//!
//! The final whole-model `checkpoint/` of a run is not a periodic checkpoint and is never
//! touched.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use super::sharded::{CHECKPOINTS_DIR, MANIFEST_FILE, Manifest, remove_manifest, step_dir};
use crate::model::ModelError;

/// A complete checkpoint this run wrote.
#[derive(Debug, Clone)]
struct Written {
    dir: PathBuf,
    config_hash: String,
}

/// The periodic checkpoints one run completed, and how many of them it keeps (see the
/// module docs). Shared by the run's writers: they may complete out of step order.
#[derive(Debug)]
pub struct Retention {
    keep: usize,
    /// By step.
    written: Mutex<BTreeMap<u64, Written>>,
}

impl Retention {
    /// Keeps the newest `keep` complete checkpoints of the run (0: all).
    pub fn new(keep: usize) -> Self {
        Retention {
            keep,
            written: Mutex::new(BTreeMap::new()),
        }
    }

    /// A run resumed from step `step` into `run_dir`: the directory's complete checkpoints of
    /// steps up to `step` whose manifest has `config_hash` (the same job) are this run's
    /// too, so the newest `keep` across the resume stay. Anything else there is left alone.
    pub fn continuing(
        keep: usize,
        run_dir: &Path,
        config_hash: &str,
        step: u64,
    ) -> Result<Self, ModelError> {
        let retention = Self::new(keep);
        let root = run_dir.join(CHECKPOINTS_DIR);
        let entries = match fs::read_dir(&root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(retention),
            Err(error) => return Err(ModelError::CheckpointIo { path: root, error }),
        };
        let mut written = retention
            .written
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for entry in entries {
            let dir = entry
                .map_err(|error| ModelError::CheckpointIo {
                    path: root.clone(),
                    error,
                })?
                .path();
            // Only complete checkpoints of this job, named as their step's; a directory
            // that does not read as one is not this run's and stays.
            let Ok(manifest) = Manifest::read(&dir) else {
                continue;
            };
            if manifest.step <= step
                && manifest.config_hash == config_hash
                && is_step_dir(&dir, manifest.step)
            {
                written.insert(
                    manifest.step,
                    Written {
                        dir,
                        config_hash: manifest.config_hash,
                    },
                );
            }
        }
        drop(written);
        Ok(retention)
    }

    /// How many complete checkpoints the run keeps (0: all).
    pub fn keep(&self) -> usize {
        self.keep
    }

    /// Records that the checkpoint `manifest` describes is complete in `dir` (its manifest
    /// just written), and deletes this run's complete checkpoints older than the newest
    /// `keep`. Returns the directories deleted, oldest first.
    pub fn completed(&self, dir: &Path, manifest: &Manifest) -> Result<Vec<PathBuf>, ModelError> {
        if self.keep == 0 {
            return Ok(Vec::new());
        }
        let mut written = self.written.lock().unwrap_or_else(PoisonError::into_inner);
        written.insert(
            manifest.step,
            Written {
                dir: dir.to_path_buf(),
                config_hash: manifest.config_hash.clone(),
            },
        );
        let mut removed = Vec::new();
        while written.len() > self.keep {
            let (step, old) = written.pop_first().expect("more than keep ≥ 1 entries");
            if remove_checkpoint(&old, step)? {
                removed.push(old.dir);
            }
        }
        Ok(removed)
    }
}

/// Whether `dir` is named as [`step_dir`] names the checkpoint of `step`: `step-NNNNNNNN`
/// inside a `checkpoints` directory.
fn is_step_dir(dir: &Path, step: u64) -> bool {
    let parent_is_root = dir
        .parent()
        .and_then(Path::file_name)
        .is_some_and(|n| n == CHECKPOINTS_DIR);
    let named = step_dir(Path::new(""), step);
    parent_is_root && dir.file_name() == named.file_name()
}

/// Deletes the checkpoint of `step` this run wrote in `old.dir`, if it still is that
/// checkpoint (else leaves it, with a warning); whether it was deleted.
fn remove_checkpoint(old: &Written, step: u64) -> Result<bool, ModelError> {
    let dir = &old.dir;
    let leave = |why: String| {
        tracing::warn!("checkpoint_keep: left {} in place: {why}", dir.display());
        Ok(false)
    };
    if !is_step_dir(dir, step) {
        return leave(format!("not named as the checkpoint of step {step}"));
    }
    match fs::symlink_metadata(dir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return leave("not a directory".into()),
        Err(e) => return leave(e.to_string()),
    }
    let manifest = match Manifest::read(dir) {
        Ok(m) => m,
        Err(e) => return leave(format!("its manifest no longer reads ({e})")),
    };
    if manifest.step != step || manifest.config_hash != old.config_hash {
        return leave(format!(
            "its manifest is now of step {} and job {}, not the step-{step} checkpoint of job \
             {} this run wrote",
            manifest.step, manifest.config_hash, old.config_hash
        ));
    }
    // The manifest first: from here on the directory reads as an incomplete checkpoint.
    remove_manifest(dir)?;
    for name in manifest.files() {
        // Plain file names: `Manifest::read` checked them.
        let path = dir.join(name);
        match fs::remove_file(&path) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(ModelError::CheckpointIo { path, error });
            }
            _ => {}
        }
    }
    match fs::remove_dir(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty => {
            tracing::warn!(
                "checkpoint_keep: deleted the step-{step} checkpoint's {MANIFEST_FILE} and files \
                 but left {}: it holds other files",
                dir.display()
            );
            Ok(true)
        }
        Err(error) => Err(ModelError::CheckpointIo {
            path: dir.clone(),
            error,
        }),
    }
}

#[cfg(test)]
#[path = "retain_tests.rs"]
mod tests;
