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
//! is one line naming the field that dominates the largest part, the estimate and its
//! largest parts, and the limit.
//!
//! The constants are calibrated on the CPU backend (f32 storage), measured as peak RSS of
//! `pipefill train --steps 1` (see the tests of `tests/memory_cli.rs`): d_model 512 (25 M
//! parameters) peaked at 1.31 GB under the reference trainer and 1.64 GB pipelined
//! (≈ 52 and 65 bytes per parameter, activations and the drafter included), seq_len 1024
//! at d_model 64 at 0.71 GB and 2.02 GB (the attention probabilities, 4 heads × 1024² per
//! sequence and layer, dominate), the default job at 94 MB.

use std::fmt;

use super::{ConfigError, Filler, JobConfig};
use crate::data::Tokenizer;
use crate::schedules::{CostModel, ScheduleKind, generate, peak_memory};

/// Bytes per parameter: the f32 value, its gradient and two AdamW moments (16), and the
/// copies of values and moments that initialisation and the checkpoints make.
pub const PARAM_BYTES: u64 = 64;
/// Extra bytes per parameter in `pipefill rl`: the rollout engine's copy of the policy's
/// weights and the frozen reference policy.
pub const RL_PARAM_BYTES: u64 = 16;
/// Bytes of one activation element (f32 storage).
const ELEMENT: u64 = 4;
/// Activation elements per token and layer that a forward stashes, in units of `d_model`
/// (layer input, q, k, v, attention output, norms, residuals, the MLP's input, and what I
/// leaves for W) and of the MLP's hidden width (pre-activation, activation, gate, up and
/// their product): over what the layers keep, so that the estimate stays above the
/// measured peaks (interleaved-1f1b and SwiGLU came within 5% of 12 and 3).
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
    /// The field of the largest part: what an over-limit error names.
    pub field: &'static str,
}

/// Where a memory limit comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitSource {
    /// `--max-memory`.
    Flag,
    /// `MemAvailable` of `/proc/meminfo`.
    Available,
    /// `MemTotal` of `/proc/meminfo` (a kernel without `MemAvailable`).
    Total,
    /// Nothing to read it from: no limit.
    Unknown,
}

/// The memory a job may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryLimit {
    pub bytes: u64,
    pub source: LimitSource,
}

/// A size under construction: its value and the field blamed for it (with that field's
/// own value), so an overflow or an over-limit total names the field.
#[derive(Clone, Copy, Debug)]
struct Size {
    n: u64,
    /// `""` for a constant.
    field: &'static str,
    /// The blamed field's own value (for the overflow message).
    value: u64,
}

/// A config field's value as a factor.
fn f(field: &'static str, value: impl TryInto<u64>) -> Size {
    let value = value.try_into().unwrap_or(u64::MAX);
    Size {
        n: value,
        field,
        value,
    }
}

/// A constant factor (never blamed).
fn k(n: u64) -> Size {
    Size {
        n,
        field: "",
        value: n,
    }
}

fn overflow(what: &str, blamed: Size) -> ConfigError {
    ConfigError::Invalid {
        field: blamed.field.to_string(),
        reason: format!(
            "{} is too large: the memory estimate of {what} passes {} (it overflows 64-bit \
             arithmetic)",
            blamed.value,
            Bytes(u64::MAX)
        ),
    }
}

/// The product of `xs`; it is blamed on its largest named factor.
fn mul(what: &str, xs: &[Size]) -> Result<Size, ConfigError> {
    let blamed = xs
        .iter()
        .filter(|x| !x.field.is_empty())
        .max_by_key(|x| x.n)
        .copied()
        .unwrap_or(k(0));
    let n = xs
        .iter()
        .try_fold(1u64, |acc, x| acc.checked_mul(x.n))
        .ok_or_else(|| overflow(what, blamed))?;
    Ok(Size { n, ..blamed })
}

/// The sum of `xs`; it is blamed on its largest named term.
fn add(what: &str, xs: &[Size]) -> Result<Size, ConfigError> {
    let blamed = xs
        .iter()
        .filter(|x| !x.field.is_empty())
        .max_by_key(|x| x.n)
        .copied()
        .unwrap_or(k(0));
    let n = xs
        .iter()
        .try_fold(0u64, |acc, x| acc.checked_add(x.n))
        .ok_or_else(|| overflow(what, blamed))?;
    Ok(Size { n, ..blamed })
}

