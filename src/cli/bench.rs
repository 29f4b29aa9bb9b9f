//! `pipefill bench filler`: see [`filler`]. `pipefill bench rollout [--json] [--device
//! cpu|cuda]`: the rollout engine on a long-tail
//! batch, with plain decoding, speculation at a fixed K, and adaptive speculation, on the
//! CPU or GPU 0.
//!
//! What it does, in order (each step prints what it trained or measured), on the job of
//! [`BENCH_SETS`] (a `d_model` 512 target, where decoding is bound by reading weights):
//! 1. trains the target (the job's `[model]`, reference trainer) for `--steps` steps on the
//!    job's tasks, so that it writes solutions and ends them with EOS, and keeps it in
//!    `--run-dir` (a rerun loads it; the drafter of step 3 is kept there too);
//! 2. builds the long-tail batch: `--requests` task prompts whose answer lengths are drawn
//!    from a heavy-tailed law (`batch`), each capped by the model's positions, and prints
//!    the completion lengths and the share of the plain rollout's time that its longest 10%
//!    of sequences take alone;
//! 3. runs it once with plain decoding (its rows are the drafter's held-out rows), then
//!    rolls out `--drafter-requests` other prompts of the same tasks plainly and trains the
//!    drafter (`[drafter]`) for `--drafter-slices` slices on their rows: as TLT's drafter
//!    learns from earlier rollouts, it never sees the measured batch's; its top-1 agreement
//!    with the target is printed on both;
//! 4. runs it plainly and with a fixed K (its acceptance length gives the drafter's
//!    per-token acceptance, hence every K's), and derives the adaptive threshold from
//!    measured step costs: per sequences in one group `b` = 1, 2, 4, … and every K the
//!    bandit may choose, the target's decode step, its verification of K+1 positions and
//!    the drafter's proposal (one thread, timed in turn, fastest of 9); speculation pays at
//!    `b` while some K's `acceptance(K) × decode(b) > propose(b) + verify(b)` under the
//!    bandit's exploration, and the threshold is the live batch up to which the engine's
//!    groups hold at most the largest such `b` (all smaller ones paying too; the engine
//!    merges small groups, see `live_threshold`). Per live-batch bucket, the plain and the
//!    fixed-K runs' tokens/s are printed against what the step costs (fastest, and medians
//!    of 9) predict for the very steps they ran (their step logs: kind, sequences, tokens,
//!    compute), with the threshold the measured figures would give (the largest bucket up
//!    to which the fixed-K run was faster in every bucket);
//! 5. runs the batch `--reps` times per mode, each adaptive variant alternating with plain
//!    runs: `adaptive` (the step-cost threshold, arms K ≥ 1) and `K=0 arm` (the whole long
//!    tail, with a plain arm that lets the bandit learn per bucket whether to speculate,
//!    from each step's own cost); the headline speedup is [`HEADLINE`]'s. It reports
//!    medians: tokens/s overall and in
//!    the long tail (from the moment a quarter of the batch is live), acceptance length,
//!    time in the tail, the driver's drafting time per verified sequence inside the
//!    rollout (against the proposal timed alone: the gap is cold caches and a shared
//!    machine), and whether every mode produced the same greedy tokens.
//! 6. next to the chain (fixed K) it runs a draft tree (`--tree`, EAGLE-2's dynamic tree:
//!    depth, children per node, nodes expanded per level, nodes verified) as a fixed mode
//!    and as an adaptive variant (`adapt tree`: the bandit's K is the tree's depth), each
//!    alternating with plain runs, and prints the tree's step costs at one sequence per
//!    group (verification of its rows, proposal) next to the chain's.
//!
//! With `--draft-vocab N,..` it stops after step 3 and compares, instead, the drafter's
//! chains with the full head and with the `N` tokens most frequent in the rows, for each `N`
//! ([`Drafter::set_draft_vocab`]): acceptance length at the fixed K (median of `--reps`),
//! the proposal's cost for one sequence, and whether the output equals the plain run's.

mod args;
mod batch;
mod cache;
mod costs;
mod filler;
mod overlap;
mod report;

use std::time::Instant;

