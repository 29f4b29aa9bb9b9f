//! The estimate's parts, one function each: the activations in flight at the schedule's
//! peak (their count per rank: [`super::flight`]), the parameters, the tasks' text, the
//! drafter and the rollouts.

use super::super::{ConfigError, JobConfig};
use super::costs::*;
use super::flight::{InFlight, MILLI};
use super::size::{Size, add, div_ceil, f, k, mul, overflow};
use crate::model::layers::chunk_rows;

/// Bytes of the activations of micro-batches of `rows` sequences of `seq` tokens held at
/// `flight`'s peak, plus one working set per rank (a layer's backward: the attention
/// probabilities' gradient) and the fused head's (one chunk of logits).
pub(super) fn activations(
    job: &JobConfig,
    flight: &InFlight,
    rows: Size,
    seq: Size,
) -> Result<Size, ConfigError> {
    let Dims {
        d, heads: h, vocab, ..
    } = dims(job);
    let hidden = hidden(job)?;
    let what = "the activations";
    // Per token and layer: what a block's forward keeps for its I, element by element as
    // the layers keep it (the attention probabilities, heads × seq, among them), blamed on
    // the largest of the sizes it is made of.
    let exact = crate::model::Recompute::None
        .block_stash(&job.model, job.model.seq_len)
        .forward;
    let largest = [d, hidden, mul(what, &[h, seq])?]
        .into_iter()
        .max_by_key(|s| s.n)
        .unwrap_or(d);
    let per_token = Size {
        n: exact,
        ..largest
    };
    let tokens = mul(what, &[rows, seq])?;
    let element = k(stash_element(job.train.precision));
    let stash = |units: Size| {
        let factors = [units, flight.layers_per_stage, tokens, per_token, element];
        mul(what, &factors)
    };
    // Counted in thousandths, blamed as in whole stashes (a thousandths count would be
    // the largest factor, and a field's share of the product is what a refusal names).
    let whole = Size {
        n: flight.units.n.div_ceil(MILLI),
        ..flight.units
    };
    let stash = Size {
        n: div_ceil(stash(flight.units)?, MILLI).n,
        ..stash(whole)?
    };
    // A recomputing rank's I: one block's recomputed part.
    let recomputed = mul(what, &[flight.transient, tokens, per_token, element])?;
    let recomputed = div_ceil(recomputed, MILLI);
    // The fused head's stash per micro-batch in flight on its rank (F computes the
    // gradients, I and W scale them): `dW` and `dx`; never `[tokens, vocab]`.
    let per_mb = add(what, &[mul(what, &[d, vocab])?, mul(what, &[tokens, d])?])?;
    let head = mul(what, &[flight.head_units, per_mb, k(ELEMENT)])?;
    // Its working set: one chunk of tokens' logits (their gradient in place), and the
    // chunk's rows of the input and of `dx`.
    let rows = chunk_rows(job.model.d_model, job.model.vocab) as u64;
    let chunk = Size {
        n: rows.min(tokens.n),
        ..tokens
    };
    let head_working = mul(
        what,
        &[
            chunk,
            add(what, &[vocab, mul(what, &[k(2), d])?])?,
            k(ELEMENT),
        ],
    )?;
    // A block's I: the gradients of its projections and of the MLP's hidden layer, and
    // on CUDA the attention probabilities' gradient, which its kernel writes whole (the
    // CPU's goes row by row: one row a thread).
    let probs_grad = match job.device {
        crate::config::DeviceKind::Cuda => mul(what, &[h, seq])?,
        crate::config::DeviceKind::Cpu => k(0),
    };
    let working_per_token = add(
        what,
        &[
            probs_grad,
            mul(what, &[k(12), d])?,
            mul(what, &[k(4), hidden])?,
        ],
    )?;
    let working = mul(what, &[flight.ranks, tokens, working_per_token, k(ELEMENT)])?;
    // A bf16 buffer is widened to f32 where the CPU computes on it: products, element-wise
    // operations and norms a block of rows at a time, attention one sequence at a time
    // (its `q`, `k`, `v` and output or output gradient, `[seq, d]` each) and within it the
    // probabilities one head at a time. Counted per rank as those four `[seq, d]`
    // operands and three blocks of the widest product (measured: "Mixed precision" in
    // docs/benchmarks.md).
    let widened = match job.train.precision {
        crate::tensor::DType::F32 => k(0),
        crate::tensor::DType::Bf16 => {
            let attention = mul(what, &[seq, k(4), d])?;
            // A product's block of its widest operand, the MLP's hidden layer (checked to
            // fit a usize by `hidden`).
            let rows = crate::tensor::cpu::product_block_rows(hidden.n as usize) as u64;
            let blocks = mul(what, &[k(3), k(rows), hidden])?;
            let values = add(what, &[attention, blocks])?;
            mul(what, &[flight.ranks, values, k(ELEMENT)])?
        }
    };
    add(
        what,
        &[stash, recomputed, head, head_working, working, widened],
    )
}