/// `ceil(a / b)` for `b ≥ 1`.
fn div_ceil(a: Size, b: u64) -> Size {
    Size {
        n: a.n.div_ceil(b.max(1)),
        ..a
    }
}

/// Micro-batches in flight at a schedule's peak, in units of one micro-batch's stash on
/// one stage (summed over the ranks), and on the rank that holds the head.
struct InFlight {
    /// Σ over ranks of each rank's peak stash count.
    units: Size,
    /// The head's rank's peak.
    head_units: Size,
    /// Model blocks per stage (chunk).
    layers_per_stage: Size,
    /// Pipeline ranks (1 for the reference trainer).
    ranks: Size,
    /// Compute actions per step.
    actions: Size,
}

/// The peak of `schedule` over `ranks` ranks and `microbatches` micro-batches of a model of
/// `layers` blocks. A schedule file is read for its peak when `read_files` (a broken one is
/// an error naming `schedule`), else bounded by GPipe's.
fn in_flight(
    schedule: &str,
    ranks: usize,
    microbatches: usize,
    layers: usize,
    microbatches_field: &'static str,
    read_files: bool,
) -> Result<InFlight, ConfigError> {
    let m = f(microbatches_field, microbatches);
    let layers = f("model.layers", layers);
    let name = schedule.trim();
    if name.eq_ignore_ascii_case("none") {
        // The reference trainer: one micro-batch at a time through the whole model.
        return Ok(InFlight {
            units: k(1),
            head_units: k(1),
            layers_per_stage: layers,
            ranks: k(1),
            actions: mul("the plan", &[m, k(2)])?,
        });
    }
    let p = f("stages", ranks);
    let kind = match name.parse::<ScheduleKind>() {
        Ok(kind) => Some(kind),
        Err(_) if name.eq_ignore_ascii_case("auto") => Some(ScheduleKind::ZbH1),
        Err(_) => None,
    };
    let chunks = kind.map_or(1, |k| k.default_chunks());
    let v = f("stages", chunks);
    let per_cell = kind.map_or(ACTIONS_PER_CELL, |k| k.actions_per_cell());
    let actions = mul("the plan", &[p, v, m, k(per_cell)])?;
    // GPipe's bound: every micro-batch stashed on every stage (a schedule file's stage
    // count is only known once it is read, so it is bounded by one block per stage).
    let gpipe = InFlight {
        units: mul("the activations", &[m, p, v])?,
        head_units: m,
        layers_per_stage: div_ceil(layers, (ranks as u64).saturating_mul(chunks as u64)),
        ranks: p,
        actions,
    };
    let Some(kind) = kind else {
        let bound = InFlight {
            units: m,
            layers_per_stage: layers,
            ..gpipe
        };
        return match read_files {
            true => file_peak(name, layers, bound),
            false => Ok(bound),
        };
    };
    if actions.n > MAX_PEAK_ACTIONS {
        return Ok(gpipe);
    }
    let Ok(plan) = generate(kind, ranks, microbatches, chunks) else {
        // The trainer reports why the schedule cannot be built.
        return Ok(gpipe);
    };
    Ok(plan_peak(&plan, layers, gpipe))
}

/// `bound` with the units and blocks per stage of `plan`'s own peak.
fn plan_peak(plan: &crate::schedules::Plan, layers: Size, bound: InFlight) -> InFlight {
    let peaks = peak_memory(plan, &CostModel::default());
    let ceil = |x: f64| x.ceil().max(0.0) as u64;
    let units = ceil(peaks.iter().sum());
    let head_rank = plan.stage_rank.last().copied().unwrap_or(0);
    let head = ceil(peaks.get(head_rank).copied().unwrap_or(0.0));
    InFlight {
        units: Size {
            n: units,
            ..bound.units
        },
        head_units: Size {
            n: head,
            ..bound.head_units
        },
        layers_per_stage: div_ceil(layers, plan.stages as u64),
        ..bound
    }
}

