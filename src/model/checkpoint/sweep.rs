//! Removing what checkpoints leave in a run directory, and nothing else.
//!
//! A checkpoint writes a known set of files: a whole-model one ([`super::resume::FINAL_DIR`])
//! its sidecar ([`META_FILE`]), the tensor file ([`TENSOR_FILE`]) and the drafter's file the
//! sidecar lists; a sharded one (`checkpoints/step-N/`) its manifest ([`MANIFEST_FILE`]) and
//! the shards and drafter file it lists. Each file goes through a temporary
//! `.NAME.tmp.PID` ([`super::write_atomic`]) that a run killed during the write leaves behind.
//!
//! - [`Sweep::Everything`] (`--overwrite`): the checkpoints of the replaced run go. In
//!   `checkpoint/` the sidecar (first) and the files it lists; in `checkpoints/` each
//!   `step-N` directory's manifest (first) and the files it lists; in both, tensor files of
//!   a checkpoint never finished (no sidecar or manifest) when their safetensors header says
//!   pipefill wrote them, and the temporary files of a checkpoint's names. A directory is
//!   removed once that leaves it empty.
//! - [`Sweep::Leftovers`] (a run continuing in its directory): only what an interrupted write
//!   left: temporary files, and `step-N` directories without a manifest (incomplete: their
//!   pipefill tensor files and temporaries, then the directory once empty). A complete
//!   checkpoint stays whole.
//!
//! Anything else stays: a user's notes, a subfolder that is not `step-N`, a symlink, a
//! `checkpoint.json` or manifest that is not pipefill's, a tensor file another program wrote,
//! and the temporary file of a process still running.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::drafter::DRAFTER_FILE;
use super::files::{MAX_META_BYTES, plain_name, read_bounded};
use super::resume::last_complete;
use super::sharded::{CHECKPOINTS_DIR, MANIFEST_FILE, Manifest, SHARDED_FORMAT};
use super::{CheckpointMeta, FORMAT, META_FILE, TENSOR_FILE};
use crate::model::ModelError;

/// What a sweep removes (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sweep {
    /// What an interrupted write left (a run continuing in its directory).
    Leftovers,
    /// Every checkpoint file a run wrote (`--overwrite`).
    Everything,
}

/// The file a temporary of [`super::write_atomic`] stands for and the process that wrote
/// it: `.NAME.tmp.PID` → `(NAME, PID)`.
pub fn temp_target(name: &str) -> Option<(&str, u32)> {
    let (target, pid) = name.strip_prefix('.')?.rsplit_once(".tmp.")?;
    if target.is_empty() || pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((target, pid.parse().ok()?))
}

