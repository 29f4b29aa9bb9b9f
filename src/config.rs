//! The TOML job file: one file drives `pipefill train` (and later `pipefill rl`), and every
//! rank of a multi-process launch reads the same one.
//!
//! Every field has a default ([`JobConfig::default`], also written out as
//! `examples/default.toml`, which is embedded in the binary), so a job file only states
//! what it changes. Unknown fields and ill-typed values are errors that name the field;
//! values that parse but make no sense (zero steps, heads that do not divide the width)
//! are caught by [`JobConfig::validate`], whose errors name the field too.
//!
//! `--set section.key=value` overrides are applied to the parsed document before it is
//! turned into a [`JobConfig`], so they go through exactly the same checks as the file.

mod error;
pub mod memory;
pub mod optimizer;
pub mod rl;
pub mod schedule;
pub mod train;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use self::optimizer::OptimizerConfig;
use self::rl::RlConfig;
use crate::data::DataConfig;
use crate::model::GptConfig;
use crate::model::ModelError;
use crate::model::drafter::DrafterConfig;
pub use error::ConfigError;
pub use schedule::ScheduleChoice;
pub use train::TrainConfig;

/// The embedded default job (the same text as `examples/default.toml`).
pub const DEFAULT_JOB: &str = include_str!("../examples/default.toml");

/// The largest job file read: a job is a page of settings (the default is 2 KB).
pub const MAX_JOB_BYTES: u64 = 1 << 20;

/// How stage timelines are timed (see DESIGN.md, "Clocks"): the job file's `clock` and
/// `--clock`'s values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ClockKind {
    /// Each action is timed by the thread CPU time it used, one virtual clock per stage.
    #[default]
    Virtual,
    /// Real elapsed time.
    Wall,
}

impl ClockKind {
    /// The runtime's clock for this choice (a virtual clock without link latency).
    pub fn runtime(self) -> pipefill_actors::Clock {
        match self {
            ClockKind::Virtual => pipefill_actors::Clock::virtual_free(),
            ClockKind::Wall => pipefill_actors::Clock::Wall,
        }
    }

    /// The name the job file uses.
    pub fn name(self) -> &'static str {
        match self {
            ClockKind::Virtual => "virtual",
            ClockKind::Wall => "wall",
        }
    }
}

/// What a pipelined job runs in its bubbles (see `actors/src/router.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Filler {
    /// Train the `[drafter]` on the last stage's hidden states, in the bubbles it fits.
    #[default]
    Drafter,
    /// Leave the bubbles idle.
    None,
}

/// What a job's ranks compute on: `"cpu"` or `"cuda"` (the job file's `device`).
///
/// A job names the kind only: each rank of a launched job computes on the CUDA GPU whose
/// ordinal is its local rank (one GPU per process), a single-process run on GPU 0
/// ([`DeviceKind::on_local_rank`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The CPU backend, one thread per rank (DESIGN.md, "Clocks").
    #[default]
    Cpu,
    /// A CUDA GPU per rank (a build with the `cuda` feature, on a machine with a driver).
    Cuda,
}

impl DeviceKind {
    /// The device of the process with this local rank (its CUDA ordinal).
    pub fn on_local_rank(self, local_rank: usize) -> crate::tensor::device::Device {
        use crate::tensor::device::Device;
        match self {
            DeviceKind::Cpu => Device::Cpu { threads: 1 },
            DeviceKind::Cuda => Device::Cuda {
                ordinal: local_rank,
            },
        }
    }