/// The schedule file `schedule` names (a `.csv` or `.toml` path), if it does.
fn schedule_file(schedule: &str) -> Option<&std::path::Path> {
    let path = std::path::Path::new(schedule.trim());
    let ext = path.extension()?.to_str()?.to_ascii_lowercase();
    matches!(ext.as_str(), "csv" | "toml").then_some(path)
}

/// The peak of the schedule file `name`, read and validated; `bound` for a name that is not
/// a file's (the trainer says what it is not). A file that cannot be read or used is an
/// error naming `schedule`, its reason on one line.
fn file_peak(name: &str, layers: Size, bound: InFlight) -> Result<InFlight, ConfigError> {
    let Some(path) = schedule_file(name) else {
        return Ok(bound);
    };
    let invalid = |e: crate::schedules::ScheduleError| ConfigError::Invalid {
        field: "schedule".into(),
        reason: e
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
    };
    let plan = crate::schedules::read_plan(path).map_err(invalid)?;
    crate::schedules::validate(&plan, &Default::default()).map_err(invalid)?;
    Ok(plan_peak(&plan, layers, bound))
}

/// Bytes of the activations of micro-batches of `rows` sequences of `seq` tokens held at
/// `flight`'s peak, plus one working set per rank (a layer's backward: the attention
/// probabilities' gradient, the logits and their gradient).
fn activations(
    job: &JobConfig,
    flight: &InFlight,
    rows: Size,
    seq: Size,
) -> Result<Size, ConfigError> {
    let m = &job.model;
    let (d, h, vocab) = (
        f("model.d_model", m.d_model),
        f("model.heads", m.heads),
        f("model.vocab", m.vocab),
    );
    let hidden = hidden(job)?;
    let what = "the activations";
    // Per token and layer: the stash, and the attention probabilities (heads × seq).
    let per_token = add(
        what,
        &[
            mul(what, &[k(STASH_PER_D), d])?,
            mul(what, &[k(STASH_PER_HIDDEN), hidden])?,
            mul(what, &[h, seq])?,
        ],
    )?;
    let tokens = mul(what, &[rows, seq])?;
    let stash = mul(
        what,
        &[
            flight.units,
            flight.layers_per_stage,
            tokens,
            per_token,
            k(ELEMENT),
        ],
    )?;
    // The head's stash: the logits' softmax per micro-batch in flight on its rank.
    let head = mul(what, &[flight.head_units, tokens, vocab, k(ELEMENT)])?;
    let working_per_token = add(
        what,
        &[
            mul(what, &[k(2), h, seq])?,
            mul(what, &[k(3), vocab])?,
            mul(what, &[k(12), d])?,
            mul(what, &[k(4), hidden])?,
        ],
    )?;
    let working = mul(what, &[flight.ranks, tokens, working_per_token, k(ELEMENT)])?;
    add(what, &[stash, head, working])
}

/// The MLP's hidden width, checked (`mlp_ratio × d_model` unless `intermediate` is given).
fn hidden(job: &JobConfig) -> Result<Size, ConfigError> {
    let m = &job.model;
    if let Some(width) = m.intermediate {
        return Ok(f("model.intermediate", width));
    }
    let hidden = mul(
        "the MLP",
        &[
            f("model.mlp_ratio", m.mlp_ratio),
            f("model.d_model", m.d_model),
        ],
    )?;
    usize::try_from(hidden.n).map_err(|_| overflow("the MLP", hidden))?;
    Ok(hidden)
}

/// An upper bound of the model's parameter count, checked: key/value projections as wide
/// as `d_model`, three MLP matrices, biases, learned positions. Every term of
/// [`crate::model::GptConfig::param_count`] is at most its term here, so a bound that fits
/// means the exact count cannot overflow.
fn param_bound(job: &JobConfig) -> Result<Size, ConfigError> {
    let m = &job.model;
    let what = "the parameters";
    let (vocab, d, seq, layers) = (
        f("model.vocab", m.vocab),
        f("model.d_model", m.d_model),
        f("model.seq_len", m.seq_len),
        f("model.layers", m.layers),
    );
    let hidden = hidden(job)?;
    let block = add(
        what,
        &[
            mul(what, &[k(4), d, d])?,
            mul(what, &[k(3), d, hidden])?,
            mul(what, &[k(5), d])?,
        ],
    )?;
    add(
        what,
        &[
            mul(what, &[k(2), vocab, d])?,
            mul(what, &[seq, d])?,
            mul(what, &[layers, block])?,
            d,
        ],
    )
}

