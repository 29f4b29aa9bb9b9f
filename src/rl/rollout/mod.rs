//! The rollout engine: batched generation through the pipeline stages, each with its own
//! KV cache, with optional lossless speculative decoding and an adaptive choice of K.
//!
//! What is real here: every stage is an [`InferStage`] run by a stage thread (`pipe`; one
//! per stage, or without a hook one per core for a run of consecutive stages:
//! [`RolloutEngine::with_workers`]), and the driver (this module, on the calling thread:
//! the rank that holds the final hidden states and the drafter) keeps up to `groups`
//! groups of sequences in flight, one behind another, so that while stage 2 works on group
//! A stage 1 already works on group B. Plain decode steps keep no more groups in flight
//! than there are stage threads. Everything runs in one process; the stage-to-stage
//! messages are channels, not the actor transport. When only one group is in flight (the
//! long tail) there is nothing to overlap, so by default the driver runs its step through
//! every stage's layers itself ([`RolloutEngine::with_inline_tail`]).
//! Every step goes into the rollout's step log ([`StepRecord`]), which `pipefill bench
//! rollout` checks against the measured step costs.
//!
//! One step of a group is prefill (the prompts), decode (one position per sequence) or
//! verification (the last token plus K drafted ones, K+1 positions, in one pass); see
//! [`super::accept`] for the acceptance rules and [`super::speculative`] for the drafts.
//! Sequences end at EOS or at their length cap, so the live batch shrinks into a long tail;
//! the sequences not in flight wait in one queue, from which each free place in flight takes
//! a group of at most an equal share of the live batch (over [`groups_in_flight`] groups),
//! so that the stages stay busy and balanced. With [`Speculation::Adaptive`] speculation
//! runs only while the live batch is at most `threshold`, and a [`KBandit`] picks K per
//! live-batch bucket. With a draft tree ([`Speculation::Tree`], or [`AdaptiveConfig::tree`]) a step
//! verifies the drafter's tree instead of a chain: its rows attend to their ancestors only
//! ([`crate::model::infer::TreeStep`]), [`super::tree`] accepts a path, and the sequence's
//! next step compacts the stages' caches to that path.

mod driver;
mod groups;
pub mod idle;
mod pipe;
mod seq;

use crate::rl::RlError;
pub use groups::{MIN_GROUP_ROWS, groups_in_flight, live_threshold};
pub use pipe::{IdleTurn, MessageHook, WorkKind};

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use super::bandit::{Choice, KBandit};
use super::speculative::Proposer;
use crate::model::drafter::{DraftRow, TreeShape};
use crate::model::infer::InferStage;
use crate::tensor::Backend;
use driver::Driver;
use pipe::{Msg, stage_loop};

/// Live batch at or below which [`AdaptiveConfig::default`] speculates.
///
/// How it is derived: `pipefill bench rollout` measures, per sequences in one group `b`,
/// the target's decode step, its verification of K+1 positions and the drafter's proposal
/// (one thread, medians), and speculation pays at `b` while
/// `acceptance × decode(b) > propose(b) + verify(b)`; the threshold is the live batch up to
/// which the engine's groups hold at most the largest paying `b` ([`live_threshold`]). The
/// default is where that held on the reference machine: one sequence per group × 4 groups at
/// `d_model` 256, one group of 4 at `d_model` 512 (docs/benchmarks.md, "Speculation
/// threshold"). The costs move with the machine's load and the drafter's acceptance: rerun
/// the bench per machine.
pub const DEFAULT_SPEC_THRESHOLD: usize = 4;

/// When to speculate.
#[derive(Clone, Debug, PartialEq)]
pub enum Speculation {
    /// Plain decoding.
    Off,
    /// Always draft `k` tokens.
    Fixed { k: usize },
    /// Speculate while the live batch is small; K chosen by a bandit.
    Adaptive(AdaptiveConfig),
    /// Always draft a tree of this shape.
    Tree(TreeShape),
}