use crate::cli::show::Terminal;
use anyhow::{Context, bail};
pub use args::BenchArgs;
use args::{BenchWhat, RolloutArgs};
use batch::{Stream, long_tail_batch, parse_tree};
use costs::{
    COST_REPS, EARLY_PARTS, FIRST_PARTS, TAIL_PARTS, bucket_fits, bucket_tables, fit_lines,
    per_token_acceptance, probe_context, step_cost_lines, step_rows, threshold_of_buckets,
};
use overlap::{overlap_lines, overlaps};
use pipefill::config::JobConfig;
use pipefill::model::checkpoint::Checkpoint;
use pipefill::model::drafter::{
    DraftBufferHandle, DraftContext, Drafter, DrafterTrainer, frequent_tokens,
};
use pipefill::model::infer::InferStage;
use pipefill::model::{Cut, Gpt};
use pipefill::profile::report::median;
use pipefill::rl::calibrate::{
    MAX_CALIBRATION_BATCH, chain_acceptance, step_costs, threshold_per_group_explored, tree_cost,
};
use pipefill::rl::rollout::{
    AdaptiveConfig, RolloutConfig, RolloutEngine, RolloutOutput, Speculation, StepRecord,
    live_threshold,
};
use pipefill::run::Show;
use pipefill::tensor::device::Device;
use pipefill::tensor::{Backend, CpuBackend};
use pipefill::train::reference::{Trainer, cpu_threads};
use report::{Report, TreeFigures, Variant};

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.what {
        BenchWhat::Rollout(a) => rollout(a),
        BenchWhat::Filler(a) => filler::run(a),
    }
}