/// The exact parameter count, once [`param_bound`] has shown it cannot overflow.
fn params(job: &JobConfig) -> Result<Size, ConfigError> {
    let bound = param_bound(job)?;
    Ok(Size {
        n: job
            .model
            .checked_param_count()
            .map_or(bound.n, |n| (n as u64).min(bound.n)),
        ..bound
    })
}

/// Expected text bytes of one task: the sizes follow `P(size > k) = s / (s + k)` up to
/// `max_size` (`E[size] ≈ s·ln(1 + M/s)`, `E[size²] ≤ 2·s·M`), and a sorting task's
/// worked solution rewrites what is left of its list (≈ 1.5·size² characters).
fn task_text(job: &JobConfig) -> Result<Size, ConfigError> {
    let (s, max) = (job.data.size_scale, f64::from(job.data.max_size));
    // A size never exceeds max_size, which bounds both moments too.
    let mean = (s * (1.0 + max / s).ln()).min(max) + 1.0;
    let square = (2.0 * s * max).min(max * max) + 1.0;
    let text = 8.0 * mean + 2.0 * square + 64.0;
    if !(text.is_finite() && text < u64::MAX as f64) {
        let field = if s > max {
            "data.size_scale"
        } else {
            "data.max_size"
        };
        return Err(ConfigError::Invalid {
            field: field.into(),
            reason: "is too large: the memory estimate of the tasks overflows".into(),
        });
    }
    Ok(Size {
        n: text.ceil() as u64,
        field: "data.max_size",
        value: u64::from(job.data.max_size),
    })
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
        parts.push((
            "parameters, gradients and optimizer state",
            mul("the parameters", &[p, k(per_param)])?,
        ));

        let seq = f("model.seq_len", m.seq_len);
        let flight = in_flight(
            &job.schedule,
            job.stages,
            t.micro_batches,
            m.layers,
            "train.micro_batches",
            read_files,
        )?;
        let rows = f("train.micro_batch_size", t.micro_batch_size);
        let mut acts = activations(job, &flight, rows, seq)?;
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
                k(std::mem::size_of::<crate::train::StepMetrics>() as u64),
                k(std::mem::size_of::<crate::rl::trainer::RlStepMetrics>() as u64),
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
        parts.push(("data", add("the data", &[summary, eval, batches])?));

        let drafter = match workload {
            Workload::Train => job.filler == Filler::Drafter && !is_none(&job.schedule),
            Workload::Rl => job.rl.speculation,
        };
        if drafter {
            parts.push(("drafter", drafter_bytes(job)?));
        }
        if workload == Workload::Rl {
            parts.push(("rollouts", rollout_bytes(job)?));
        }
        if let Some(file) = schedule_file(&job.schedule) {
            // Reading it: its size is known before it is read.
            let bytes = std::fs::metadata(file).map_or(0, |m| m.len());
            let read = mul(
                "the schedule file",
                &[f("schedule", bytes), k(SCHEDULE_FILE_BYTE_COST)],
            )?;
            parts.push(("schedule file", read));
        }
        parts.push(("process", k(PROCESS_BYTES)));
        parts.push(("ranks", mul("the ranks", &[flight.ranks, k(RANK_BYTES)])?));

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
    /// against `limit`; over it, one line naming the dominant field, the estimate, its
    /// largest parts and the limit.
    pub fn check(&self, bytes: u64, limit: &MemoryLimit) -> Result<(), ConfigError> {
        if bytes <= limit.bytes {
            return Ok(());
        }
        let largest: Vec<String> = self
            .parts
            .iter()
            .take(3)
            .map(|p| format!("{} {}", p.what, Bytes(p.bytes)))
            .collect();
        Err(ConfigError::Invalid {
            field: self.field.to_string(),
            reason: format!(
                "the job needs an estimated {} ({}), over the memory limit of {} ({})",
                Bytes(bytes),
                largest.join(", "),
                Bytes(limit.bytes),
                limit.source
            ),
        })
    }
}