/// The adaptive engine's knobs.
#[derive(Clone, Debug, PartialEq)]
pub struct AdaptiveConfig {
    /// Speculate only while at most this many sequences are live.
    pub threshold: usize,
    /// The draft lengths the bandit chooses from; 0 is a plain decode step (an arm with
    /// which each live-batch bucket learns whether speculating pays there at all).
    pub ks: Vec<usize>,
    /// Probability of a random K.
    pub epsilon: f64,
    /// Rewards per arm the median is taken over.
    pub window: usize,
    /// Draft trees instead of chains: a step with K ≥ 1 drafts a tree `K` levels deep (the
    /// shape's `depth` is the bandit's K) with the shape's `branch`, `width` and `nodes`.
    pub tree: Option<TreeShape>,
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        AdaptiveConfig {
            threshold: DEFAULT_SPEC_THRESHOLD,
            ks: vec![1, 2, 3, 4, 6],
            epsilon: 0.1,
            window: 8,
            tree: None,
        }
    }
}

/// One rollout's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutConfig {
    /// The end-of-sequence token (kept in the completion).
    pub eos: u32,
    /// 0: greedy; otherwise sampling from `softmax(logits / temperature)`.
    pub temperature: f32,
    /// Groups of sequences in flight through the stages at once.
    pub groups: usize,
    /// Seeds sampling (one stream per sequence) and the bandit.
    pub seed: u64,
    pub speculation: Speculation,
    /// Keep each finished sequence's hidden states and target distributions as a
    /// [`DraftRow`] (training rows for the drafter).
    pub record_rows: bool,
    /// Target step recorded in the rows.
    pub step: u64,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            eos: crate::data::tokenizer::EOS,
            temperature: 0.0,
            groups: 4,
            seed: 0,
            speculation: Speculation::Off,
            record_rows: false,
            step: 0,
        }
    }
}

/// One sequence to generate: a prompt and at most `max_new` new tokens (also capped by the
/// model's learned positions).
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_new: usize,
}

/// The live batch after a group step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LivePoint {
    /// Seconds since the rollout started.
    pub t: f64,
    pub live: usize,
    /// Tokens generated so far.
    pub tokens: usize,
}

/// One group step as the driver saw it: what the bench's per-bucket cost model is checked
/// against (which step ran at which live batch, and what it cost).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StepRecord {
    /// Seconds since the rollout started when its results came back.
    pub t: f64,
    /// Live sequences when it was launched.
    pub live: usize,
    /// Sequences in the step.
    pub sequences: usize,
    /// Positions its sequences had cached when it was launched (their mean, rounded
    /// down): a step's attention, and so its cost, grows with it.
    pub context: usize,
    pub kind: WorkKind,
    /// Tokens it emitted.
    pub emitted: usize,
    /// Groups in flight once it was launched (itself included).
    pub in_flight: usize,
    /// Driver time drafting for it.
    pub drafting_s: f64,
    /// Compute time of every stage on it (not its time queued behind other groups).
    pub compute_s: f64,
    /// From its launch (drafting done) to its results.
    pub latency_s: f64,
}

/// Figures of one rollout.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RolloutStats {
    /// Tokens generated (EOS included).
    pub tokens: usize,
    pub seconds: f64,
    /// Group steps (messages through the whole pipeline).
    pub steps: usize,
    /// Per-sequence verifications, draft tokens proposed, draft tokens accepted.
    pub verifications: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// Compute time of each stage, on its thread or the driver's (the rest is idle: bubbles).
    pub stage_busy_s: Vec<f64>,
    /// The long tail: from the first moment at most a quarter of the batch is live.
    pub tail_start_s: f64,
    pub tail_tokens: usize,
    /// Driver time spent drafting (the proposer's calls).
    pub propose_s: f64,
    /// Driver time spent turning logits into tokens (sampling, acceptance, bookkeeping).
    pub absorb_s: f64,
}