fn rollout(a: RolloutArgs) -> anyhow::Result<()> {
    if a.reps == 0 || a.requests == 0 || a.drafter_requests == 0 || a.k == 0 {
        bail!("--reps, --requests, --drafter-requests and --k must be at least 1");
    }
    // The bench's own defaults first, so that `--set` can still override them.
    let mut sets: Vec<String> = BENCH_SETS
        .iter()
        .map(|s| s.to_string())
        .chain(a.sets.iter().cloned())
        .collect();
    if let Some(device) = a.device {
        sets.push(format!("device=\"{device}\""));
    }
    let mut job = JobConfig::embedded(&sets).context("bench rollout: the job")?;
    // Before any work: a device that cannot be used here ends the bench at once.
    let device = job.device.usable_on_local_rank(0)?;
    // With --json, stdout is the JSON alone: every line the bench shows goes to stderr.
    let mut out = Terminal::default().lines_to_stderr(a.json);
    let init = cache::cached_target(&mut job, &a.run_dir, &mut out)?;
    // On the CPU the target, trained or loaded, computes on the `train.threads` threads a
    // trained one trains with, rollouts included; the drafter gets one thread. On a GPU
    // everything shares its one backend (one stream).
    match device {
        Device::Cpu { .. } => {
            let train = CpuBackend::new(cpu_threads(&job.train))?;
            let one = CpuBackend::new(1)?;
            rollout_on(a, job, init, train, one, &mut out)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda { ordinal } => {
            let gpu = pipefill::tensor::cuda::CudaBackend::new(ordinal)?;
            rollout_on(a, job, init, gpu.clone(), gpu, &mut out)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => Err(pipefill::tensor::TensorError::CudaNotCompiled.into()),
    }
}

/// The bench on backend `B`: the target trained on `train` (or loaded onto it from `init`,
/// the run directory's checkpoint), the drafter on `one`; what it measured goes to `out`.
fn rollout_on<B: Backend>(
    a: RolloutArgs,
    mut job: JobConfig,
    init: Option<Checkpoint>,
    train: B,
    one: B,
    out: &mut Terminal,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let dir = &a.run_dir;
    // Whichever target is used lives in one of these two.
    let (trainer, loaded);
    let (trained, model, origin): (u64, &Gpt<B>, String) = match init {
        Some(checkpoint) => {
            // On the backend a trained target would have, so that cached and fresh runs
            // measure the same rollouts.
            let mut model = Gpt::blank(&job.model, train, &Cut::Even(1))?;
            checkpoint
                .restore_model(&mut model, job.train.seed)
                .with_context(|| format!("--run-dir {}", dir.display()))?;
            let step = checkpoint.meta.step;
            loaded = model;
            (
                step,
                &loaded,
                format!("from {} at step {step}", dir.display()),
            )
        }
        None => {
            let mut t = Trainer::with_backend(train, &job.model, &job.data, &job.train)?;
            let mut loss = f32::NAN;
            for _ in 0..a.steps {
                loss = t.train_step()?.loss;
            }
            cache::save_target(&job, &mut t.checkpoint()?, dir)?;
            trainer = t;
            let origin = format!(
                "trained {} steps on {:?} (last loss {loss:.3}) in {:.1} s, kept in {}",
                a.steps,
                job.data.families,
                t0.elapsed().as_secs_f64(),
                dir.display()
            );
            (a.steps, trainer.model(), origin)
        }
    };
    out.line(&format!(
        "target: {} layers, d_model {} ({} parameters) on {}, {origin}",
        job.model.layers,
        job.model.d_model,
        job.model.param_count(),
        model.backend().name(),
    ));
    let requests = long_tail_batch(&job, a.requests, Stream::Measured, &[])?;
    let stages = InferStage::stages_of(model, &Cut::Even(a.stages))?;
    let mut engine = RolloutEngine::new(stages)?
        .with_min_group_rows(a.min_group_rows)
        .with_inline_tail(!a.threaded_tail);
    if let Some(w) = a.workers {
        engine = engine.with_workers(w);
    }
    let groups = a.groups.unwrap_or(a.stages).max(1);
    let cfg = |speculation, record_rows| RolloutConfig {
        groups,
        speculation,
        record_rows,
        ..RolloutConfig::default()
    };

    // The batch measured plainly once: its lengths, and its rows (the drafter's held-out
    // rows, and the probe of the step costs below).
    let first = engine.run(&requests, &cfg(Speculation::Off, true), None)?;
    let lens: Vec<usize> = (0..requests.len())
        .map(|i| first.completion(i).len())
        .collect();
    let median_len = median(lens.iter().map(|&l| l as f64));
    let max_len = lens.iter().copied().max().unwrap_or(0);
    out.line(&format!(
            "batch: {} sequences, completion lengths min {} median {median_len} max {max_len} ({:.1}x the median; EOS or the {}-position cap); the longest 10% alone take {:.0}% of this plain rollout's time",
            requests.len(),
            lens.iter().min().unwrap_or(&0),
            max_len as f64 / median_len.max(1.0),
            job.model.seq_len,
            100.0 * first.tail_share()
        ),
    );
    // The drafter, trained on the rows of a plain rollout of other prompts of the same
    // tasks (`Stream::Drafter`): what it drafts in the measured runs it has not seen.
    let lesson_requests = long_tail_batch(&job, a.drafter_requests, Stream::Drafter, &requests)?;
    // Room for every row of that rollout (a buffer drops the oldest beyond it).
    let rows = &mut job.drafter.advanced.buffer_rows;
    *rows = (*rows).max(a.drafter_requests);
    let mut drafter = Drafter::new(&job.model, &job.drafter, one.clone())?;
    drafter.refresh_from_gpt(model, trained)?;
    let kept = cache::drafter_path(dir, &job, trained, &lesson_requests, a.drafter_slices);
    let cached = cache::cached_drafter(&kept)?;
    // A kept drafter and its kept agreement leave nothing to roll out for, unless the draft
    // vocabularies are counted on the rows.
    let kept_seen = match (&cached, a.draft_vocab.is_empty()) {
        (Some(_), true) => cache::cached_agreement(&kept)?,
        _ => None,
    };
    let lesson = match kept_seen {
        Some(_) => Vec::new(),
        None => (engine.run(&lesson_requests, &cfg(Speculation::Off, true), None)?).rows,
    };
    // The buffer holds the rows only for a drafter trained here; a kept one is loaded.
    let buffer = DraftBufferHandle::new(&job.model, &job.drafter);
    buffer.begin_step(trained);
    if cached.is_none() {
        for row in lesson.iter().cloned() {
            buffer.lock().push(row)?;
        }
    }
    let t1 = Instant::now();
    let mut dtrainer = DrafterTrainer::new(drafter, buffer, 0, 1)?;
    let origin = match cached {
        Some(weights) => {
            dtrainer.load_weights(&weights)?;
            format!("loaded from {}", kept.display())
        }
        None => {
            for _ in 0..a.drafter_slices {
                dtrainer.slice()?;
            }
            cache::save_drafter(&kept, &dtrainer.weights()?)?;
            format!(
                "{} slices on the rows of {} other prompts' plain rollout in {:.1} s",
                a.drafter_slices,
                lesson.len(),
                t1.elapsed().as_secs_f64(),
            )
        }
    };
    let seen = match kept_seen {
        Some(seen) => seen,
        None => {
            let seen = dtrainer.agreement(&lesson)?;
            cache::save_agreement(&kept, seen)?;
            seen
        }
    };
    let agree = dtrainer.agreement(&first.rows)?;
    out.line(&format!(
        "drafter: {origin}; top-1 agreement with the target {:.1}% on the measured batch (held out), {:.1}% on its own rows",
        100.0 * agree,
        100.0 * seen
    ));
    // What a step costs per sequences in one group, measured piece by piece (one thread):
    // the target's decode and verification, and the drafter's proposal, at the long
    // tail's context (`probe_context`). They decide the threshold below.
    let probe = first
        .rows
        .iter()
        .max_by_key(|r| r.len())
        .context("no rows")?
        .clone();
    let max_b = requests.len().div_ceil(groups).min(MAX_CALIBRATION_BATCH);
    // The caches the step costs are timed at: the first steps', the early buckets', the
    // tail's (`probe_context`).
    let owned = [FIRST_PARTS, EARLY_PARTS, TAIL_PARTS]
        .map(|parts| probe_context(&probe, job.model.d_model, parts));
    let [start, early, ctx] = owned.each_ref().map(|(hidden, tokens)| DraftContext {
        hidden: hidden.as_slice(),
        tokens: tokens.as_slice(),
    });
    if !a.draft_vocab.is_empty() {
        let d = dtrainer.drafter_mut();
        let vocabs = a.draft_vocab.iter();
        let vocabs = vocabs.map(|&n| Some(frequent_tokens(&lesson, job.model.vocab, n)));
        for ids in std::iter::once(None).chain(vocabs) {
            let ids = ids.as_deref();
            d.set_draft_vocab(ids)?;
            let cost = step_costs(model, d, ctx, &[a.k], 1, COST_REPS)?;
            let mut runs = Vec::with_capacity(a.reps);
            for _ in 0..a.reps {
                let p: &mut dyn pipefill::rl::speculative::Proposer = &mut *d;
                let spec = cfg(Speculation::Fixed { k: a.k }, false);
                runs.push(engine.run(&requests, &spec, Some(p))?);
            }
            out.line(&format!(
                "{}: fixed K={} acceptance length {:.3} (median of {}), proposing K for one sequence {:.3} ms, output identical to plain: {}",
                ids.map_or(format!("full head ({})", job.model.vocab), |i| format!(
                    "draft vocabulary {}",
                    i.len()
                )),
                a.k,
                median(runs.iter().map(|r| r.stats.acceptance_length())),
                a.reps,
                cost.first().map_or(f64::NAN, |c| c.propose_ms),
                runs.iter().all(|r| r.sequences == first.sequences)
            ));
        }
        return Ok(());
    }
    // Every draft length the adaptive engine may choose (and the fixed run's): a short
    // draft still pays at group sizes where verifying K = 4 costs too much.
    let mut cost_ks = AdaptiveConfig::default().ks;
    if !cost_ks.contains(&a.k) {
        cost_ks.push(a.k);
    }
    // Modes alternate run by run, so that the machine's drift (other jobs on a shared box)
    // hits both sides of a comparison alike.
    let shape = parse_tree(&a.tree)?;
    let (tree_verify_ms, tree_propose_ms, tree_rows) =
        tree_cost(model, dtrainer.drafter_mut(), ctx, &shape, COST_REPS)?;
    let mut pair = |drafter: &mut Drafter<B>,
                    spec: &Speculation|
     -> anyhow::Result<(Vec<RolloutOutput>, Vec<RolloutOutput>)> {
        let (mut plain, mut spec_runs) = (Vec::new(), Vec::new());
        for _ in 0..a.reps {
            plain.push(engine.run(&requests, &cfg(Speculation::Off, false), None)?);
            let p: &mut dyn pipefill::rl::speculative::Proposer = &mut *drafter;
            spec_runs.push(engine.run(&requests, &cfg(spec.clone(), false), Some(p))?);
        }
        Ok((plain, spec_runs))
    };
    let (plain0, fixed) = pair(dtrainer.drafter_mut(), &Speculation::Fixed { k: a.k })?;
    let fixed_accept = median(fixed.iter().map(|r| r.stats.acceptance_length()));
    let (plain_tree, fixed_tree) = pair(dtrainer.drafter_mut(), &Speculation::Tree(shape))?;
    let tree_accept = median(fixed_tree.iter().map(|r| r.stats.acceptance_length()));
    // The per-bucket predictions: the step costs at the three contexts, up to the
    // largest step the runs had (a plain group may hold every live sequence).
    // The largest of `size` over the fitted runs' steps, to the next power of two (the
    // sizes the tables and the overlaps are timed at).
    let largest = |size: fn(&StepRecord) -> usize| {
        (plain0.iter().chain(&fixed))
            .flat_map(|r| r.steps.iter().map(size))
            .max()
            .unwrap_or(1)
            .next_power_of_two()
    };
    let fit_b = largest(|s| s.sequences);
    let (contexts, d) = ([start, early, ctx], dtrainer.drafter_mut());
    let timed_b = fit_b.max(max_b);
    let (bucket_costs, median_costs) = bucket_tables(model, d, &contexts, &cost_ks, timed_b)?;
    // The threshold's step costs: the tail's (`ctx`, the last context), up to the sizes a
    // group of the adaptive engine may have.
    let costs: Vec<_> = bucket_costs[contexts.len() - 1]
        .costs
        .iter()
        .filter(|c| c.batch <= max_b)
        .copied()
        .collect();
    // The fixed run's chain at one sequence per group.
    let chain = *costs
        .iter()
        .find(|c| c.batch == 1 && c.k == a.k)
        .context("no step cost of one sequence")?;
    let propose_ms = chain.propose_ms;
    out.line(&format!(
            "drafter: proposing K={} tokens for one sequence takes {propose_ms:.3} ms (fastest of {COST_REPS})",
            a.k
        ),
    );
    // How much faster the stage threads run several groups' steps at once, for the buckets
    // the runs had several groups in flight in (early in the rollout: the early context).
    // Up to the most rows a fitted step carried (K+1 a sequence when verifying).
    let overlaps = overlaps(
        model,
        early.tokens.len(),
        largest(step_rows),
        timed_b,
        groups,
        COST_REPS,
    )?;
    for line in overlap_lines(&overlaps) {
        out.line(&line);
    }
    let fits = |runs: &[RolloutOutput]| bucket_fits(runs, &bucket_costs, &median_costs, &overlaps);
    let (plain_fits, fixed_fits) = (fits(&plain0), fits(&fixed));
    out.line(&format!(
        "engine vs step costs: each step predicted at its own context, linear between the step costs at {} cached positions (groups of up to {timed_b} sequences timed)",
        contexts
            .iter()
            .map(|c| c.tokens.len().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    for line in fit_lines(&plain_fits, &fixed_fits, a.k) {
        out.line(&line);
    }
    // Each K's acceptance from the fixed run's: per-token acceptance α with
    // 1 + α + … + α^K = its acceptance length.
    let alpha = per_token_acceptance(fixed_accept, a.k);
    let accept = |k: usize| chain_acceptance(alpha, k);
    let epsilon = AdaptiveConfig::default().epsilon;
    let per_group = threshold_per_group_explored(&costs, accept, epsilon, false);
    // The engine merges small groups: the live batch at which groups are still that small.
    let threshold = live_threshold(per_group, (a.k + 1) as f64, groups, a.min_group_rows);
    for line in step_cost_lines(&costs, accept) {
        out.line(&line);
    }
    out.line(&format!(
            "step costs:   1 per group: verify tree {tree_rows} rows {tree_verify_ms:>7.3} ms ({:.2}x), propose tree {tree_propose_ms:>6.3} ms: {:.2} ms per token at acceptance length {tree_accept:.2} (chain {:.2} at {fixed_accept:.2}; decode {:.2})",
            tree_verify_ms / chain.decode_ms,
            (tree_verify_ms + tree_propose_ms) / tree_accept,
            (chain.verify_ms + chain.propose_ms) / fixed_accept,
            chain.decode_ms
        ),
    );
    out.line(&format!(
            "threshold: speculate while live ≤ {threshold} (at most {per_group} per group with some K of {cost_ks:?} paying under the bandit's exploration, up to {groups} groups of at least {} rows; acceptance length {fixed_accept:.2} at K={}, per-token acceptance {alpha:.2})",
            a.min_group_rows, a.k
        ),
    );
    // The engine's own figures decide the same threshold: the largest bucket up to which
    // the fixed-K run was faster than the plain one in every bucket.
    let engine_threshold = threshold_of_buckets(&plain_fits, &fixed_fits);
    out.line(&format!(
        "threshold from the engine's per-bucket tokens/s: speculate while live ≤ {engine_threshold}"
    ));
    // And with a plain arm, the bandit decides per bucket over the whole long tail.
    let tail_live = (requests.len() / 4).max(threshold);
    let variants = [
        ("adaptive", threshold, AdaptiveConfig::default().ks, None),
        ("K=0 arm", tail_live, PLAIN_ARM_KS.to_vec(), None),
        (
            "adapt tree",
            threshold,
            AdaptiveConfig::default().ks,
            Some(shape),
        ),
    ];
    let mut runs: Vec<Variant> = Vec::new();
    for (name, threshold, ks, tree) in variants {
        let spec = Speculation::Adaptive(AdaptiveConfig {
            threshold,
            ks,
            tree,
            ..AdaptiveConfig::default()
        });
        let (plain, spec_runs) = pair(dtrainer.drafter_mut(), &spec)?;
        runs.push(Variant {
            name,
            threshold,
            plain,
            runs: spec_runs,
        });
    }
    let report = Report {
        device: model.backend().name(),
        requests: requests.len(),
        reps: a.reps,
        k: a.k,
        plain: &plain0,
        fixed: &fixed,
        fixed_acceptance: fixed_accept,
        tree: TreeFigures {
            arg: &a.tree,
            shape,
            plain: &plain_tree,
            runs: &fixed_tree,
            acceptance: tree_accept,
            verify_ms: tree_verify_ms,
            propose_ms: tree_propose_ms,
            rows: tree_rows,
        },
        variants: &runs,
        median_len,
        max_len,
        agreement: (agree, seen),
        plain_fits: &plain_fits,
        fixed_fits: &fixed_fits,
        threshold,
        engine_threshold,
        propose_ms,
        costs: &costs,
        bucket_costs: &bucket_costs,
        median_costs: &median_costs,
    };
    let identical = report.print(a.json);
    if !identical {
        bail!("speculative decoding changed the greedy outputs");
    }
    Ok(())
}

/// The bench's job on top of the embedded default (each overridable with `--set`): a
/// target wide enough that decoding a few sequences is bound by reading its weights from
/// memory, as decoding is on a GPU, the regime speculative decoding is for: `d_model` 512,
/// 8 layers, 25 M parameters, 100 MB of f32 weights, far beyond a CPU's L3, so verifying
/// K+1 positions costs little more than a decode step; at `d_model` 256 the weights fit the
/// L3 of the reference machine and verification costs more (docs/benchmarks.md, "The
/// rollout bench's job"): `--set model.d_model=256` to compare.
/// 512 positions, so that the batch's longest answers (`batch`) run to ~80x the median and
/// its longest 10% of sequences take two thirds of the plain rollout's time: the long tail
/// of reasoning rollouts, where a few sequences decode for most of the time. (At 192 the
/// cap cut the tail to 27% of the time.) Training this target takes ~40 minutes on a
/// 2-core CPU, once: it is kept in `--run-dir`.
/// Proposals attend to the last 8 target pairs (the drafter trains on windows of at most
/// 16).
const BENCH_SETS: &[&str] = &["model.d_model=512", "model.seq_len=512", "drafter.window=8"];

/// The arms of the bandit that also chooses plain decoding (K = 0) per bucket.
const PLAIN_ARM_KS: &[usize] = &[0, 1, 2, 4, 6];
/// Which of the adaptive variants is the bench's headline `adaptive` figure: the
/// step-cost threshold. It beat the bandit with a plain arm over the whole tail (the plain
/// arm's exploration of long drafts at large buckets costs more than the few steps per
/// bucket and rollout can win back), and the engine's per-bucket threshold came out 0 (no
/// speculation), its buckets too noisy to decide, so it is printed, not run
/// (docs/benchmarks.md, "The rollout bench's headline").
const HEADLINE: usize = 0;
