//! The arguments every job command (`train`, `rl`) takes ([`JobArgs`]), and what they make:
//! the job, and how its run starts ([`pipefill::run::Start`]).

use std::path::{Path, PathBuf};

use pipefill::config::JobConfig;
use pipefill::launch::RankEnv;
use pipefill::run::{Existing, Start};

#[derive(clap::Args)]
pub struct JobArgs {
    /// Job file (TOML). Without one, the embedded default job (examples/default.toml).
    config: Option<PathBuf>,
    /// Override one field of the job, e.g. `--set train.lr=1e-3` or `--set rl.group=8`
    /// (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Output directory (overrides out_dir).
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
    /// Replace the run already in the output directory (its job.toml, metrics, reports and
    /// checkpoints; other files stay). Without it a non-empty output directory is refused,
    /// unless `train --resume` continues the run in it.
    #[arg(long)]
    overwrite: bool,
    /// Most memory the run may use, e.g. `8GiB`, `512MiB` (a launched rank: its share of the
    /// job) [default: the memory available, MemAvailable in /proc/meminfo]. A job whose
    /// estimate exceeds it is refused before anything is allocated.
    #[arg(long, value_name = "SIZE")]
    max_memory: Option<String>,
}

impl JobArgs {
    /// The job: the job file (the embedded default without one) with `--set`, then the
    /// command's own flags as `sets`, then `--out-dir` and the Hugging Face model directory
    /// `model` (`model.from`) when given.
    pub fn job(&self, sets: Vec<String>, model: Option<&Path>) -> anyhow::Result<JobConfig> {
        let mut all = self.set.clone();
        all.extend(sets);
        for (key, dir) in [("out_dir", self.out_dir.as_deref()), ("model.from", model)] {
            if let Some(dir) = dir {
                let dir = toml::Value::String(dir.display().to_string());
                all.push(format!("{key}={dir}"));
            }
        }
        Ok(match &self.config {
            Some(path) => JobConfig::load(path, &all)?,
            None => JobConfig::embedded(&all)?,
        })
    }

    /// How the run starts in this process, `env` (alone, or one rank of a launched job).
    pub fn start<'a>(&'a self, env: &'a RankEnv) -> Start<'a> {
        Start {
            env,
            existing: Existing::overwrite(self.overwrite),
            max_memory: self.max_memory.as_deref(),
        }
    }
}