impl RolloutStats {
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.seconds.max(1e-9)
    }
    /// Tokens per second in the long tail.
    pub fn tail_tokens_per_s(&self) -> f64 {
        self.tail_tokens as f64 / (self.seconds - self.tail_start_s).max(1e-9)
    }
    /// Mean tokens emitted per verification (accepted drafts + the bonus token); 1 is what
    /// plain decoding emits per step.
    pub fn acceptance_length(&self) -> f64 {
        if self.verifications == 0 {
            return 1.0;
        }
        (self.accepted + self.verifications) as f64 / self.verifications as f64
    }
}

/// What a rollout produced.
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutOutput {
    /// Prompt + completion of each request, in request order.
    pub sequences: Vec<Vec<u32>>,
    /// Where each completion starts in its sequence.
    pub prompt_lens: Vec<usize>,
    /// Drafter training rows (when `record_rows`), in request order.
    pub rows: Vec<DraftRow>,
    pub stats: RolloutStats,
    pub live_curve: Vec<LivePoint>,
    /// Every group step, in the order their results came back.
    pub steps: Vec<StepRecord>,
    /// The bandit's choices (adaptive speculation).
    pub choices: Vec<Choice>,
}

impl RolloutOutput {
    /// The generated tokens of request `i`.
    pub fn completion(&self, i: usize) -> &[u32] {
        &self.sequences[i][self.prompt_lens[i]..]
    }

    /// [`tail_share`] of this rollout.
    pub fn tail_share(&self) -> f64 {
        tail_share(&self.live_curve, self.sequences.len(), self.stats.seconds)
    }
}

/// Share of a rollout's `seconds` after only the longest 10% of its `sequences` are live
/// (from the first point of `curve` with at most a tenth of them live to the end): how long
/// its tail is, in the terms of the TLT issue (at least half, for reasoning rollouts).
pub fn tail_share(curve: &[LivePoint], sequences: usize, seconds: f64) -> f64 {
    let tenth = (sequences / 10).max(1);
    let total = seconds.max(1e-9);
    curve
        .iter()
        .find(|p| p.live <= tenth)
        .map_or(0.0, |p| (total - p.t) / total)
}

/// The pipeline's inference stages, ready to generate.
pub struct RolloutEngine<B: Backend> {
    stages: Vec<InferStage<B>>,
    hook: Option<Arc<dyn MessageHook>>,
    /// The adaptive engine's K bandit, kept across runs: a rollout's long tail gives it
    /// only a few choices per live-batch bucket, too few to leave exploration.
    bandit: Option<KBandit>,
    min_group_rows: usize,
    /// Whether a lone group runs through every stage on the driver's thread (see
    /// [`RolloutEngine::with_inline_tail`]).
    inline_tail: bool,
    /// Most stage threads without a hook (see [`RolloutEngine::with_workers`]).
    workers: usize,
}

impl<B: Backend> RolloutEngine<B> {
    /// An engine over `stages` (first with the embedding, last with the head, in order).
    pub fn new(stages: Vec<InferStage<B>>) -> Result<Self, RlError> {
        let ok = !stages.is_empty()
            && stages[0].is_first()
            && stages[stages.len() - 1].is_last()
            && stages
                .windows(2)
                .all(|w| w[0].blocks().end == w[1].blocks().start);
        if !ok {
            return Err(RlError::RolloutConfig {
                field: "stages",
                reason: "must be the model's stages in order, embedding first, head last".into(),
            });
        }
        Ok(RolloutEngine {
            stages,
            hook: None,
            bandit: None,
            min_group_rows: MIN_GROUP_ROWS,
            inline_tail: true,
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
        })
    }

    /// Goes on with `bandit` (one a previous engine learned) under adaptive speculation;
    /// a bandit built for other arms or knobs is replaced by a fresh one.
    pub fn with_bandit(mut self, bandit: KBandit) -> Self {
        self.bandit = Some(bandit);
        self
    }

    /// The K bandit adaptive runs have trained so far (for the next engine).
    pub fn take_bandit(&mut self) -> Option<KBandit> {
        self.bandit.take()
    }

