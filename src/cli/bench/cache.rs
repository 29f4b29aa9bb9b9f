//! `bench rollout`'s run directory (`--run-dir`): the trained target and the drafters
//! trained for its batches, kept so that reruns measure instead of training again (on the
//! 2-core reference box the d512 target takes minutes to train and its drafter minutes more).
//!
//! The target is a `pipefill train` run's layout (`job.toml` and `checkpoint/`), so a
//! directory that holds one (a run of `pipefill train`, or an earlier bench's) is loaded as
//! it is, its `[model]` and seed winning over the bench's. A drafter is a file named by a
//! fingerprint of everything it was trained from (the target's step, the batch, `[drafter]`,
//! the slices), so a changed batch or setting trains a new one beside the old.

use std::path::Path;

use anyhow::Context;
use pipefill::config::JobConfig;
use pipefill::model::checkpoint::sharded::fingerprint;
use pipefill::model::checkpoint::{Checkpoint, write_atomic};
use pipefill::model::drafter::DrafterWeights;
use pipefill::rl::rollout::Request;
use pipefill::run::Show;

/// The directory's target checkpoint, if it holds one (`job` takes its `[model]` and seed).
pub(super) fn cached_target(
    job: &mut JobConfig,
    dir: &Path,
    out: &mut dyn Show,
) -> anyhow::Result<Option<Checkpoint>> {
    if !dir.join("job.toml").exists() {
        return Ok(None);
    }
    Ok(Some(pipefill::run::rl::init_from(job, dir, out)?))
}

/// Keeps `checkpoint` of a target trained under `job` in `dir`, as `pipefill train` would.
pub(super) fn save_target(
    job: &JobConfig,
    checkpoint: &mut Checkpoint,
    dir: &Path,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("--run-dir {}", dir.display()))?;
    checkpoint
        .save(&dir.join("checkpoint"))
        .with_context(|| format!("--run-dir {}: the target's checkpoint", dir.display()))?;
    // Last: a directory with a job.toml holds a whole target.
    write_atomic(&dir.join("job.toml"), job.to_toml().as_bytes())
        .with_context(|| format!("--run-dir {}: job.toml", dir.display()))?;
    Ok(())
}

/// Where the drafter trained for `requests` with `slices` slices on the target of step
/// `step` under `job` lives in `dir`.
pub(super) fn drafter_path(
    dir: &Path,
    job: &JobConfig,
    step: u64,
    requests: &[Request],
    slices: usize,
) -> std::path::PathBuf {
    let mut key = format!(
        "step {step} slices {slices}\n{}\n{}\n",
        toml::to_string(&job.model).unwrap_or_default(),
        toml::to_string(&job.drafter).unwrap_or_default()
    );
    for r in requests {
        key.push_str(&format!("{:?} {}\n", r.prompt, r.max_new));
    }
    dir.join(format!("drafter-{}.bin", fingerprint(key.as_bytes())))
}

/// The drafter weights at `path`, if there are any.
pub(super) fn cached_drafter(path: &Path) -> anyhow::Result<Option<DrafterWeights>> {
    let Ok(bytes) = std::fs::read(path) else {
        return Ok(None);
    };
    let (weights, _) = bincode::serde::decode_from_slice(&bytes, bincode::config::standard())
        .with_context(|| format!("{}: not a cached drafter (remove it)", path.display()))?;
    Ok(Some(weights))
}

/// Keeps `weights` at `path`.
pub(super) fn save_drafter(path: &Path, weights: &DrafterWeights) -> anyhow::Result<()> {
    let bytes = bincode::serde::encode_to_vec(weights, bincode::config::standard())
        .context("encoding the drafter")?;
    write_atomic(path, &bytes).with_context(|| format!("{}", path.display()))
}
