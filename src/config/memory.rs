//! The memory a job needs, estimated from its sizes before anything is allocated.
//!
//! [`MemoryEstimate::of`] adds up what a run holds at its peak: the parameters with their
//! gradients, AdamW moments and the copies a checkpoint makes; the activations of the
//! micro-batches in flight at the schedule's peak (from the plan itself for a built-in
//! schedule, every micro-batch through every layer for a schedule file); one working set
//! per rank; the data (the summary's tasks, the batches, the held-out tasks); the per-step
//! records; the drafter trained in the bubbles; and for `pipefill rl` the rollouts' KV
//! caches, logits and drafter rows. Every size is computed with checked 64-bit arithmetic,
//! so a size too large to count is an error naming the field (the largest factor of the
//! product that overflowed), never a wrapped count.
//!
//! [`MemoryEstimate::check`] compares the total with a [`MemoryLimit`]: `--max-memory`, or
//! the machine's available memory (`MemAvailable` in `/proc/meminfo`). Over it, the error
//! is one line naming what to change: the field that dominates the largest part when
//! changing it can bring the job under the limit (with the estimate, its largest parts and
//! the limit), else the limit itself (below what any run needs, or over what any one
//! setting can save).
//!
//! The constants are calibrated on the CPU backend (f32 storage) against the peak RSS of
//! `pipefill train --steps 1` (see the tests of `tests/memory_cli.rs`), so that the
//! estimate stays above it; the peaks are in docs/benchmarks.md, "Memory estimate
//! calibration".

mod limit;
mod parts;
mod refusal;
mod size;

pub use limit::{LimitSource, MemoryLimit};
use parts::*;
pub use size::Bytes;
use size::{Size, add, f, k, mul};

use super::{ConfigError, Filler, JobConfig};
use crate::data::Tokenizer;
use crate::schedules::{CostModel, generate, peak_memory};

/// Bytes per parameter the ranks hold while they train: the f32 value, its gradient and
/// two AdamW moments.
pub const LIVE_PARAM_BYTES: u64 = 16;
/// Of [`LIVE_PARAM_BYTES`], the two f32 AdamW moments: what a sharded optimizer
/// (`optimizer.shard`, ZeRO-1) divides among the `dp` replicas.
pub const MOMENT_BYTES: u64 = 8;
/// Bytes per parameter of the host copies of values and moments that initialisation and
/// the final checkpoint make (calibrated, docs/benchmarks.md).
pub const COPY_PARAM_BYTES: u64 = 48;
/// Bytes per parameter a run's periodic checkpoints hold while the ranks train
/// (`checkpoint_every > 0`): the ranks' deposited state (value and both moments, 12 bytes)
/// twice, the checkpoint being written and the next one's deposits waiting for it (one
/// writer at a time, `crate::pipeline::shared`; the files are streamed from those tensors,
/// with no serialized copy). It coexists with the live state, not with the copies of
/// initialisation and the final checkpoint, so the larger of the two is counted.
pub const CHECKPOINT_PARAM_BYTES: u64 = 24;
/// Bytes per parameter: the live state, and the larger of the initial/final copies and the
/// periodic checkpoints' buffers ([`CHECKPOINT_PARAM_BYTES`]).
pub const PARAM_BYTES: u64 = LIVE_PARAM_BYTES + max(COPY_PARAM_BYTES, CHECKPOINT_PARAM_BYTES);