    /// Splits the live batch into no groups whose steps carry fewer than `rows` positions
    /// (default [`MIN_GROUP_ROWS`]; 1: as many groups as `groups` allows, however small).
    pub fn with_min_group_rows(mut self, rows: usize) -> Self {
        self.min_group_rows = rows.max(1);
        self
    }

    /// Whether a step that would be the only group in flight (the long tail) runs through
    /// every stage's layers on the driver's thread instead of crossing the stage threads
    /// (default on; never with a hook, whose routing and idle work live on the stage
    /// threads). With one group in flight the stages run one after another anyway, so the
    /// pipeline gains nothing and each hand-off costs a thread wake-up, which on a loaded
    /// machine waits for a core (docs/benchmarks.md, "Reaching the cost model").
    pub fn with_inline_tail(mut self, on: bool) -> Self {
        self.inline_tail = on;
        self
    }

    /// Runs the stages on at most `workers` threads, each a run of consecutive stages, and
    /// plain decode steps in at most that many groups (default: the machine's cores; never
    /// with a hook, whose routing and idle work are per stage). A plain step leaves the
    /// driver nothing to overlap, so groups beyond the threads only queue; on two cores
    /// four groups on four stage threads ran the wide plain steps about a fifth below their
    /// measured cost, two on two at it. Verifications keep `groups`: the driver drafts for
    /// one group while the others compute (docs/benchmarks.md, "Step costs at the first
    /// steps' caches").
    pub fn with_workers(mut self, workers: usize) -> Self {
        self.workers = workers.max(1);
        self
    }

    /// Files every stage message with `hook` (e.g. a bubble router).
    pub fn with_hook(mut self, hook: Arc<dyn MessageHook>) -> Self {
        self.hook = Some(hook);
        self
    }

    pub fn stages(&self) -> &[InferStage<B>] {
        &self.stages
    }

    /// Generates a completion for every request.
    pub fn run(
        &mut self,
        requests: &[Request],
        config: &RolloutConfig,
        proposer: Option<&mut dyn Proposer>,
    ) -> Result<RolloutOutput, RlError> {
        let model = self.stages[0].config().clone();
        check(
            requests,
            config,
            proposer.is_some(),
            model.seq_len,
            model.vocab,
        )?;
        let n_stages = self.stages.len();
        let hook = self.hook.clone();
        let bandit = match &config.speculation {
            Speculation::Adaptive(a) => Some(match self.bandit.take() {
                Some(b) if b.fits(&a.ks, a.epsilon, a.window) => b,
                _ => KBandit::new(a.ks.clone(), a.epsilon, a.window, config.seed ^ 0xb4d1),
            }),
            _ => None,
        };
        let (drv_tx, drv_rx) = mpsc::channel();
        let inline = self.inline_tail && hook.is_none();
        // Each stage thread holds its stage's lock only while it runs a message, so that
        // the driver can run a lone group through all of them in turn.
        let stages: Vec<Mutex<&mut InferStage<B>>> =
            self.stages.iter_mut().map(Mutex::new).collect();
        let workers = match hook {
            Some(_) => n_stages,
            None => n_stages.min(self.workers),
        };
        // Thread `w`'s stages: an even share, in order.
        let runs: Vec<_> = (0..workers)
            .map(|w| w * n_stages / workers..(w + 1) * n_stages / workers)
            .collect();
        std::thread::scope(|scope| {
            let (mut txs, mut rxs) = (Vec::new(), Vec::new());
            for _ in 0..workers {
                let (tx, rx) = mpsc::channel::<Msg<B>>();
                txs.push(tx);
                rxs.push(rx);
            }
            let handles: Vec<_> = runs
                .iter()
                .zip(rxs)
                .enumerate()
                .map(|(w, (run, rx))| {
                    let next = txs.get(w + 1).cloned();
                    let (drv, hook) = (drv_tx.clone(), hook.clone());
                    let (first, run) = (run.start, &stages[run.clone()]);
                    scope.spawn(move || stage_loop(first, run, rx, next, drv, hook))
                })
                .collect();
            let first = txs.swap_remove(0);
            drop(txs);
            drop(drv_tx);
            // No more plain groups than threads; with a hook (a thread per stage) `groups`.
            let plain_groups = match hook {
                Some(_) => config.groups,
                None => workers,
            };
            let mut driver = Driver::new(
                requests,
                config,
                model.d_model,
                model.vocab,
                model.seq_len,
                bandit,
                self.min_group_rows,
            )
            .with_plain_groups(plain_groups)
            .with_hook(hook.clone());
            let inline = inline.then_some(stages.as_slice());
            let result = driver.run(&first, &drv_rx, inline, proposer);
            drop(first);
            let busy: Vec<f64> = handles
                .into_iter()
                .zip(&runs)
                .flat_map(|(h, run)| match h.join() {
                    Ok(busy) => busy.iter().map(Duration::as_secs_f64).collect(),
                    Err(_) => vec![f64::NAN; run.len()],
                })
                .collect();
            result.map(|()| driver.finish(busy))
        })
        .map(|(rollout, bandit)| {
            if bandit.is_some() {
                self.bandit = bandit;
            }
            rollout
        })
    }
}