/// The MLP's hidden width, checked (`mlp_ratio × d_model` unless `intermediate` is given).
pub(super) fn hidden(job: &JobConfig) -> Result<Size, ConfigError> {
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

/// The model's sizes, each a [`Size`] naming its field in the job.
struct Dims {
    vocab: Size,
    d: Size,
    heads: Size,
    seq: Size,
    layers: Size,
}

fn dims(job: &JobConfig) -> Dims {
    let m = &job.model;
    Dims {
        vocab: f("model.vocab", m.vocab),
        d: f("model.d_model", m.d_model),
        heads: f("model.heads", m.heads),
        seq: f("model.seq_len", m.seq_len),
        layers: f("model.layers", m.layers),
    }
}

/// The parameters of a block `d_model` wide, checked: `squares` matrices of `d × d`, the
/// MLP's three of `d × hidden`, and `vectors` of `d` (norms, biases).
fn block_params(
    job: &JobConfig,
    what: &str,
    squares: u64,
    vectors: u64,
) -> Result<Size, ConfigError> {
    let d = dims(job).d;
    let hidden = hidden(job)?;
    add(
        what,
        &[
            mul(what, &[k(squares), d, d])?,
            mul(what, &[k(3), d, hidden])?,
            mul(what, &[k(vectors), d])?,
        ],
    )
}

/// An upper bound of the model's parameter count, checked: key/value projections as wide
/// as `d_model`, three MLP matrices, biases, learned positions. Every term of
/// [`crate::model::GptConfig::param_count`] is at most its term here, so a bound that fits
/// means the exact count cannot overflow.
pub(super) fn param_bound(job: &JobConfig) -> Result<Size, ConfigError> {
    let what = "the parameters";
    let Dims {
        vocab,
        d,
        seq,
        layers,
        ..
    } = dims(job);
    let block = block_params(job, what, 4, 5)?;
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
pub(super) fn params(job: &JobConfig) -> Result<Size, ConfigError> {
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
pub(super) fn task_text(job: &JobConfig) -> Result<Size, ConfigError> {
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

/// The drafter: each replica's trainable state (its block, as wide as the target's, and
/// input projection: value, gradient and moments; the first also the copies a checkpoint
/// makes); the frozen embedding and head, one snapshot per process whatever the number of
/// replicas (`model/drafter/frozen.rs`), one table for a tied target; its buffer of two steps' rows (hidden states and
/// tokens: no distributions, a slice recomputes them); one slice's activations (with the soft
/// targets' logits and softmax through the frozen head).
///
/// `replicas` trainers share the tables: a pipelined run's ranks (with the held-out
/// evaluation's weights), or for `pipefill rl` (`rl`) the one trainer and the proposer, whose
/// weights and half-precision packs (the head's too) are counted beside it.
pub(super) fn drafter_bytes(
    job: &JobConfig,
    replicas: Size,
    rl: bool,
) -> Result<Size, ConfigError> {
    let dr = &job.drafter;
    let what = "the drafter";
    let Dims {
        d,
        vocab,
        seq,
        heads: h,
        ..
    } = dims(job);
    let trained = block_params(job, what, 6, 8)?;
    let hidden = hidden(job)?;
    let table = mul(what, &[vocab, d])?;
    let trainers = add(
        what,
        &[
            mul(what, &[replicas, trained, k(LIVE_PARAM_BYTES)])?,
            mul(what, &[trained, k(2 * COPY_PARAM_BYTES)])?,
        ],
    )?;
    // The proposer's weights and their f16 packs with the head's; or the held-out
    // evaluation's weights and gradients.
    let beside = match rl {
        true => add(
            what,
            &[
                mul(what, &[trained, k(ELEMENT + 2)])?,
                mul(what, &[table, k(2)])?,
            ],
        )?,
        false => mul(what, &[trained, k(2 * ELEMENT)])?,
    };
    // The snapshot read (the embedding f32 on the host, the head in storage), the next one
    // a refresh builds while it is read, and the head's host values (a pipelined run's
    // deposit, which the replicas upload; the refresh's own in `pipefill rl`). A tied
    // target's snapshot is one table in storage, read both ways; beside the two snapshots,
    // the host values of both its copies' deposits (the embedding's uploaded, the head's
    // not read).
    let per_element = match job.model.tie_embeddings {
        true => 2 * ELEMENT + 2 * 4,
        false => 2 * (4 + ELEMENT) + 4,
    };
    let tables = mul(what, &[table, k(per_element)])?;
    let weights = add(what, &[trainers, beside, tables])?;
    let row = add(what, &[d, k(1)])?;
    // The buffer keeps this step's rows and the last step's, each at most `buffer_rows`
    // and at most what a step captures: the training batch's sequences, or the rollouts'.
    let captured = match rl {
        true => mul(
            what,
            &[f("rl.prompts", job.rl.prompts), f("rl.group", job.rl.group)],
        )?,
        false => mul(
            what,
            &[
                f("train.micro_batches", job.train.micro_batches),
                f("train.micro_batch_size", job.train.micro_batch_size),
            ],
        )?,
    };
    let kept = [
        f("drafter.advanced.buffer_rows", dr.advanced.buffer_rows),
        captured,
    ]
    .into_iter()
    .min_by_key(|s| s.n)
    .expect("two sizes");
    let buffer = mul(what, &[k(2), kept, seq, row, k(ELEMENT)])?;
    let positions = f("drafter.max_positions", dr.max_positions);
    let per_token = add(
        what,
        &[
            mul(what, &[k(STASH_PER_D + 8), d])?,
            mul(what, &[k(STASH_PER_HIDDEN + 2), hidden])?,
            mul(what, &[k(2), h, positions])?,
            mul(what, &[k(6), vocab])?,
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
/// hidden states and tokens (the drafter's rows), and one decode step's
/// logits for the verified drafts (a tree's nodes, or the chain of `draft_k`).
pub(super) fn rollout_bytes(job: &JobConfig) -> Result<Size, ConfigError> {
    let r = &job.rl;
    let what = "the rollouts";
    let sequences = mul(what, &[f("rl.prompts", r.prompts), f("rl.group", r.group)])?;
    let Dims {
        d,
        vocab,
        seq,
        layers,
        ..
    } = dims(job);
    let kv = mul(what, &[sequences, layers, k(2), d, seq, k(ELEMENT)])?;
    let row = add(what, &[d, k(2)])?;
    let rows = mul(what, &[sequences, seq, row, k(ELEMENT)])?;
    let drafts = match r.draft_tree {
        Some(tree) => f("rl.draft_tree.nodes", tree.nodes),
        None => add(what, &[f("rl.draft_k", r.draft_k), k(1)])?,
    };
    let logits = mul(what, &[sequences, drafts, vocab, k(2 * ELEMENT)])?;
    let prompts = mul(what, &[sequences, add(what, &[k(TASK_BYTES), seq])?])?;
    add(what, &[kv, rows, logits, prompts])
}

/// A JSONL dataset's records and documents and its tokenizer, from their sizes on disk (a
/// `stat`, nothing read); 0 for the synthetic tasks, or a file that is not there (reading
/// it fails later, naming it).
pub(super) fn dataset_bytes(job: &JobConfig) -> Result<Size, ConfigError> {
    let data = &job.data;
    if data.source != crate::data::DataSource::Jsonl {
        return Ok(k(0));
    }
    let size = |p: &std::path::Path| std::fs::metadata(p).map_or(0, |m| m.len());
    let file = data.path.as_deref().map_or(0, size);
    let tokenizer = data.tokenizer.as_deref().map_or(0, |p| match p.is_dir() {
        true => size(&p.join("tokenizer.json")),
        false => size(p),
    });
    // One record is tokenized at a time: its transient is the longest line's.
    let longest = match data.max_line_bytes < file {
        true => f("data.max_line_bytes", data.max_line_bytes),
        false => f("data.path", file),
    };
    add(
        "the dataset",
        &[
            mul("the dataset", &[f("data.path", file), k(JSONL_BYTE_COST)])?,
            mul(
                "the dataset",
                &[f("data.tokenizer", tokenizer), k(TOKENIZER_BYTE_COST)],
            )?,
            mul("the dataset", &[longest, k(TOKENIZE_BYTE_COST)])?,
        ],
    )
}