const fn max(a: u64, b: u64) -> u64 {
    if a > b { a } else { b }
}
/// Extra bytes per parameter in `pipefill rl`: the rollout engine's copy of the policy's
/// weights and the frozen reference policy.
pub const RL_PARAM_BYTES: u64 = 16;
/// Bytes of a step's records in memory: its training line and its RL line
/// (`crate::train::StepMetrics` and `crate::rl::RlStepMetrics`; their sizes are checked
/// against this where those types live).
pub const STEP_LINE_BYTES: u64 = 1024;
/// Bytes of one activation element (f32 storage).
const ELEMENT: u64 = 4;
/// Activation elements per token and layer that a forward stashes, in units of `d_model`
/// (layer input, q, k, v, attention output, norms, residuals, the MLP's input, and what I
/// leaves for W) and of the MLP's hidden width (pre-activation, activation, gate, up and
/// their product): over what the layers keep, so that the estimate stays above the
/// measured peaks (docs/benchmarks.md, "Memory estimate calibration").
const STASH_PER_D: u64 = 16;
const STASH_PER_HIDDEN: u64 = 5;
/// Bytes of the process itself (binary, runtime, allocator slack) and per pipeline rank
/// (its thread, channels and buffers).
const PROCESS_BYTES: u64 = 32 << 20;
const RANK_BYTES: u64 = 4 << 20;
/// Bytes of one generated task besides its text (its strings' headers, family, size).
const TASK_BYTES: u64 = 256;
/// Bytes a run keeps per action and step: the runtime's measured span and action record.
const ACTION_RECORD_BYTES: u64 = 256;
/// Bytes per action of a plan: the action (24) in the plan, its lowered copy with the
/// SEND/RECV pairs, the validator's and simulator's per-(stage, micro-batch) tables and
/// the timeline's span.
pub const PLAN_ACTION_BYTES: u64 = 256;
/// Plans of at most this many actions are generated to read their peak activation memory;
/// larger ones are bounded by GPipe's (every micro-batch in flight).
const MAX_PEAK_ACTIONS: u64 = 1 << 16;
/// Bytes per byte of a schedule file read: an empty CSV cell (one byte) becomes a 24-byte
/// step, a 4-byte cell an action with the validator's tables.
pub const SCHEDULE_FILE_BYTE_COST: u64 = 64;
/// Bytes per byte of a JSONL dataset: its records' text (about its size, with each line's
/// parse transient), and its documents' ids (4 B) and target flags (1 B) per token, at most
/// one token per byte (a byte-level or character tokenizer), with room for special tokens.
pub const JSONL_BYTE_COST: u64 = 8;
/// Bytes per byte of a record while the `tokenizers` crate encodes it (its normalized
/// string with per-byte alignments, pre-token splits, the encoding's tokens and offsets):
/// about 190 measured on a 2.8 MB line with a BPE tokenizer (docs/benchmarks.md), with
/// room. Counted once, for the longest line `data.max_line_bytes` lets through.
pub const TOKENIZE_BYTE_COST: u64 = 256;
/// Bytes per byte of a tokenizer.json in memory (its vocabulary and merges as the
/// `tokenizers` crate holds them).
pub const TOKENIZER_BYTE_COST: u64 = 16;
/// Compute actions per (stage, micro-batch) in the largest case (F, I and W).
const ACTIONS_PER_CELL: u64 = 3;

/// What a job runs: `pipefill train` or `pipefill rl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    Train,
    Rl,
}

/// One part of an estimate: what it is, its bytes, and the field that dominates it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    pub what: &'static str,
    pub bytes: u64,
    /// The config field with the largest factor in the part's largest term.
    pub field: &'static str,
}

/// A job's estimated peak memory, part by part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Largest first.
    pub parts: Vec<Part>,
    pub total: u64,
    /// The field of the largest part: what an over-limit error names when changing it can
    /// bring the job under the limit ([`MemoryEstimate::check`]).
    pub field: &'static str,
}

impl MemoryEstimate {
    /// The estimate of `job` (a validated one) run as `workload` in one process; a
    /// schedule file is read for its peak (a broken one is an error naming `schedule`).
    pub fn of(job: &JobConfig, workload: Workload) -> Result<Self, ConfigError> {
        Self::estimate(job, workload, true)
    }

    /// [`MemoryEstimate::of`] without reading any file (a schedule file's peak is bounded
    /// by GPipe's): what [`JobConfig::validate`] checks, so that every size of a valid job
    /// can be counted.
    pub fn bounded(job: &JobConfig, workload: Workload) -> Result<Self, ConfigError> {
        Self::estimate(job, workload, false)
    }

