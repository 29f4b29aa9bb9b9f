//! The per-element and per-item costs the memory estimate is made of, and its [`Part`]s.

use crate::tensor::DType;

/// Bytes per parameter the ranks hold while they train: the f32 value, its gradient and
/// two AdamW moments.
pub const LIVE_PARAM_BYTES: u64 = 16;
/// Of [`LIVE_PARAM_BYTES`], the two f32 AdamW moments: what a sharded optimizer
/// (`optimizer.shard`, ZeRO-1) divides among the `dp` replicas.
pub const MOMENT_BYTES: u64 = 8;
/// Bytes per parameter of one host copy of the state (value and both moments, 12 bytes in
/// f32, with a third again for what is copied beside it): the drafter's checkpoint copies.
pub const COPY_PARAM_BYTES: u64 = 16;
/// Bytes per parameter and replica a run holds at its end beyond its live state
/// ([`LIVE_PARAM_BYTES`]), while the final checkpoint is made. The reference trainer
/// copies the values (4 bytes; the moments move into the checkpoint, and the model stays
/// for the held-out evaluation): measured 21 bytes a parameter in all at SmolLM-135M's
/// shape. A pipeline's ranks hand over their values and moved moments (12 bytes) and end,
/// and the checkpoint is a copy of what they handed over (12 more): measured 24 bytes a
/// parameter in all (docs/benchmarks.md, "Memory estimate calibration").
pub const fn final_copy_bytes(pipelined: bool) -> u64 {
    if pipelined { 8 } else { 6 }
}
/// `[vocab, d_model]` f32 tables beyond the live state that a tied pair's gradient sum
/// (`model::tie`) holds. The copies share a layout, so the gradients move out and back and
/// the reference trainer sums them in place: none. A pipeline's first and last ranks sum
/// theirs by a ring all-reduce of encoded frames (`comm::collective`), each rank sending and
/// receiving half a table in each of its two phases; 3 is calibrated, not derived: it puts
/// the estimate 0.5% under the 2-stage peak at Qwen2.5-0.5B's shape (a table is 545 MB).
/// Until session 47 a host table reused from step to step (`TieScratch`) took the head's
/// transpose, one more each (docs/benchmarks.md, "The head in the embedding's layout").
pub const fn tie_table_copies(pipelined: bool) -> u64 {
    if pipelined { 3 } else { 0 }
}

/// Bytes per parameter a run's periodic checkpoints hold while the ranks train
/// (`checkpoint_every > 0`): the ranks' deposited state (value and both moments, 12 bytes)
/// twice, the checkpoint being written and the next one's deposits waiting for it (one
/// writer at a time, `crate::pipeline::shared`; the files are streamed from those tensors,
/// with no serialized copy). It coexists with the live state and the activations.
pub const CHECKPOINT_PARAM_BYTES: u64 = 24;

/// Bytes per parameter `train.precision` adds to a replica's live state
/// ([`LIVE_PARAM_BYTES`] is f32's): in bf16 the value the layers compute with takes 2 bytes
/// instead of 4, and the f32 master weights 4 more (with the moments, what a sharded
/// optimizer divides: [`sharded_bytes`]). Gradients stay f32 in either (accumulated over
/// micro-batches and all-reduced).
pub const fn live_precision_bytes(precision: DType) -> u64 {
    match precision {
        DType::F32 => 0,
        DType::Bf16 => MASTER_BYTES - (4 - 2),
    }
}

/// Bytes per parameter `train.precision` adds to the host copies at the end of a run: in
/// bf16 the master beside the value and the moments.
pub const fn copy_precision_bytes(precision: DType) -> u64 {
    match precision {
        DType::F32 => 0,
        DType::Bf16 => MASTER_BYTES,
    }
}

/// Bytes per parameter of the f32 master weights of a bf16 run.
pub const MASTER_BYTES: u64 = 4;

/// Bytes per parameter a sharded optimizer (ZeRO-1) divides among the replicas: the
/// moments, and in bf16 the master weights.
pub const fn sharded_bytes(precision: DType) -> u64 {
    match precision {
        DType::F32 => MOMENT_BYTES,
        DType::Bf16 => MOMENT_BYTES + MASTER_BYTES,
    }
}

