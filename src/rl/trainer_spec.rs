//! [`PipelineRollouts`]: the RL loop's rollouts through the rollout engine
//! ([`super::rollout`]): the policy cut into the job's stages, groups of sequences in
//! flight one behind another, and, with `rl.speculation`, lossless speculative decoding
//! whose draft length a bandit picks while the live batch is at most `rl.spec_threshold`.
//! With `rl.advanced.plain_arm` the bandit may also choose a plain step (K = 0) in each live-batch
//! bucket, so that where speculation does not pay it learns to stop.
//!
//! `rl.spec_threshold = "auto"` derives the threshold from measurement
//! ([`crate::rl::calibrate`]): the policy's decode and verification and the drafter's
//! proposal are timed once, on the first policy (a fraction of a second), and before every
//! rollout the threshold follows from those costs and the drafter's per-token acceptance
//! measured on rows it never trained on: the last step's held-out rows, before the first
//! step the `--init` checkpoint's held-out rows (none: no speculation until one step has
//! measured it). When speculation cannot pay on the target at all (not even with every
//! draft accepted), the rollouts decode plainly and the drafter is left alone.
//!
//! The drafter adapts to the moving policy: every rollout records its sequences' final
//! hidden states and next-token distributions ([`DraftRow`]s, computed anyway), and the
//! drafter trains `drafter_slices` slices per step on them (this step's rows and the
//! previous step's, [`crate::model::drafter::DraftBuffer`]), with its frozen embedding and
//! head refreshed from the new policy before the rollout: one snapshot, which the trainer
//! and the proposer share ([`crate::model::drafter::FrozenTables`]). With `rl.advanced.drafter_work` `"idle"` (or `"idle-then-after"`) the
//! slices run inside the rollout, in the stages' idle time of the long tail: a
//! [`RolloutRouter`] files the verification passes with a [`FillerRouter`] kept across
//! steps (its cost estimates carry over), whose [`DrafterSlices`] sources cut the step's
//! slices into pieces sized to the stages' idle gaps (one optimizer step per slice's worth
//! of rows, as whole slices take), and each finished sequence's row reaches the buffer at
//! once. What the gaps do not take goes by `rl.advanced.drafter_work`: with `"idle"` (the
//! default) it is carried into the next step's idle budget (at most one step's budget) and
//! the held-out evaluation runs in the gaps too, so nothing of the drafter runs after the
//! rollout (the router's priors, which `"idle-then-after"` takes from the slices run there,
//! are measured once before the first rollout instead); with `"idle-then-after"` it runs on
//! the caller's thread after the rollout, on the critical path (reported as
//! `drafter_seconds`; on a thread of its own beside the update it slowed the update by more
//! than its own time on the reference machine, docs/benchmarks.md). Each step's
//! `drafter_work` says what ran where. The drafter starts from the policy's own run's
//! drafter when that run trained one in its pipeline's bubbles
//! ([`PipelineRollouts::with_drafter`]), as TLT starts RL with a drafter that already
//! follows the policy, and then trains at the lower `rl.drafter_lr`; otherwise untrained,
//! at `drafter.lr`. The drafter that proposes during a rollout is a copy loaded before it,
//! so training never changes what a rollout samples. With speculation off no drafter is
//! recorded or trained.
//!
//! Speculation never changes what is sampled (acceptance is lossless), so the reward curve
//! is the same in distribution with it on or off; only the time differs.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use pipefill_actors::FillerRouter;

use super::bandit::KBandit;
use super::calibrate::Calibration;
use super::config::{DrafterLeftover, SpecThreshold};
use super::generator::{Rollout, RolloutBatch, RolloutGenerator, RolloutRequest};
use super::rollout::idle::{DrafterAccount, DrafterSlices, EvalWork, RolloutRouter};
use super::rollout::{
    AdaptiveConfig, DEFAULT_SPEC_THRESHOLD, MessageHook, Request, RolloutConfig,
    RolloutEngine as Engine, Speculation,
};
use super::speculative::Proposer;
use crate::config::JobConfig;
use crate::data::SplitMix64;
use crate::model::ModelError;
use crate::model::drafter::state::{BufferState, DrafterState};
use crate::model::drafter::{
    DraftBufferHandle, DraftRow, Drafter, DrafterConfig, DrafterTrainer, EvalStats,
};
use crate::model::infer::InferStage;
use crate::model::{Cut, Gpt};
use crate::rl::RlError;
use crate::rl::config::RlConfig;
use crate::tensor::CpuBackend;
use crate::tensor::device::RankBackend;

