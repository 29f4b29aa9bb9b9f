//! What decides `bench rollout`'s adaptive thresholds: the target's and the drafter's step
//! costs timed alone (one thread, fastest of [`COST_REPS`]), and the engine's own tokens/s
//! per live-batch bucket.

use std::collections::BTreeMap;
use std::time::Instant;

use pipefill::data::SplitMix64;
use pipefill::model::drafter::{DraftContext, Drafter, TreeShape};
use pipefill::model::infer::{InferStage, Span, StageInput, StageOutput, TreeStep, run_stages};
use pipefill::model::{Cut, Gpt};
use pipefill::rl::bandit::bucket;
use pipefill::rl::rollout::Rollout;
use pipefill::tensor::CpuBackend;

/// Tokens generated and seconds spent while the live batch was in each bucket, summed
/// over `runs` (from their live curves).
fn by_bucket(runs: &[Rollout]) -> BTreeMap<usize, (f64, f64)> {
    let mut out: BTreeMap<usize, (f64, f64)> = BTreeMap::new();
    for r in runs {
        for w in r.live_curve.windows(2).filter(|w| w[0].live > 0) {
            let e = out.entry(bucket(w[0].live)).or_default();
            e.0 += (w[1].tokens - w[0].tokens) as f64;
            e.1 += w[1].t - w[0].t;
        }
    }
    out
}

/// Tokens/s of the plain and the fixed-K runs while the live batch was in each bucket:
/// `(bucket, plain, fixed)`, over the buckets both runs went through.
pub(super) fn engine_buckets(plain: &[Rollout], fixed: &[Rollout]) -> Vec<(usize, f64, f64)> {
    let (p, f) = (by_bucket(plain), by_bucket(fixed));
    p.iter()
        .filter_map(|(&b, &(pt, ps))| {
            let &(ft, fs) = f.get(&b)?;
            Some((b, pt / ps.max(1e-9), ft / fs.max(1e-9)))
        })
        .collect()
}

/// The largest bucket up to which speculation was faster in every bucket (0: not even in
/// the smallest), from `(bucket, plain, fixed)` tokens/s in bucket order.
pub(super) fn threshold_of_buckets(buckets: &[(usize, f64, f64)]) -> usize {
    buckets
        .iter()
        .take_while(|(_, plain, fixed)| fixed > plain)
        .last()
        .map_or(0, |&(b, _, _)| b)
}

/// Largest group size the step costs are measured for.
pub(super) const MAX_CALIBRATION_BATCH: usize = 32;
/// Timed repetitions per cost (the fastest is kept).
pub(super) const COST_REPS: usize = 9;
/// Positions already in each sequence's cache when a timed step starts.
const COST_PAST: usize = 32;

/// What one step of a group of `batch` sequences costs, in milliseconds.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub(super) struct StepCost {
    pub batch: usize,
    pub decode_ms: f64,
    pub verify_ms: f64,
    pub propose_ms: f64,
}

impl StepCost {
    /// Whether a speculative step (proposal + verification, `acceptance` tokens per
    /// sequence) emits tokens faster than plain decode steps (one token each).
    pub(super) fn pays(&self, acceptance: f64) -> bool {
        acceptance * self.decode_ms > self.propose_ms + self.verify_ms
    }
}