fn is_none(schedule: &str) -> bool {
    schedule.trim().eq_ignore_ascii_case("none")
}

/// The drafter: its block (as wide as the target's), input projection, frozen copies of
/// the embedding and head, with gradients and moments; its buffer of two steps' rows
/// (hidden states and next-token distributions); one slice's activations.
fn drafter_bytes(job: &JobConfig) -> Result<Size, ConfigError> {
    let (m, dr) = (&job.model, &job.drafter);
    let what = "the drafter";
    let (d, vocab, seq, h) = (
        f("model.d_model", m.d_model),
        f("model.vocab", m.vocab),
        f("model.seq_len", m.seq_len),
        f("model.heads", m.heads),
    );
    let hidden = hidden(job)?;
    let trained = add(
        what,
        &[
            mul(what, &[k(6), d, d])?,
            mul(what, &[k(3), d, hidden])?,
            mul(what, &[k(8), d])?,
        ],
    )?;
    let weights = add(
        what,
        &[
            mul(what, &[trained, k(PARAM_BYTES)])?,
            mul(what, &[k(2 * ELEMENT), vocab, d])?,
        ],
    )?;
    let row = add(what, &[d, vocab, k(1)])?;
    let buffer = mul(
        what,
        &[
            k(2),
            f("drafter.buffer_rows", dr.buffer_rows),
            seq,
            row,
            k(ELEMENT),
        ],
    )?;
    let positions = f("drafter.max_positions", dr.max_positions);
    let per_token = add(
        what,
        &[
            mul(what, &[k(STASH_PER_D + 8), d])?,
            mul(what, &[k(STASH_PER_HIDDEN + 2), hidden])?,
            mul(what, &[k(2), h, positions])?,
            mul(what, &[k(4), vocab])?,
        ],
    )?;
    let slice = mul(
        what,
        &[
            f("drafter.batch_rows", dr.batch_rows),
            positions,
            f("drafter.unroll", dr.unroll),
            per_token,
            k(ELEMENT),
        ],
    )?;
    add(what, &[weights, buffer, slice])
}

/// `pipefill rl`'s rollouts: every sequence's KV cache through every block, its final
/// hidden states and next-token distributions (the drafter's rows), and one decode step's
/// logits for the verified drafts (a tree's nodes, or the chain of `draft_k`).
fn rollout_bytes(job: &JobConfig) -> Result<Size, ConfigError> {
    let (m, r) = (&job.model, &job.rl);
    let what = "the rollouts";
    let sequences = mul(what, &[f("rl.prompts", r.prompts), f("rl.group", r.group)])?;
    let (d, vocab, seq) = (
        f("model.d_model", m.d_model),
        f("model.vocab", m.vocab),
        f("model.seq_len", m.seq_len),
    );
    let kv = mul(
        what,
        &[
            sequences,
            f("model.layers", m.layers),
            k(2),
            d,
            seq,
            k(ELEMENT),
        ],
    )?;
    let row = add(what, &[d, vocab, k(2)])?;
    let rows = mul(what, &[sequences, seq, row, k(ELEMENT)])?;
    let drafts = match r.draft_tree {
        Some(tree) => f("rl.draft_tree.nodes", tree.nodes),
        None => add(what, &[f("rl.draft_k", r.draft_k), k(1)])?,
    };
    let logits = mul(what, &[sequences, drafts, vocab, k(2 * ELEMENT)])?;
    let prompts = mul(what, &[sequences, add(what, &[k(TASK_BYTES), seq])?])?;
    add(what, &[kv, rows, logits, prompts])
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
        bounded.check(bounded.share(processes), limit)?;
        if schedule_file(&self.schedule).is_none() {
            return Ok(bounded);
        }
        let estimate = MemoryEstimate::of(self, workload)?;
        estimate.check(estimate.share(processes), limit)?;
        Ok(estimate)
    }

    /// The smallest `model.vocab` the job's tokenizer and tasks can use: every token id
    /// the tokenizer produces (its characters and BOS, EOS, PAD).
    pub fn min_vocab() -> usize {
        Tokenizer::new().vocab_size()
    }
}

