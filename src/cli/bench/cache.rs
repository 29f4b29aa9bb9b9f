//! `bench rollout`'s run directory (`--run-dir`): the trained target and the drafters
//! trained for its batches, kept so that reruns measure instead of training again (on the
//! 2-core reference box the d512 target takes minutes to train and its drafter minutes more).
//!
//! The target is a `pipefill train` run's layout (`job.toml` and `checkpoint/`), so a
//! directory that holds one (a run of `pipefill train`, or an earlier bench's) is loaded as
//! it is, its `[model]` and seed winning over the bench's. A drafter is a file named by a
//! fingerprint of everything it was trained from (the target's step, the batch, `[drafter]`,
//! the slices), so a changed batch or setting trains a new one beside the old. Beside it, its
//! agreement on its own rows (`.own`), so that a rerun need not roll its batch out again to
//! print it.

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

/// Where the agreement of the drafter at `drafter` on its own rows is kept.
fn agreement_path(drafter: &Path) -> std::path::PathBuf {
    drafter.with_extension("own")
}

/// The agreement on its own rows kept beside the drafter at `drafter`, if there is one.
pub(super) fn cached_agreement(drafter: &Path) -> anyhow::Result<Option<f64>> {
    let path = agreement_path(drafter);
    if !path.exists() {
        return Ok(None);
    }
    // A number's few bytes: anything longer is not one.
    let text = pipefill::input::read_text(&path, 64, "a drafter's kept agreement")?;
    match text.trim().parse::<f64>() {
        Ok(a) if (0.0..=1.0).contains(&a) => Ok(Some(a)),
        _ => anyhow::bail!(
            "{}: not a drafter's agreement (a number in [0, 1]; remove it)",
            path.display()
        ),
    }
}

/// Keeps `agreement` beside the drafter at `drafter`.
pub(super) fn save_agreement(drafter: &Path, agreement: f64) -> anyhow::Result<()> {
    let path = agreement_path(drafter);
    write_atomic(&path, format!("{agreement}\n").as_bytes())
        .with_context(|| format!("{}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kept agreement comes back as written; none kept is `None`; anything else in its
    /// file is one error naming the file.
    #[test]
    fn the_agreement_kept_beside_a_drafter_comes_back_or_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let drafter = dir.path().join("drafter-0123.bin");
        assert_eq!(cached_agreement(&drafter).unwrap(), None);
        save_agreement(&drafter, 0.875).unwrap();
        assert_eq!(cached_agreement(&drafter).unwrap(), Some(0.875));
        for bad in ["", "eighty", "1.5", "NaN", &"9".repeat(100)] {
            std::fs::write(dir.path().join("drafter-0123.own"), bad).unwrap();
            let err = cached_agreement(&drafter).unwrap_err().to_string();
            assert!(err.contains("drafter-0123.own"), "{err}");
        }
    }
}