    /// [`on_local_rank`](Self::on_local_rank), checked to be usable here: without the
    /// `cuda` feature, without a driver (probed before any other CUDA call, so never a
    /// panic) or without that GPU, the error names the `device` field.
    pub fn usable_on_local_rank(
        self,
        local_rank: usize,
    ) -> Result<crate::tensor::device::Device, ConfigError> {
        let device = self.on_local_rank(local_rank);
        device.check_available().map_err(|e| ConfigError::Invalid {
            field: "device".into(),
            reason: format!("\"{self}\" ({device}) cannot be used here: {e}"),
        })?;
        Ok(device)
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// A whole job: model shape, data, training hyper-parameters and how to run them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JobConfig {
    /// Pipeline schedule: a built-in name (`gpipe`, `1f1b`, `interleaved-1f1b`,
    /// `looped-bfs`, `zb-h1`, `zb-h2`, `zb-v`), `"auto"` (ZB-H1 until every stage's costs
    /// are measured, then the auto-scheduler's plan for them within ZB-H1's memory), the
    /// path of a custom schedule file (`.csv` or `.toml`), or `"none"`, which trains on one
    /// device with the reference trainer.
    pub schedule: ScheduleChoice,
    /// Number of pipeline ranks (one actor each); ignored by schedule `"none"`.
    pub stages: usize,
    /// Data-parallel pipeline replicas of a multi-process job (world = dp × the plan's
    /// ranks); each takes `1/dp` of every step's micro-batches.
    pub dp: usize,
    /// How stage timelines are timed.
    pub clock: ClockKind,
    /// What the ranks compute on: `"cpu"` or `"cuda"` (a launched rank's GPU is the one
    /// of its local rank).
    pub device: DeviceKind,
    /// What a multi-process run's ranks talk over: `"auto"` (NCCL between CUDA GPUs where
    /// it can be used, else TCP), `"tcp"` or `"nccl"` (an error where it cannot be used).
    pub transport: crate::comm::select::TransportKind,
    /// Filler work in the pipeline's bubbles: `"drafter"` or `"none"`.
    pub filler: Filler,
    /// Where checkpoints and metrics go; `runs/<start time>` when absent.
    pub out_dir: Option<PathBuf>,
    /// A pipelined run also saves a sharded checkpoint (`checkpoints/step-N/` of the run
    /// directory: one shard per rank, manifest last) after every this many steps; 0: only
    /// the final `checkpoint/`.
    pub checkpoint_every: u64,
    /// How many of those sharded checkpoints the run keeps: once one is complete, this run's
    /// complete ones older than the newest `checkpoint_keep` are deleted (never one of
    /// another run, never the final `checkpoint/`); 0 keeps them all.
    pub checkpoint_keep: usize,
    pub model: GptConfig,
    pub data: DataConfig,
    pub train: TrainConfig,
    /// How the optimizer's state is kept across the replicas (`shard`: ZeRO-1).
    pub optimizer: OptimizerConfig,
    /// `pipefill rl`: GRPO rollouts and updates (checked by `pipefill rl` only, so a
    /// training job's small `seq_len` never trips over RL defaults).
    pub rl: RlConfig,
    /// The drafter trained in the bubbles (`filler = "drafter"`).
    pub drafter: DrafterConfig,
}

impl Default for JobConfig {
    fn default() -> Self {
        Self {
            schedule: ScheduleChoice::Builtin(crate::schedules::ScheduleKind::ZbH1),
            stages: 4,
            dp: 1,
            clock: ClockKind::default(),
            device: DeviceKind::default(),
            transport: Default::default(),
            filler: Filler::default(),
            out_dir: None,
            checkpoint_every: 0,
            checkpoint_keep: 3,
            model: GptConfig::default(),
            data: DataConfig::default(),
            train: TrainConfig::default(),
            optimizer: OptimizerConfig::default(),
            rl: RlConfig::default(),
            drafter: DrafterConfig::default(),
        }
    }
}

impl JobConfig {
    /// The fingerprint of the settings that decide a run's trajectory: the model, the data
    /// and the training hyper-parameters, except the step count (a resumed run may be asked
    /// to go further), the CPU threads, the evaluation size and the recomputation (none
    /// changes an update). The schedule and the rank counts are checked apart, as a sharded
    /// checkpoint's layout.
    pub fn fingerprint(&self) -> String {
        let train = TrainConfig {
            steps: 0,
            threads: 0,
            eval_tasks: 0,
            recompute: Default::default(),
            ..self.train.clone()
        };
        let json = serde_json::to_vec(&(&self.model, &self.data, &train))
            .expect("job settings always serialize");
        crate::model::checkpoint::sharded::fingerprint(&json)
    }

    /// Parses a job file's text; `origin` (a path, "embedded default") labels errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        Self::from_toml_with(text, origin, &[])
    }

