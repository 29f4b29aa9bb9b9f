//! Subcommands of the `pipefill` binary, one module each.

pub mod bench;
pub mod export;
pub mod generate;
pub mod launch;
pub mod profile;
pub mod rl;
pub mod schedule;
pub mod show;
pub mod train;

use std::path::Path;

use pipefill::config::JobConfig;

/// The job of a job command (`train`, `rl`): the job file `config` (the embedded default
/// without one) with `sets` applied, then the output directory and the Hugging Face model
/// directory as `out_dir` and `model.from` when given.
pub(crate) fn load_job(
    config: Option<&Path>,
    mut sets: Vec<String>,
    out_dir: Option<&Path>,
    model: Option<&Path>,
) -> anyhow::Result<JobConfig> {
    for (key, dir) in [("out_dir", out_dir), ("model.from", model)] {
        if let Some(dir) = dir {
            let dir = toml::Value::String(dir.display().to_string());
            sets.push(format!("{key}={dir}"));
        }
    }
    Ok(match config {
        Some(path) => JobConfig::load(path, &sets)?,
        None => JobConfig::embedded(&sets)?,
    })
}