impl MemoryLimit {
    /// No limit.
    pub const UNLIMITED: MemoryLimit = MemoryLimit {
        bytes: u64::MAX,
        source: LimitSource::Unknown,
    };

    /// `--max-memory`'s value when given, else the machine's available memory.
    pub fn resolve(flag: Option<&str>) -> Result<Self, ConfigError> {
        match flag {
            Some(text) => Self::parse(text),
            None => Ok(Self::machine()),
        }
    }

    /// The machine's available memory (`MemAvailable`, else `MemTotal`, of
    /// `/proc/meminfo`); unlimited where it cannot be read.
    pub fn machine() -> Self {
        std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|text| Self::from_meminfo(&text))
            .unwrap_or(Self::UNLIMITED)
    }

    /// The limit `/proc/meminfo`'s text gives.
    pub fn from_meminfo(text: &str) -> Option<Self> {
        let field = |name: &str| {
            text.lines().find_map(|line| {
                let rest = line.strip_prefix(name)?.strip_prefix(':')?.trim();
                let kib: u64 = rest
                    .strip_suffix("kB")
                    .unwrap_or(rest)
                    .trim()
                    .parse()
                    .ok()?;
                kib.checked_mul(1024)
            })
        };
        field("MemAvailable")
            .map(|bytes| MemoryLimit {
                bytes,
                source: LimitSource::Available,
            })
            .or_else(|| {
                field("MemTotal").map(|bytes| MemoryLimit {
                    bytes,
                    source: LimitSource::Total,
                })
            })
    }

    /// Parses `--max-memory`: a number of bytes with an optional unit, `8GiB`, `512MiB`,
    /// `1.5G` (K, M, G, T and KiB … TiB are powers of 1024; kB, MB, GB, TB of 1000).
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let bad = |why: &str| ConfigError::Invalid {
            field: "--max-memory".into(),
            reason: format!("{text:?} {why}"),
        };
        let t = text.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (number, unit) = (&t[..split], t[split..].trim());
        let scale: f64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kib" => 1024.0,
            "m" | "mib" => 1024f64.powi(2),
            "g" | "gib" => 1024f64.powi(3),
            "t" | "tib" => 1024f64.powi(4),
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "tb" => 1e12,
            _ => {
                return Err(bad(
                    "is not a size: expected a number with an optional unit, e.g. 8GiB, 512MiB, 2000000000",
                ));
            }
        };
        let value: f64 = number.parse().map_err(|_| {
            bad("is not a size: expected a number with an optional unit, e.g. 8GiB, 512MiB, 2000000000")
        })?;
        let bytes = value * scale;
        if !(bytes.is_finite() && bytes >= 1.0) {
            return Err(bad("must be at least 1 byte"));
        }
        if bytes >= u64::MAX as f64 {
            return Err(bad("is larger than 2^64 bytes"));
        }
        Ok(MemoryLimit {
            bytes: bytes as u64,
            source: LimitSource::Flag,
        })
    }
}

impl fmt::Display for LimitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LimitSource::Flag => "--max-memory",
            LimitSource::Available => "the memory available, MemAvailable in /proc/meminfo; --max-memory sets another limit",
            LimitSource::Total => "the machine's memory, MemTotal in /proc/meminfo; --max-memory sets another limit",
            LimitSource::Unknown => "no limit known",
        })
    }
}

impl fmt::Display for MemoryLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.source {
            LimitSource::Unknown => f.write_str("no limit known"),
            LimitSource::Flag => write!(f, "{} (--max-memory)", Bytes(self.bytes)),
            LimitSource::Available => write!(f, "{} available", Bytes(self.bytes)),
            LimitSource::Total => write!(f, "{} of memory", Bytes(self.bytes)),
        }
    }
}

/// A byte count in binary units: `512 B`, `1.5 KiB`, `14.9 GiB`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
        let mut value = self.0 as f64;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < UNITS.len() {
            value /= 1024.0;
            unit += 1;
        }
        match unit {
            0 => write!(f, "{} B", self.0),
            _ => write!(f, "{value:.1} {}", UNITS[unit]),
        }
    }
}

#[cfg(test)]
mod tests;