    /// Parses a job file's text and applies `key=value` overrides (dotted keys, TOML
    /// values; a value that is not valid TOML is taken as a string), then validates.
    pub fn from_toml_with(text: &str, origin: &str, sets: &[String]) -> Result<Self, ConfigError> {
        let parse_err = |e: toml::de::Error| ConfigError::Parse {
            origin: origin.to_string(),
            message: one_line(&e, text),
        };
        let mut job: JobConfig = if sets.is_empty() {
            // Straight from the text, so errors point at the file's own lines.
            toml::from_str(text).map_err(parse_err)?
        } else {
            let mut doc: toml::Table = toml::from_str(text).map_err(parse_err)?;
            for arg in sets {
                apply_set(&mut doc, arg)?;
            }
            toml::Value::Table(doc)
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    origin: format!("{origin} with --set overrides"),
                    message: one_line(&e, ""),
                })?
        };
        job.import_model()?;
        job.validate()?;
        Ok(job)
    }

    /// With `[model] from = "DIR"`: the model's shape from the directory's config.json
    /// (the job keeps its `seq_len`, which must fit the model's positions, and its seed),
    /// and a JSONL dataset's tokenizer from the directory unless `data.tokenizer` names
    /// one. The weights are read later, each chunk its own ([`crate::model::ModelChunk`]).
    fn import_model(&mut self) -> Result<(), ConfigError> {
        let Some(dir) = self.model.from.clone() else {
            return Ok(());
        };
        let invalid = |reason: String| ConfigError::Invalid {
            field: "model.from".into(),
            reason,
        };
        let hf = crate::model::hf::HfModel::open(&dir).map_err(|e| invalid(e.to_string()))?;
        let imported = hf.config();
        // The model's own positions (config.json's `max_position_embeddings`; the imported
        // shape's seq_len is capped for the memory estimate).
        let positions = hf
            .hf_config()
            .raw
            .get("max_position_embeddings")
            .and_then(|v| v.as_u64())
            .map_or(imported.seq_len, |p| {
                usize::try_from(p).unwrap_or(usize::MAX)
            });
        if self.model.seq_len > positions {
            return Err(ConfigError::Invalid {
                field: "model.seq_len".into(),
                reason: format!(
                    "{} is longer than the {} positions of the model in {}",
                    self.model.seq_len,
                    positions,
                    dir.display()
                ),
            });
        }
        self.model = GptConfig {
            seq_len: self.model.seq_len,
            seed: self.model.seed,
            from: Some(dir.clone()),
            ..imported.clone()
        };
        if self.data.source == crate::data::DataSource::Jsonl && self.data.tokenizer.is_none() {
            self.data.tokenizer = Some(dir);
        }
        Ok(())
    }

    /// Reads and parses the job file at `path` (at most [`MAX_JOB_BYTES`]).
    pub fn load(path: &Path, sets: &[String]) -> Result<Self, ConfigError> {
        let text = crate::input::read_text(path, MAX_JOB_BYTES, "a job file")?;
        Self::from_toml_with(&text, &path.display().to_string(), sets)
    }

    /// The embedded default job with `sets` applied.
    pub fn embedded(sets: &[String]) -> Result<Self, ConfigError> {
        Self::from_toml_with(DEFAULT_JOB, "embedded default job", sets)
    }

    /// The job as TOML text (what is written next to a run's outputs).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a JobConfig always serializes")
    }

    /// The `[drafter]` section, for a job that trains a drafter (`filler = "drafter"`, or
    /// `pipefill rl` with `rl.speculation`): every field, and that its unrolled steps can
    /// train on this model.
    pub fn check_drafter(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, reason: String| ConfigError::Invalid {
            field: field.to_string(),
            reason,
        };
        self.drafter.validate().map_err(|e| match e {
            ModelError::DrafterConfig { field, reason } => invalid(field, reason),
            other => invalid("drafter", other.to_string()),
        })?;
        match self.drafter.unsupported_for(&self.model) {
            Some(reason) => Err(invalid("drafter.unroll_context", reason.into())),
            None => Ok(()),
        }
    }

    /// Checks the values that parse but cannot be used; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, reason: String| ConfigError::Invalid {
            field: field.to_string(),
            reason,
        };
        self.model.validate().map_err(|e| match e {
            ModelError::Config { field, reason } => invalid(&format!("model.{field}"), reason),
            other => invalid("model", other.to_string()),
        })?;
        let min_vocab = Self::min_vocab();
        if self.model.vocab < min_vocab {
            return Err(invalid(
                "model.vocab",
                format!(
                    "{} is too small: the tokenizer's ids (PAD, BOS, EOS and the tasks' \
                     characters) need at least {min_vocab}",
                    self.model.vocab
                ),
            ));
        }
        self.data.validate().map_err(|e| match e {
            crate::data::DataError::Invalid { field, reason } => invalid(field, reason),
            other => invalid("data", other.to_string()),
        })?;
        let tokenizer_vocab =
            (self.data.tokenizer_vocab()).map_err(|e| invalid("data.tokenizer", e.to_string()))?;
        if let Some(ids) = tokenizer_vocab.filter(|&ids| self.model.vocab < ids) {
            return Err(invalid(
                "model.vocab",
                format!(
                    "{} is smaller than data.tokenizer's {ids} ids",
                    self.model.vocab
                ),
            ));
        }
        self.train.validate()?;
        if self.data.families.is_empty() {
            return Err(invalid(
                "data.families",
                "at least one family is needed".into(),
            ));
        }
        if self.filler == Filler::Drafter {
            self.check_drafter()?;
        }
        if self.stages == 0 {
            return Err(invalid("stages", "must be at least 1".into()));
        }
        if self.dp == 0 {
            return Err(invalid("dp", "must be at least 1".into()));
        }
        // Sizes whose memory cannot even be counted (checked arithmetic) are errors now;
        // whether the count fits the machine is the command's check (`check_memory`).
        memory::MemoryEstimate::bounded(self, memory::Workload::Train)?;
        Ok(())
    }
}

