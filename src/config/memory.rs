//! The memory a job needs, estimated from its sizes before anything is allocated.
//!
//! [`MemoryEstimate::of`] adds up what a run holds at its peak: the parameters with their
//! gradients, AdamW moments and the copies a checkpoint makes; the activations of the
//! micro-batches in flight at the schedule's peak (what the plan's ranks stash together at
//! its simulated peak, for a built-in schedule and a schedule file alike); one working set
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
//! The constants are calibrated on the CPU backend against the peak RSS of
//! `pipefill train --steps 1`, in f32 and in bf16 (`train.precision`: the stash at 2 bytes
//! an element, the f32 master weights beside the parameters; see the tests of
//! `tests/memory_cli.rs`) and of real shapes, so that the estimate is within ±15% of it;
//! the peaks are in docs/benchmarks.md, "Memory estimate calibration" and "Mixed
//! precision".

mod costs;
mod flight;
mod limit;
mod parts;
mod refusal;
mod size;

pub use costs::*;
use flight::*;
pub use limit::{LimitSource, MemoryLimit};
use parts::*;
pub use size::Bytes;
use size::{Size, add, f, k, mul};

use super::{ConfigError, Filler, JobConfig};
use crate::data::Tokenizer;

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
        let live_param = LIVE_PARAM_BYTES + live_precision_bytes(t.precision);
        let pipelined = !job.schedule.is_none();
        // Held once whatever `dp` is: in `pipefill rl` the rollout engine's copy of the
        // policy and the reference policy. (Periodic checkpoints' buffers and the final
        // checkpoint's copies are weighed against the activations below.)
        let held = match workload {
            Workload::Train => 0,
            Workload::Rl => RL_PARAM_BYTES,
        };
        let periodic = match job.checkpoint_every {
            0 => 0,
            _ => CHECKPOINT_PARAM_BYTES,
        };
        let copy = final_copy_bytes(pipelined) + copy_precision_bytes(t.precision);
        let sharded = sharded_bytes(t.precision);
        // Every data-parallel replica holds the model, its gradients and moments and its
        // activations (in one process or spread over `dp × stages` processes).
        let dp = f("dp", job.dp.max(1));
        // A sharded optimizer keeps one copy of the moments (and master weights) among all
        // the replicas.
        let replicas = match crate::config::optimizer::OptimizerConfig::sharded(job) {
            true => add(
                "the parameters",
                &[
                    mul("the parameters", &[p, k(live_param - sharded), dp])?,
                    mul("the parameters", &[p, k(sharded)])?,
                ],
            )?,
            false => mul("the parameters", &[p, k(live_param), dp])?,
        };
        let live = add(
            "the parameters",
            &[replicas, mul("the parameters", &[p, k(held)])?],
        )?;
        parts.push(("parameters, gradients and optimizer state", live));

        let seq = f("model.seq_len", m.seq_len);
        if pipelined {
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
        if m.tie_embeddings {
            // A pipeline's first and last ranks exchange a tied pair's gradients.
            let tie = mul(
                "the activations",
                &[
                    k(tie_table_copies(pipelined)),
                    f("model.vocab", m.vocab),
                    f("model.d_model", m.d_model),
                    k(ELEMENT),
                    dp,
                ],
            )?;
            acts = add("the activations", &[acts, tie])?;
        }
        if job.dp > 1 {
            // The replicas' gradient exchange goes through host copies of each rank's
            // gradients ([`EXCHANGE_BYTES`]).
            let exchange = mul("the parameters", &[p, k(EXCHANGE_BYTES), dp])?;
            acts = add("the activations", &[acts, exchange])?;
        }
        // The step's peak (activations, periodic checkpoints' buffers) and the end's (the
        // final checkpoint's copies) do not coexist.
        let buffers = mul("the parameters", &[p, k(periodic)])?;
        let copies = mul("the parameters", &[p, k(copy), dp])?;
        if copies.n > acts.n.saturating_add(buffers.n) {
            parts.push(("the final checkpoint's copies", copies));
        } else {
            parts.push(("activations", acts));
            if buffers.n > 0 {
                parts.push(("checkpoint buffers", buffers));
            }
        }

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
        // Filler work in a pipeline's bubbles: each slice's span, kept for the trace.
        let fill_bytes = match job.filler == Filler::None || !pipelined {
            true => k(0),
            false => mul(
                "the per-step records",
                &[flight.ranks, k(FILL_RECORD_BYTES), dp],
            )?,
        };
        let step_bytes = add("the per-step records", &[step_bytes, fill_bytes])?;
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
            Workload::Train => job.filler == Filler::Drafter && pipelined,
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
        if crate::tensor::cpu::uses_mkl() {
            let per_rank = mul("the ranks", &[flight.ranks, k(MKL_RANK_BYTES), dp])?;
            let mkl = add("MKL", &[k(MKL_PROCESS_BYTES), per_rank])?;
            parts.push(("MKL", mkl));
        }

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