fn check(
    requests: &[Request],
    config: &RolloutConfig,
    has_proposer: bool,
    seq_len: usize,
    vocab: usize,
) -> Result<(), RlError> {
    let bad = |field, reason: String| Err(RlError::RolloutConfig { field, reason });
    if config.groups == 0 {
        return bad("groups", "must be at least 1".into());
    }
    if !(config.temperature >= 0.0 && config.temperature.is_finite()) {
        return bad(
            "temperature",
            format!("{} is not a finite number ≥ 0", config.temperature),
        );
    }
    match &config.speculation {
        Speculation::Off => {}
        _ if !has_proposer => return bad("speculation", "needs a proposer".into()),
        Speculation::Fixed { k: 0 } => return bad("speculation.k", "must be at least 1".into()),
        Speculation::Tree(shape) => {
            if let Some((field, reason)) = shape.check() {
                return Err(RlError::RolloutConfig {
                    field: tree_field(field),
                    reason,
                });
            }
        }
        Speculation::Adaptive(AdaptiveConfig {
            tree: Some(shape), ..
        }) if let Some((field, reason)) = (TreeShape { depth: 1, ..*shape }).check() => {
            return Err(RlError::RolloutConfig {
                field: tree_field(field),
                reason,
            });
        }
        Speculation::Adaptive(a) if !a.ks.iter().any(|&k| k >= 1) => {
            return bad(
                "speculation.ks",
                format!("{:?}: need a draft length ≥ 1 (0 is plain decoding)", a.ks),
            );
        }
        _ => {}
    }
    // A draft is verified in one pass over positions the model has: a longer one could
    // never be used, and its buffers are sized by it.
    let (field, longest) = match &config.speculation {
        Speculation::Off => ("speculation", 0),
        Speculation::Fixed { k } => ("speculation.k", *k),
        Speculation::Tree(shape) => ("speculation.tree.depth", shape.depth),
        Speculation::Adaptive(a) => ("speculation.ks", a.ks.iter().copied().max().unwrap_or(0)),
    };
    if longest >= seq_len {
        return bad(
            field,
            format!("a draft of {longest} tokens does not fit the model's {seq_len} positions"),
        );
    }
    for (index, r) in requests.iter().enumerate() {
        let reason = if r.prompt.is_empty() {
            "empty prompt".to_string()
        } else if r.prompt.len() >= seq_len {
            format!(
                "prompt of {} tokens leaves no room in {seq_len} positions",
                r.prompt.len()
            )
        } else if let Some(t) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
            format!("token {t} is outside the vocabulary {vocab}")
        } else {
            continue;
        };
        return Err(RlError::Request { index, reason });
    }
    Ok(())
}

/// The config path of a [`TreeShape`] field.
fn tree_field(field: &str) -> &'static str {
    match field {
        "depth" => "speculation.tree.depth",
        "branch" => "speculation.tree.branch",
        "width" => "speculation.tree.width",
        _ => "speculation.tree.nodes",
    }
}

#[cfg(test)]
mod tests;