/// Rows of each step held out of the drafter's training to measure its agreement.
const HELD_OUT_ROWS: usize = 4;
/// Rows of the `--init` checkpoint's held-out buffer the acceptance prior is measured on.
const PRIOR_ROWS: usize = 8;
/// Repetitions per cost of the start-up calibration (the bench takes 9), which runs once per
/// start (its time at `d_model` 256: docs/benchmarks.md).
const CALIBRATION_REPS: usize = 3;

/// The live-batch threshold of one rollout, and where it came from.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ThresholdChoice {
    /// Speculate while at most this many sequences are live (0: not in this rollout).
    pub threshold: usize,
    /// `rl.spec_threshold`, `calibrated`, `cannot pay` (speculation off for the run),
    /// `no acceptance measured yet` or `draft trees: not calibrated`.
    pub source: &'static str,
    /// The drafter's per-token acceptance α a calibrated threshold was derived with.
    pub alpha: Option<f64>,
    /// Where α was measured.
    pub alpha_from: Option<&'static str>,
}

/// Rollouts through the pipelined rollout engine, speculative or plain, with a drafter
/// trained on every step's rollouts; the drafter computes on the policy's backend `B`.
pub struct PipelineRollouts<B: RankBackend = CpuBackend> {
    rl: RlConfig,
    stages: usize,
    speculation: Speculation,
    /// Trains on the rollouts' rows (shared with the router's drafter source).
    trainer: Arc<Mutex<DrafterTrainer<B>>>,
    /// Proposes during the rollout, loaded with the trainer's weights before each one.
    proposer: Drafter<B>,
    /// Routes the stages' idle work, across steps.
    router: FillerRouter,
    /// The trainer's work as the router's sources, a step's budget at a time.
    slices: DrafterSlices<B>,
    /// The adaptive engine's K bandit, carried from step to step (each step builds a new
    /// engine for the new policy).
    bandit: Option<KBandit>,
    /// With `rl.spec_threshold = "auto"`: the step costs measured on the first policy.
    calibration: Option<Calibration>,
    /// The drafter's per-token acceptance on rows it never trained on, and which rows.
    alpha: Option<(f64, &'static str)>,
    /// The last step measured no α (`rl.advanced.drafter_work = "idle"`: its gaps evaluated
    /// no held-out row), so the next one must.
    alpha_stale: bool,
    /// The threshold of the latest rollout.
    threshold: Option<ThresholdChoice>,
    /// The latest rollout's held-out rows (the drafter never trained on them when they were
    /// evaluated): a checkpoint's acceptance prior ([`Self::drafter_state`]).
    held_out: Vec<DraftRow>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl PipelineRollouts<CpuBackend> {
    /// The engine for `job`'s `[rl]` on the CPU: its model cut into `job.stages` stages,
    /// its `[drafter]` trained on the rollouts.
    pub fn new(job: &JobConfig) -> Result<Self, RlError> {
        let backend = CpuBackend::for_rank(0, job.train.precision).map_err(ModelError::from)?;
        PipelineRollouts::on(job, backend)
    }
}

impl<B: RankBackend> PipelineRollouts<B> {
    /// [`PipelineRollouts::new`] with the drafter (trainer and proposer) on `backend`, the
    /// policy's: one stream for rank 0's work.
    pub fn on(job: &JobConfig, backend: B) -> Result<Self, RlError> {
        let (model, rl, stages) = (&job.model, &job.rl, job.stages);
        let config: &DrafterConfig = &job.drafter;
        config.validate()?;
        let buffer = DraftBufferHandle::new(model, config);
        let drafter = Drafter::new(model, config, backend.clone())?;
        let trainer = DrafterTrainer::new(drafter, buffer, 0, 1)?;
        let speculation = if rl.speculation {
            let threshold = match rl.spec_threshold {
                SpecThreshold::Live(n) => n,
                SpecThreshold::Auto if rl.draft_tree.is_some() => DEFAULT_SPEC_THRESHOLD,
                // Set from the calibration before each rollout.
                SpecThreshold::Auto => 0,
            };
            let plain = usize::from(!rl.advanced.plain_arm);
            Speculation::Adaptive(AdaptiveConfig {
                threshold,
                ks: (plain..=rl.draft_k).collect(),
                tree: rl.tree_shape(),
                ..AdaptiveConfig::default()
            })
        } else {
            Speculation::Off
        };
        let mut proposer = Drafter::new(model, config, backend)?;
        proposer.share_frozen(&trainer.drafter().frozen())?;
        let trainer = Arc::new(Mutex::new(trainer));
        let router = FillerRouter::default();
        Ok(PipelineRollouts {
            proposer,
            rl: rl.clone(),
            stages,
            speculation,
            slices: DrafterSlices::new(Arc::clone(&trainer), &router),
            trainer,
            router,
            bandit: None,
            calibration: None,
            alpha: None,
            alpha_stale: false,
            threshold: None,
            held_out: Vec::new(),
        })
    }
}

impl<B: RankBackend> PipelineRollouts<B> {
    /// Starts the drafter from `state` (an `--init` run's, trained in its pipeline's
    /// bubbles) instead of untrained: its weights and optimizer moments, and from now on
    /// `rl.drafter_lr` instead of `drafter.lr` (a trained drafter only follows the policy;
    /// see [`RlConfig::drafter_lr`]). The buffer starts empty (its rows were the supervised
    /// data, not this policy's rollouts), and the frozen embedding and head copies are
    /// refreshed from the policy before every rollout anyway. Without a warm start the
    /// drafter begins RL knowing nothing, so the first steps' acceptance is near 1 and
    /// speculation only costs.
    ///
    /// Its per-token acceptance on the checkpoint's held-out rows (a few) is the prior of a
    /// calibrated threshold until the first step has measured it on the policy's rollouts.
    pub fn with_drafter(mut self, state: &DrafterState) -> Result<Self, RlError> {
        let mut trainer = lock(&self.trainer);
        trainer.load_weights(&state.weights)?;
        trainer.load_optimizer_state(&state.optimizer)?;
        trainer.set_lr(self.rl.drafter_lr)?;
        let held = &state.held_out;
        let rows: Vec<DraftRow> = (held.current.iter().rev().chain(held.previous.iter().rev()))
            .take(PRIOR_ROWS)
            .cloned()
            .collect();
        // No held-out pair (an empty buffer): no prior, as without a trained drafter.
        if let Ok(stats) = trainer.evaluate(&rows) {
            self.alpha = Some((stats.overlap, "the starting checkpoint's held-out rows"));
        }
        drop(trainer);
        Ok(self)
    }

    /// The drafter's state now, as a checkpoint keeps it (what [`Self::with_drafter`] starts
    /// from): its weights, moments and row sampler, the rollouts' rows in its buffer, and the
    /// latest rollout's held-out rows. After an RL run it has followed the policy, so the
    /// run's checkpoint keeps it rather than the one the run started from.
    pub fn drafter_state(&self) -> Result<DrafterState, RlError> {
        let trainer = lock(&self.trainer);
        let (weights, optimizer) = trainer.export_state()?;
        let buffer = BufferState::of(&trainer.buffer().lock());
        Ok(DrafterState {
            weights,
            optimizer,
            samplers: vec![trainer.sampler()],
            held_out: BufferState {
                step: buffer.step,
                previous: Vec::new(),
                current: self.held_out.clone(),
            },
            buffer,
            round: None,
        })
    }

    /// Whether the threshold is calibrated here (`rl.spec_threshold = "auto"`, speculating
    /// with chains: trees keep the default, their step costs not being modelled).
    fn auto_threshold(&self) -> bool {
        self.rl.spec_threshold == SpecThreshold::Auto
            && self.rl.speculation
            && self.rl.draft_tree.is_none()
    }

    /// With `rl.spec_threshold = "auto"`, measures the step costs on `policy` and the
    /// drafter, once (later calls return the first measurement); `None` otherwise. If
    /// speculation cannot pay on this target, the rollouts decode plainly from now on.
    pub fn calibrate(&mut self, policy: &Gpt<B>) -> Result<Option<&Calibration>, RlError> {
        if self.auto_threshold() && self.calibration.is_none() {
            let ks: Vec<usize> = (1..=self.rl.draft_k).collect();
            let groups = self.stages.max(1);
            let sequences = self.rl.sequences();
            // The proposer's weights do not change what a proposal costs; before each
            // rollout they are reloaded anyway.
            let c = Calibration::measure(
                policy,
                &mut self.proposer,
                &ks,
                sequences,
                groups,
                self.rl.advanced.min_group_rows,
                CALIBRATION_REPS,
            )?;
            if !c.can_pay() {
                self.speculation = Speculation::Off;
            }
            self.calibration = Some(c);
        }
        Ok(self.calibration.as_ref())
    }

    /// The threshold the next rollout uses (and, after a rollout, the one it used).
    pub fn next_threshold(&self) -> Option<ThresholdChoice> {
        let Speculation::Adaptive(a) = &self.speculation else {
            return self.calibration.as_ref().map(|_| ThresholdChoice {
                threshold: 0,
                source: "cannot pay",
                alpha: None,
                alpha_from: None,
            });
        };
        let choice = |threshold, source| ThresholdChoice {
            threshold,
            source,
            alpha: None,
            alpha_from: None,
        };
        Some(match (&self.calibration, self.alpha) {
            _ if !self.auto_threshold() && self.rl.spec_threshold == SpecThreshold::Auto => {
                choice(a.threshold, "draft trees: not calibrated")
            }
            (None, _) => choice(a.threshold, "rl.spec_threshold"),
            (Some(_), None) => choice(0, "no acceptance measured yet"),
            (Some(c), Some((alpha, from))) => ThresholdChoice {
                threshold: c.threshold(alpha, a.epsilon, a.ks.contains(&0)),
                source: "calibrated",
                alpha: Some(alpha),
                alpha_from: Some(from),
            },
        })
    }

    /// The threshold of the latest rollout (`None` before the first, or without
    /// speculation).
    pub fn threshold(&self) -> Option<&ThresholdChoice> {
        self.threshold.as_ref()
    }

    /// The step costs measured by [`Self::calibrate`].
    pub fn calibration(&self) -> Option<&Calibration> {
        self.calibration.as_ref()
    }

    /// The drafter trainer's learning rate now (`rl.drafter_lr` once warm-started).
    pub fn drafter_lr(&self) -> f32 {
        lock(&self.trainer).lr()
    }

    /// This step's idle-work hook: the step's drafter budget set, rows sent to the drafter's
    /// buffer as sequences finish. With `"idle-then-after"` the router's priors come from the slices
    /// measured after earlier rollouts (kept once the router measured its own); with
    /// `"idle"` the budget adds what the last step carried, the held-out rows are evaluated
    /// in the gaps, and the priors are measured before the first rollout: the seconds that
    /// took are returned (0 later).
    fn idle_router(&mut self) -> Result<(RolloutRouter, f64), RlError> {
        let buffer = lock(&self.trainer).buffer().clone();
        let startup = match self.rl.advanced.drafter_work.leftover() {
            DrafterLeftover::After => {
                self.slices.begin(self.rl.drafter_slices, &self.router);
                0.0
            }
            DrafterLeftover::Defer => {
                let priors = self.slices.measure_priors(&self.router)?;
                if let Some(p) = &priors {
                    tracing::info!(
                        "drafter idle-work priors ({:.3} s): pieces of {}/{} rows {:.2}/{:.2} \
                         ms, step {:.2} ms, eval {}/{} positions {:.2}/{:.2} ms",
                        p.seconds,
                        p.small_rows,
                        p.large_rows,
                        1e3 * p.small,
                        1e3 * p.large,
                        1e3 * p.step,
                        p.short_len,
                        p.long_len,
                        1e3 * p.eval_short,
                        1e3 * p.eval_long
                    );
                }
                self.slices
                    .begin_carrying(self.rl.drafter_slices, &self.router);
                priors.map_or(0.0, |p| p.seconds)
            }
        };
        let hook = RolloutRouter::new(self.router.clone(), self.stages.max(1), true)
            .with_rows(buffer, HELD_OUT_ROWS)
            .with_drafter(self.slices.clone());
        Ok((hook, startup))
    }

    /// The drafter's share of a step after its idle-routed rollout: its held-out figures and
    /// what it did where. `"idle-then-after"`: the held-out rows evaluated, then what the
    /// stages' idle time left of the budget, here on the critical path; `"idle"`: nothing runs,
    /// the budget's rest is carried (the figures are those the gaps measured).
    fn drafter_after_rollout(
        &mut self,
        hook: &RolloutRouter,
    ) -> Result<(Option<EvalStats>, DrafterAccount), RlError> {
        let held = hook.held_out();
        let done = match self.rl.advanced.drafter_work.leftover() {
            DrafterLeftover::After => {
                // The router sent every row but the held-out ones to the buffer already.
                let t = Instant::now();
                let stats = self.drafter_work(&held, &held, 0)?;
                let eval_seconds = t.elapsed().as_secs_f64();
                let mut account = self.slices.account();
                account.after = self.slices.finish()?;
                account.eval_after = EvalWork {
                    pieces: 1,
                    rows: held.len(),
                    seconds: eval_seconds,
                };
                (Some(stats), account)
            }
            DrafterLeftover::Defer => {
                let mut account = self.slices.defer();
                let mut stats = self.slices.held_out_stats();
                // The gaps evaluated no held-out row: the threshold keeps the last α for one
                // step; with none yet, or one already a step old, the rows are evaluated
                // here (a few ms; they reached the buffer, but nothing trained since).
                if stats.is_none() && (self.alpha.is_none() || self.alpha_stale) {
                    let rows: Vec<DraftRow> =
                        held.iter().filter(|r| r.pairs() > 0).cloned().collect();
                    if !rows.is_empty() {
                        let t = Instant::now();
                        stats = Some(lock(&self.trainer).evaluate(&rows)?);
                        account.eval_after = EvalWork {
                            pieces: 1,
                            rows: rows.len(),
                            seconds: t.elapsed().as_secs_f64(),
                        };
                        account.eval_skipped_rows = 0;
                    }
                }
                self.alpha_stale = stats.is_none();
                (stats, account)
            }
        };
        self.held_out = held;
        Ok(done)
    }
}

impl<B: RankBackend> RolloutGenerator<B> for PipelineRollouts<B> {
    fn generate(
        &mut self,
        policy: &Gpt<B>,
        request: RolloutRequest<'_>,
    ) -> Result<RolloutBatch, RlError> {
        let step = request.step;
        if self.auto_threshold() {
            self.calibrate(policy)?;
        }
        self.threshold = self.next_threshold();
        if let (Speculation::Adaptive(a), Some(t)) = (&mut self.speculation, &self.threshold) {
            a.threshold = t.threshold;
        }
        let stages = InferStage::stages_of(policy, &Cut::Even(self.stages))?;
        let mut engine = Engine::new(stages)?.with_min_group_rows(self.rl.advanced.min_group_rows);
        if let Some(b) = self.bandit.take() {
            engine = engine.with_bandit(b);
        }
        let requests: Vec<Request> = request
            .sequence_prompts()
            .map(|p| Request {
                prompt: p.clone(),
                max_new: request.max_new,
            })
            .collect();
        let speculate = !matches!(self.speculation, Speculation::Off);
        let (hook, startup_seconds) =
            match speculate && self.rl.advanced.drafter_work.in_idle_time() {
                true => {
                    let (hook, startup) = self.idle_router()?;
                    (Some(Arc::new(hook)), startup)
                }
                false => (None, 0.0),
            };
        if speculate {
            let mut trainer = lock(&self.trainer);
            // One snapshot of the policy's embedding and head, read by both drafters.
            trainer.drafter_mut().refresh_from_gpt(policy, step)?;
            self.proposer.load_weights(&trainer.weights()?)?;
            self.proposer.share_frozen(&trainer.drafter().frozen())?;
            trainer.buffer().begin_step(step);
        }
        if let Some(h) = &hook {
            engine = engine.with_hook(Arc::clone(h) as Arc<dyn MessageHook>);
        }
        let config = RolloutConfig {
            eos: request.eos,
            temperature: self.rl.temperature,
            groups: self.stages.max(1),
            seed: SplitMix64::derive(self.rl.seed, step).next_u64(),
            speculation: self.speculation.clone(),
            record_rows: speculate,
            step,
        };
        let proposer = speculate.then_some(&mut self.proposer as &mut dyn Proposer);
        let out = engine.run(&requests, &config, proposer)?;
        self.bandit = engine.take_bandit();
        let report = hook.as_ref().map(|h| h.report());

        // The drafter follows the policy: its agreement on rows it never trained on, then
        // (`"idle-then-after"`) the slices the stages' idle time did not take. Without speculation
        // nothing would use it, so it is left alone.
        let drafted = Instant::now();
        let (agreement, account) = match (&hook, speculate) {
            (Some(h), true) => {
                let (stats, mut account) = self.drafter_after_rollout(h)?;
                account.startup_seconds = startup_seconds;
                (stats, Some(account))
            }
            (None, true) => (Some(self.follow_stats(&out.rows, step)?), None),
            _ => (None, None),
        };
        // The next rollout's threshold follows the drafter's acceptance on this policy; a
        // step whose gaps evaluated no held-out row keeps the last figure.
        match (&agreement, self.alpha) {
            (Some(stats), _) => {
                self.alpha = Some((stats.overlap, "the last step's held-out rows"));
            }
            (None, Some((alpha, from))) if speculate && from == "the last step's held-out rows" => {
                self.alpha = Some((alpha, "an earlier step's held-out rows"));
            }
            _ => {}
        }
        let agreement = agreement.map(|s| s.agreement);
        // On the critical path: what ran here after the rollout, and the one-off priors.
        let drafter_seconds = drafted.elapsed().as_secs_f64() + startup_seconds;

        let rollouts = (0..requests.len())
            .map(|i| Rollout {
                prompt: out.sequences[i][..out.prompt_lens[i]].to_vec(),
                generated: out.completion(i).to_vec(),
            })
            .collect();
        let s = &out.stats;
        let chosen_k = (!out.choices.is_empty()).then(|| {
            out.choices.iter().map(|c| c.k as f64).sum::<f64>() / out.choices.len() as f64
        });
        Ok(RolloutBatch {
            rollouts,
            live_batch: out.live_curve.iter().map(|p| p.live).collect(),
            tail_share: Some(out.tail_share()),
            acceptance_length: (s.verifications > 0).then(|| s.acceptance_length()),
            chosen_k,
            drafter_agreement: agreement,
            drafter_seconds,
            idle_seconds: report.as_ref().map(|_| {
                (s.stage_busy_s.iter())
                    .map(|b| (s.seconds - b).max(0.0))
                    .sum()
            }),
            idle_filled_seconds: report.as_ref().map(|r| r.filled_total()),
            idle_drafter_slices: report.map_or(0, |r| r.drafter_slices),
            drafter_work: account,
        })
    }

    fn speculative(&self) -> bool {
        !matches!(self.speculation, Speculation::Off)
    }
}

impl<B: RankBackend> PipelineRollouts<B> {
    /// The drafter's share of a step on a rollout's `rows`, without the idle router: its
    /// agreement on the first few (held out: it never trained on them), then every row into
    /// the buffer (the previous step's rows stay) and `rl.drafter_slices` slices. What
    /// [`RolloutGenerator::generate`] does after a rollout when `rl.advanced.drafter_work = "after"`; public so
    /// that how the drafter follows a moving policy can be checked on rows alone.
    pub fn follow(&mut self, rows: &[DraftRow], step: u64) -> Result<f64, RlError> {
        Ok(self.follow_stats(rows, step)?.agreement)
    }

    /// [`Self::follow`] with all the held-out figures.
    fn follow_stats(&mut self, rows: &[DraftRow], step: u64) -> Result<EvalStats, RlError> {
        lock(&self.trainer).buffer().begin_step(step);
        let held = &rows[..HELD_OUT_ROWS.min(rows.len())];
        self.held_out = held.to_vec();
        self.drafter_work(held, rows, self.rl.drafter_slices as u64)
    }

    /// The drafter's agreement and acceptance on `held`, then `late` rows into the buffer
    /// (after: they may include `held`) and `slices` slices.
    fn drafter_work(
        &mut self,
        held: &[DraftRow],
        late: &[DraftRow],
        slices: u64,
    ) -> Result<EvalStats, RlError> {
        let mut trainer = lock(&self.trainer);
        let stats = trainer.evaluate(held)?;
        {
            let buffer = trainer.buffer().clone();
            let mut b = buffer.lock();
            for row in late {
                b.push(row.clone())?;
            }
        }
        for _ in 0..slices {
            trainer.slice()?;
        }
        Ok(stats)
    }

    /// The drafter's agreement and losses on `rows` (see [`DrafterTrainer::evaluate`]).
    pub fn evaluate_drafter(&mut self, rows: &[DraftRow]) -> Result<EvalStats, RlError> {
        Ok(lock(&self.trainer).evaluate(rows)?)
    }
}