/// Whether `name` is a shard's file name (`rank-NNNNN.safetensors`).
pub fn is_shard_name(name: &str) -> bool {
    name.strip_prefix("rank-")
        .and_then(|r| r.strip_suffix(".safetensors"))
        .is_some_and(|n| n.len() >= 5 && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The step of a `step-N` directory name.
pub fn step_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Sweeps the checkpoints of run directory `run_dir` (`checkpoint/` and `checkpoints/`) as
/// `what` says; returns the paths removed.
pub fn sweep_run(run_dir: &Path, what: Sweep) -> Result<Vec<PathBuf>, ModelError> {
    let mut removed = sweep_final(&run_dir.join(super::resume::FINAL_DIR), what)?;
    let root = run_dir.join(CHECKPOINTS_DIR);
    if !real_dir(&root) {
        return Ok(removed);
    }
    for name in names(&root)? {
        if step_of(&name).is_some() {
            removed.extend(sweep_step(&root.join(&name), what)?);
        }
    }
    if what == Sweep::Everything && remove_if_empty(&root)? {
        removed.push(root);
    }
    Ok(removed)
}

/// Sweeps the whole-model checkpoint directory `dir` as `what` says.
pub fn sweep_final(dir: &Path, what: Sweep) -> Result<Vec<PathBuf>, ModelError> {
    let mut removed = Vec::new();
    if !real_dir(dir) {
        return Ok(removed);
    }
    let names = names(dir)?;
    if what == Sweep::Everything {
        let sidecar = dir.join(META_FILE);
        match read_sidecar(&sidecar) {
            Some(meta) => {
                // The sidecar first: from here on the directory is no checkpoint.
                remove(&sidecar, &mut removed)?;
                remove(&dir.join(TENSOR_FILE), &mut removed)?;
                if let Some(d) = meta.drafter.filter(|d| plain_name(&d.file)) {
                    remove(&dir.join(d.file), &mut removed)?;
                }
            }
            None => {
                for name in [TENSOR_FILE, DRAFTER_FILE] {
                    remove_if_ours(&dir.join(name), &mut removed)?;
                }
            }
        }
    }
    let ours = |n: &str| [TENSOR_FILE, META_FILE, DRAFTER_FILE].contains(&n);
    remove_temps(dir, &names, ours, &mut removed)?;
    if what == Sweep::Everything && remove_if_empty(dir)? {
        removed.push(dir.to_path_buf());
    }
    Ok(removed)
}

/// Sweeps the sharded checkpoint directory `dir` (a `step-N`) as `what` says: every file of
/// its checkpoint ([`Sweep::Everything`]), or what an interrupted write left
/// ([`Sweep::Leftovers`]: a directory with a manifest keeps its checkpoint). The directory
/// goes once empty, except a complete one swept for leftovers.
pub fn sweep_step(dir: &Path, what: Sweep) -> Result<Vec<PathBuf>, ModelError> {
    let mut removed = Vec::new();
    if !real_dir(dir) {
        return Ok(removed);
    }
    let names = names(dir)?;
    let manifest_path = dir.join(MANIFEST_FILE);
    let has_manifest = fs::symlink_metadata(&manifest_path).is_ok();
    // A complete checkpoint, or a manifest that is not pipefill's, keeps its files.
    let mut incomplete = !has_manifest;
    if has_manifest
        && what == Sweep::Everything
        && let Ok(manifest) = Manifest::read(dir)
    {
        // The manifest first: from here on the directory reads as incomplete.
        remove(&manifest_path, &mut removed)?;
        incomplete = true;
        for name in manifest.files() {
            // Plain names: Manifest::read checked them.
            remove(&dir.join(name), &mut removed)?;
        }
    }
    if incomplete {
        for name in &names {
            if is_shard_name(name) || name == DRAFTER_FILE {
                remove_if_ours(&dir.join(name), &mut removed)?;
            }
        }
    }
    let ours = |n: &str| n == MANIFEST_FILE || n == DRAFTER_FILE || is_shard_name(n);
    remove_temps(dir, &names, ours, &mut removed)?;
    if incomplete && remove_if_empty(dir)? {
        removed.push(dir.to_path_buf());
    }
    Ok(removed)
}

/// The error of the periodic checkpoint of `step` in `dir` (of run directory `run_dir`)
/// whose write failed with `source`: what the write left in `dir` is removed first
/// ([`Sweep::Leftovers`]: it has no manifest), and the error names the checkpoint a resume
/// of the run would continue from.
pub fn failed_periodic(run_dir: &Path, dir: &Path, step: u64, source: ModelError) -> ModelError {
    if let Err(e) = sweep_step(dir, Sweep::Leftovers) {
        tracing::warn!("after a failed checkpoint write: {e}");
    }
    ModelError::Periodic {
        step,
        dir: dir.to_path_buf(),
        last: last_complete(run_dir),
        cause: Box::new(source),
    }
}

/// Whether `path` is a directory itself (not a symlink to one).
fn real_dir(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

/// The names of the entries of `dir`.
fn names(dir: &Path) -> Result<Vec<String>, ModelError> {
    let io = |error| ModelError::CheckpointIo {
        path: dir.to_path_buf(),
        error,
    };
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(io)? {
        // A name that is not UTF-8 is none of pipefill's.
        if let Ok(name) = entry.map_err(io)?.file_name().into_string() {
            names.push(name);
        }
    }
    Ok(names)
}

/// The sidecar `path` when it reads as a pipefill checkpoint's.
fn read_sidecar(path: &Path) -> Option<CheckpointMeta> {
    let text = read_bounded(path, MAX_META_BYTES).ok()?;
    let meta: CheckpointMeta = serde_json::from_slice(&text).ok()?;
    (meta.format == FORMAT).then_some(meta)
}

/// Removes the regular file `path` (a missing one is no error), recording it.
fn remove(path: &Path, removed: &mut Vec<PathBuf>) -> Result<(), ModelError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_file() => {}
        // Not a file (a directory, a symlink) or not there: nothing a checkpoint wrote.
        _ => return Ok(()),
    }
    match fs::remove_file(path) {
        Ok(()) => {
            removed.push(path.to_path_buf());
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(ModelError::CheckpointIo {
            path: path.to_path_buf(),
            error,
        }),
    }
}

/// Removes `path` when it is a safetensors file whose header says pipefill wrote it.
fn remove_if_ours(path: &Path, removed: &mut Vec<PathBuf>) -> Result<(), ModelError> {
    match written_by_pipefill(path) {
        true => remove(path, removed),
        false => Ok(()),
    }
}

/// Whether `path` is a regular safetensors file whose metadata's `format` is a pipefill
/// checkpoint's (only its header is read).
pub fn written_by_pipefill(path: &Path) -> bool {
    let header = || -> io::Result<Vec<u8>> {
        if !fs::symlink_metadata(path)?.is_file() {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        let mut file = fs::File::open(path)?;
        let mut len = [0u8; 8];
        file.read_exact(&mut len)?;
        let len = u64::from_le_bytes(len);
        if len > MAX_META_BYTES {
            return Err(io::ErrorKind::InvalidData.into());
        }
        let mut header = Vec::new();
        file.take(len).read_to_end(&mut header)?;
        Ok(header)
    };
    let Ok(header) = header() else {
        return false;
    };
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(&header) else {
        return false;
    };
    let format = value.get("__metadata__").and_then(|m| m.get("format"));
    format.and_then(serde_json::Value::as_str) == Some(FORMAT)
        || format.and_then(serde_json::Value::as_str) == Some(SHARDED_FORMAT)
}

/// Removes the temporary files among `names` of `dir` that stand for a file `ours` accepts
/// and that no running process (other than this one) is writing.
fn remove_temps(
    dir: &Path,
    names: &[String],
    ours: impl Fn(&str) -> bool,
    removed: &mut Vec<PathBuf>,
) -> Result<(), ModelError> {
    for name in names {
        let Some((target, pid)) = temp_target(name) else {
            continue;
        };
        if ours(target) && !running_elsewhere(pid) {
            remove(&dir.join(name), removed)?;
        }
    }
    Ok(())
}

/// Whether process `pid` is running and is not this process.
fn running_elsewhere(pid: u32) -> bool {
    pid != std::process::id() && Path::new("/proc").join(pid.to_string()).exists()
}

/// Removes `dir` if it is empty; whether it did.
fn remove_if_empty(dir: &Path) -> Result<bool, ModelError> {
    match fs::remove_dir(dir) {
        Ok(()) => Ok(true),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::DirectoryNotEmpty | io::ErrorKind::NotFound
            ) =>
        {
            Ok(false)
        }
        Err(error) => Err(ModelError::CheckpointIo {
            path: dir.to_path_buf(),
            error,
        }),
    }
}

#[cfg(test)]
#[path = "sweep_tests.rs"]
mod tests;