    fn estimate(
        job: &JobConfig,
        workload: Workload,
        read_files: bool,
    ) -> Result<Self, ConfigError> {
        let (m, t) = (&job.model, &job.train);
        let mut parts: Vec<(&'static str, Size)> = Vec::new();
        let p = params(job)?;
        let per_param = match workload {
            Workload::Train => PARAM_BYTES,
            Workload::Rl => PARAM_BYTES + RL_PARAM_BYTES,
        };
        // Every data-parallel replica holds the model, its moments and its activations
        // (in one process or spread over `dp × stages` processes).
        let dp = f("dp", job.dp.max(1));
        // A sharded optimizer keeps one copy of the moments among all the replicas.
        let live = match crate::config::optimizer::OptimizerConfig::sharded(job) {
            true => add(
                "the parameters",
                &[
                    mul("the parameters", &[p, k(per_param - MOMENT_BYTES), dp])?,
                    mul("the parameters", &[p, k(MOMENT_BYTES)])?,
                ],
            )?,
            false => mul("the parameters", &[p, k(per_param), dp])?,
        };
        parts.push(("parameters, gradients and optimizer state", live));

        let seq = f("model.seq_len", m.seq_len);
        if !job.schedule.is_none() {
            t.recompute
                .check(job.stages)
                .map_err(|reason| ConfigError::Invalid {
                    field: "train.recompute".into(),
                    reason,
                })?;
        }
        let stash = StashModel::of(job);
        let flight = in_flight(
            &job.schedule,
            job.stages,
            (t.micro_batches / job.dp.max(1)).max(1),
            m.layers,
            "train.micro_batches",
            read_files,
            &stash,
        )?;
        let rows = f("train.micro_batch_size", t.micro_batch_size);
        let mut acts = activations(job, &flight, rows, seq)?;
        acts = mul("the activations", &[acts, dp])?;
        if workload == Workload::Rl {
            // The update: `prompts` micro-batches of `group` sequences each; it runs after
            // the warm-up, so the larger of the two counts.
            let r = &job.rl;
            let update = in_flight(
                &job.schedule,
                job.stages,
                r.prompts,
                m.layers,
                "rl.prompts",
                read_files,
                &stash,
            )?;
            let update = activations(job, &update, f("rl.group", r.group), seq)?;
            if update.n > acts.n {
                acts = update;
            }
        }
        parts.push(("activations", acts));

        let steps = match workload {
            Workload::Train => f("train.steps", t.steps),
            Workload::Rl => f("rl.steps", job.rl.steps),
        };
        let step_bytes = add(
            "the per-step records",
            &[
                k(STEP_LINE_BYTES),
                mul(
                    "the per-step records",
                    &[flight.actions, k(ACTION_RECORD_BYTES)],
                )?,
            ],
        )?;
        let records = mul("the per-step records", &[steps, step_bytes])?;
        let plan = mul("the plan", &[flight.actions, k(PLAN_ACTION_BYTES)])?;
        parts.push((
            "plan and per-step records",
            add("the plan", &[plan, records])?,
        ));

        let text = task_text(job)?;
        let summary = mul(
            "the summary's tasks",
            &[
                f("data.summary_tasks", job.data.summary_tasks),
                add("the summary's tasks", &[k(TASK_BYTES), text])?,
            ],
        )?;
        // The held-out tasks fit seq_len: at most seq_len characters of prompt and
        // solution, and the answer.
        let eval = mul(
            "the held-out tasks",
            &[
                f("train.eval_tasks", t.eval_tasks),
                add(
                    "the held-out tasks",
                    &[k(TASK_BYTES), mul("the held-out tasks", &[k(2), seq])?],
                )?,
            ],
        )?;
        // A step's batches: token ids and targets (u32) of every micro-batch.
        let batches = mul(
            "the batches",
            &[f("train.micro_batches", t.micro_batches), rows, seq, k(8)],
        )?;
        let dataset = parts::dataset_bytes(job)?;
        parts.push(("data", add("the data", &[summary, eval, batches, dataset])?));

        let drafter = match workload {
            Workload::Train => job.filler == Filler::Drafter && !job.schedule.is_none(),
            Workload::Rl => job.rl.speculation,
        };
        if drafter {
            // A pipelined run's replicas, one per rank of its first pipeline (in one process:
            // the estimate is a process's); `pipefill rl`'s one trainer and its proposer.
            let (replicas, rl) = match workload {
                Workload::Train => (flight.ranks, false),
                Workload::Rl => (k(1), true),
            };
            parts.push(("drafter", drafter_bytes(job, replicas, rl)?));
        }
        if workload == Workload::Rl {
            parts.push(("rollouts", rollout_bytes(job)?));
        }
        if let Some(file) = job.schedule.file() {
            // Reading it: its size is known before it is read.
            let bytes = std::fs::metadata(file).map_or(0, |m| m.len());
            let read = mul(
                "the schedule file",
                &[f("schedule", bytes), k(SCHEDULE_FILE_BYTE_COST)],
            )?;
            parts.push(("schedule file", read));
        }
        parts.push(("process", k(PROCESS_BYTES)));
        parts.push((
            "ranks",
            mul("the ranks", &[flight.ranks, k(RANK_BYTES), dp])?,
        ));

        let sizes: Vec<Size> = parts.iter().map(|(_, s)| *s).collect();
        let total = add("the job", &sizes)?;
        let mut parts: Vec<Part> = parts
            .into_iter()
            .map(|(what, s)| Part {
                what,
                bytes: s.n,
                field: s.field,
            })
            .collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.bytes));
        // The largest part a field is to blame for (the process itself is no field's).
        let field = parts
            .iter()
            .map(|p| p.field)
            .find(|f| !f.is_empty())
            .unwrap_or("--max-memory");
        Ok(MemoryEstimate {
            field,
            parts,
            total: total.n,
        })
    }

    /// The estimate of one rank's share when the job runs as `processes` processes (the
    /// whole job for 1).
    pub fn share(&self, processes: usize) -> u64 {
        self.total.div_ceil(processes.max(1) as u64)
    }

    /// Checks `bytes` of this estimate (the whole, or a rank's [`share`](Self::share))
    /// against `limit`. Over it, one line: a limit below the costs no setting changes (the
    /// process itself) is too small, and the error names the limit; else the error names
    /// the field that dominates the largest part, with the estimate, its largest parts and
    /// the limit ([`JobConfig::check_memory`] then checks that changing that field can
    /// bring the job under the limit at all).
    pub fn check(&self, bytes: u64, limit: &MemoryLimit) -> Result<(), ConfigError> {
        if bytes <= limit.bytes {
            return Ok(());
        }
        let fixed = self.scaled(
            bytes,
            self.parts
                .iter()
                .filter(|p| p.field.is_empty())
                .map(|p| p.bytes)
                .sum(),
        );
        if fixed > limit.bytes {
            return Err(ConfigError::Invalid {
                field: "--max-memory".into(),
                reason: format!(
                    "{} is too small: any run needs at least {} whatever its settings (the \
                     process itself)",
                    refusal::the_limit(limit),
                    Bytes(fixed)
                ),
            });
        }
        Err(ConfigError::Invalid {
            field: self.field.to_string(),
            reason: format!("{}, over {}", self.needs(bytes), refusal::the_limit(limit)),
        })
    }

    /// `part` bytes of the whole estimate in the proportion `bytes` (the whole or a rank's
    /// share) is of it.
    fn scaled(&self, bytes: u64, part: u64) -> u64 {
        let n = u128::from(part) * u128::from(bytes);
        u64::try_from(n.div_ceil(u128::from(self.total.max(1)))).unwrap_or(u64::MAX)
    }

    /// "the job needs an estimated `bytes` (its three largest parts)".
    fn needs(&self, bytes: u64) -> String {
        let largest: Vec<String> = self
            .parts
            .iter()
            .take(3)
            .map(|p| format!("{} {}", p.what, Bytes(p.bytes)))
            .collect();
        format!(
            "the job needs an estimated {} ({})",
            Bytes(bytes),
            largest.join(", ")
        )
    }
}

impl JobConfig {
    /// [`MemoryEstimate::of`] this job, checked against `limit` for a run of `processes`
    /// processes (each holding its share; 1 for a single-process run).
    pub fn check_memory(
        &self,
        workload: Workload,
        limit: &MemoryLimit,
        processes: usize,
    ) -> Result<MemoryEstimate, ConfigError> {
        // First without reading a schedule file (its size counted, its peak bounded), so
        // that one too large is refused unread; then with its own peak.
        let bounded = MemoryEstimate::bounded(self, workload)?;
        refusal::check(self, &bounded, workload, limit, processes)?;
        if self.schedule.file().is_none() {
            return Ok(bounded);
        }
        let estimate = MemoryEstimate::of(self, workload)?;
        refusal::check(self, &estimate, workload, limit, processes)?;
        Ok(estimate)
    }

    /// The smallest `model.vocab` the job's tokenizer and tasks can use: every token id
    /// the tokenizer produces (its characters and BOS, EOS, PAD).
    pub fn min_vocab() -> usize {
        Tokenizer::new().vocab_size()
    }
}

#[cfg(test)]
mod refusal_tests;
#[cfg(test)]
mod tests;