/// Bytes of one element of what a forward stashes (the activations): the storage type's.
/// Gradients of the activations (what I leaves for W, what goes back between stages) and
/// the working sets stay [`ELEMENT`] (f32): the CPU backend widens bf16 to f32 to compute.
pub(super) const fn stash_element(precision: DType) -> u64 {
    precision.size() as u64
}

/// Extra bytes per parameter in `pipefill rl`: the rollout engine's copy of the policy's
/// weights and the frozen reference policy.
pub const RL_PARAM_BYTES: u64 = 16;
/// Bytes of a step's records in memory: its training line and its RL line
/// (`crate::train::StepMetrics` and `crate::rl::RlStepMetrics`; their sizes are checked
/// against this where those types live).
pub const STEP_LINE_BYTES: u64 = 1024;
/// Bytes of one activation element (f32 storage).
pub(super) const ELEMENT: u64 = 4;
/// A drafter slice's activation elements per position, in units of `d_model` and of the
/// MLP's hidden width (with 8 and 2 more of each for its input projection and unrolled
/// positions, [`super::parts`]'s `drafter_bytes`): an allowance over what its block keeps.
/// The target's blocks are counted element by element (`Recompute::block_stash`).
pub(super) const STASH_PER_D: u64 = 16;
pub(super) const STASH_PER_HIDDEN: u64 = 5;
/// Bytes of the process itself (binary, runtime, allocator slack) and per pipeline rank
/// (its thread, channels and buffers): a one-stage run of a tiny model peaks at 11.6 MiB
/// (docs/benchmarks.md, "Memory estimate calibration").
pub(super) const PROCESS_BYTES: u64 = 12 << 20;
pub(super) const RANK_BYTES: u64 = 1 << 20;
/// Bytes MKL adds where it computes the products (`tensor/cpu/blas.rs`): its code and
/// tables, and per rank the state of a thread that calls it (with its OpenMP team). The
/// default job's peak rose by 10.0 MiB on one stage and 18.4 MiB on four (docs/benchmarks.md,
/// "MKL's products").
pub(super) const MKL_PROCESS_BYTES: u64 = 8 << 20;
pub(super) const MKL_RANK_BYTES: u64 = 3 << 20;
/// Bytes of one generated task besides its text (its strings' headers, family, size).
pub(super) const TASK_BYTES: u64 = 256;
/// Bytes a run keeps per rank and step for the filler work in its bubbles: every slice's
/// span (its label, times and cost), kept for the run's trace. Measured on the default job
/// (about 22 drafter slices a rank and step): from 100 to 400 steps its peak RSS grows by
/// 17.8 KiB a rank and step with the drafter, 3.6 KiB without (docs/benchmarks.md,
/// "Memory estimate calibration").
pub const FILL_RECORD_BYTES: u64 = 14 << 10;
/// Bytes a run keeps per action and step: the runtime's measured span and action record.
pub(super) const ACTION_RECORD_BYTES: u64 = 256;
/// Bytes per action of a plan: the action (24) in the plan, its lowered copy with the
/// SEND/RECV pairs, the validator's and simulator's per-(stage, micro-batch) tables and
/// the timeline's span.
pub const PLAN_ACTION_BYTES: u64 = 256;
/// Plans of at most this many actions are generated to read their peak activation memory;
/// larger ones are bounded by GPipe's (every micro-batch in flight).
pub(super) const MAX_PEAK_ACTIONS: u64 = 1 << 16;
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
pub(super) const ACTIONS_PER_CELL: u64 = 3;

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

/// Bytes per parameter of a data-parallel replica's gradient exchange, beside its live
/// state: the rank's gradients flat on the host and the ring's frames (the sharded
/// optimizer's reduce-scatter is the same first half; its all-gather then holds one
/// parameter's frames at a time). Measured at Qwen2.5-0.5B's shape, dp = 2 × 2 stages in
/// one process (docs/benchmarks.md, "Sharded optimizer").
pub const EXCHANGE_BYTES: u64 = 6;