/// Step costs for groups of 1, 2, 4, … up to `max_b` sequences: the whole target on one
/// thread (a group in the long tail passes the stages one after another, so their costs add
/// up) decoding one position per sequence and verifying K+1, each resuming at
/// `COST_PAST` of a prefilled cache; and `drafter` proposing `k` tokens for `batch` copies
/// of `probe`'s context.
pub(super) fn step_costs(
    model: &Gpt<CpuBackend>,
    drafter: &mut Drafter<CpuBackend>,
    probe: &pipefill::model::drafter::DraftRow,
    k: usize,
    max_b: usize,
) -> anyhow::Result<Vec<StepCost>> {
    let past = COST_PAST.min(model.config().seq_len.saturating_sub(k + 1));
    let mut stages = InferStage::stages_of(model, &Cut::Even(1))?;
    let d = model.config().d_model;
    let n = probe.len();
    let tokens: Vec<u32> = probe.targets[..n].to_vec();
    let ctx = DraftContext {
        hidden: &probe.hidden[..n * d],
        tokens: &tokens,
    };
    let mut rng = SplitMix64::new(1);
    let ms = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        let s = Instant::now();
        f()?;
        Ok(s.elapsed().as_secs_f64() * 1e3)
    };
    let spans = |b: usize, start: usize, len: usize| -> Vec<Span> {
        (0..b).map(|slot| Span { slot, start, len }).collect()
    };
    let mut out = Vec::new();
    let mut b = 1;
    while b <= max_b.max(1) {
        let ids = vec![5u32; b * (past + k + 1)];
        run_stages(&mut stages, &spans(b, 0, past + k + 1), &ids)?;
        let contexts = vec![ctx; b];
        // The three are timed in turn, so that a burst of other work on a shared box hits
        // them alike, and each keeps its least-disturbed time: the threshold below needs
        // every smaller size to pay, so one inflated verification would cut it.
        let (mut decode_ms, mut verify_ms, mut propose_ms) = (f64::MAX, f64::MAX, f64::MAX);
        for _ in 0..COST_REPS {
            decode_ms = decode_ms.min(ms(&mut || {
                run_stages(&mut stages, &spans(b, past, 1), &ids[..b])?;
                Ok(())
            })?);
            verify_ms = verify_ms.min(ms(&mut || {
                run_stages(&mut stages, &spans(b, past, k + 1), &ids[..b * (k + 1)])?;
                Ok(())
            })?);
            propose_ms = propose_ms.min(ms(&mut || {
                drafter.propose(&contexts, k, 0.0, &mut rng)?;
                Ok(())
            })?);
        }
        out.push(StepCost {
            batch: b,
            decode_ms,
            verify_ms,
            propose_ms,
        });
        b *= 2;
    }
    Ok(out)
}

/// The largest group size up to which speculation pays at every measured size (0: it does
/// not pay even for one sequence). Between measured sizes the smaller one decides.
pub(super) fn threshold_per_group(costs: &[StepCost], acceptance: f64) -> usize {
    let mut best = 0;
    for (i, c) in costs.iter().enumerate() {
        if !c.pays(acceptance) {
            break;
        }
        // Paying at `c.batch` and at the next measured size covers the sizes between.
        best = match costs.get(i + 1) {
            Some(next) if next.pays(acceptance) => next.batch - 1,
            _ => c.batch,
        };
    }
    best
}

/// What a draft-tree step of one sequence costs (one thread, fastest of [`COST_REPS`]): the
/// target verifying the tree the drafter proposes for `probe` (its nodes + 1 rows, with
/// tree attention, resuming at `COST_PAST`), and that proposal. `(verify_ms, propose_ms,
/// rows)`.
pub(super) fn tree_cost(
    model: &Gpt<CpuBackend>,
    drafter: &mut Drafter<CpuBackend>,
    probe: &pipefill::model::drafter::DraftRow,
    shape: &TreeShape,
) -> anyhow::Result<(f64, f64, usize)> {
    let d = model.config().d_model;
    let n = probe.len();
    let tokens: Vec<u32> = probe.targets[..n].to_vec();
    let ctx = [DraftContext {
        hidden: &probe.hidden[..n * d],
        tokens: &tokens,
    }];
    let tree = drafter.propose_tree(&ctx, shape, 0.0)?.remove(0);
    let rows = tree.len() + 1;
    let past = COST_PAST.min(model.config().seq_len.saturating_sub(rows));
    let mut stages = InferStage::stages_of(model, &Cut::Even(1))?;
    run_stages(
        &mut stages,
        &[Span {
            slot: 0,
            start: 0,
            len: past,
        }],
        &vec![5u32; past],
    )?;
    let span = [Span {
        slot: 0,
        start: past,
        len: rows,
    }];
    let step = TreeStep {
        parents: vec![Some(tree.row_parents())],
        compact: Vec::new(),
    };
    let mut ids = vec![5u32];
    ids.extend_from_slice(&tree.tokens);
    let (mut verify_ms, mut propose_ms) = (f64::MAX, f64::MAX);
    for _ in 0..COST_REPS {
        let s = Instant::now();
        let mut input = StageInput::Tokens(&ids);
        for stage in stages.iter_mut() {
            match stage.forward_with(&span, Some(&step), input)? {
                StageOutput::Hidden(h) => input = StageInput::Hidden(h),
                StageOutput::Final { .. } => break,
            }
        }
        verify_ms = verify_ms.min(s.elapsed().as_secs_f64() * 1e3);
        let s = Instant::now();
        drafter.propose_tree(&ctx, shape, 0.0)?;
        propose_ms = propose_ms.min(s.elapsed().as_secs_f64() * 1e3);
    }
    Ok((verify_ms, propose_ms, rows))
}