/// Settings that moved to an `advanced` table (internal tuning) or were merged into one,
/// and where they are now: an old job file's error says so.
const MOVED: &[(&str, &str)] = &[
    ("smooth_l1_beta", "`drafter.advanced.smooth_l1_beta`"),
    ("buffer_rows", "`drafter.advanced.buffer_rows`"),
    ("cost_ema", "`drafter.advanced.cost_ema`"),
    ("planned_fill", "`drafter.advanced.planned_fill`"),
    ("plain_arm", "`rl.advanced.plain_arm`"),
    ("min_group_rows", "`rl.advanced.min_group_rows`"),
    (
        "idle_fill",
        "`rl.advanced.drafter_work` (idle_fill = false is \"after\")",
    ),
    (
        "drafter_leftover",
        "`rl.advanced.drafter_work` (\"defer\" is \"idle\", \"after\" is \"idle-then-after\")",
    ),
];

/// `message` with where a moved setting went, when it names one as unknown.
fn with_moved(message: String) -> String {
    match MOVED
        .iter()
        .find(|(old, _)| message.contains(&format!("unknown field `{old}`")))
    {
        Some((old, new)) => format!("{message}; `{old}` is now {new}"),
        None => message,
    }
}

/// A TOML error as one line: ``line L, column C (`the line`): message`` when it points into
/// `text`,
/// `in `section`: message` when it names a field of a document without text (the `--set`
/// path), so the command line's error stays one line.
fn one_line(e: &toml::de::Error, text: &str) -> String {
    with_moved(one_line_of(e, text))
}

fn one_line_of(e: &toml::de::Error, text: &str) -> String {
    let message = e.message().trim();
    if let Some(span) = e.span().filter(|s| s.start <= text.len()) {
        let before = &text[..span.start];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let column = before.len() - line_start + 1;
        // The line itself names the field (`steps = "many"`), which the message may not.
        let source = text[line_start..].lines().next().unwrap_or("").trim();
        return format!("line {line}, column {column} (`{source}`): {message}");
    }
    // Without a position, the Display form ends with `in `a.b`` naming the field's table.
    let shown = e.to_string();
    let lines: Vec<&str> = shown
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    match lines.split_last() {
        Some((last, rest)) if last.starts_with("in `") && !rest.is_empty() => {
            format!("{last}: {}", rest.join(" "))
        }
        _ => lines.join(" "),
    }
}

/// Applies one `a.b.c=value` to `doc`, creating the tables on the way.
fn apply_set(doc: &mut toml::Table, arg: &str) -> Result<(), ConfigError> {
    let err = |reason: String| ConfigError::Set {
        arg: arg.to_string(),
        reason,
    };
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| err("expected key=value, e.g. train.steps=100".into()))?;
    let path: Vec<&str> = key.trim().split('.').map(str::trim).collect();
    if path.iter().any(|p| p.is_empty()) {
        return Err(err(format!("`{key}` is not a dotted key")));
    }
    let raw = raw.trim();
    // A TOML value (number, bool, quoted string, array); anything else is a bare string.
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let (last, parents) = path.split_last().expect("split gives at least one part");
    let mut table = doc;
    for (i, part) in parents.iter().enumerate() {
        let entry = table
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = entry
            .as_table_mut()
            .ok_or_else(|| err(format!("`{}` is not a section", path[..=i].join("."))))?;
    }
    table.insert(last.to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests;
