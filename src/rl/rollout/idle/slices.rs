//! The drafter's training cut to the rollout stages' idle gaps: [`DrafterSlices`].
//!
//! In the long tail a stage's idle time comes in many short gaps (while the other stages
//! and the driver handle the few groups in flight), each several times shorter than a whole
//! drafter slice (`drafter.batch_rows` windows of `drafter.max_positions`; figures in
//! docs/benchmarks.md, "Drafter training in the rollout's idle gaps"): a whole slice never
//! fits a gap, and running one anyway holds the next message back by as much. So the step's
//! budget of `rl.drafter_slices` slices is trained in **pieces** sized to the gaps, through
//! two sources of the rollout's [`FillerRouter`]:
//!
//! - `"drafter"`: a piece of up to a whole slice's layout rows (units: layout rows, from
//!   [`MIN_PIECE_ROWS`]), sized by the router's cost line to the idle time the stage has
//!   left ([`DrafterTrainer::accumulate_within`]: gradients accumulated, no optimizer step);
//! - `"drafter step"`: the optimizer step, once the pieces since the last one add up to a
//!   whole slice's layout rows ([`DrafterTrainer::step_accumulated`]).
//!
//! So the drafter takes as many optimizer steps per RL step, each over a slice's worth of
//! rows, as when its slices run whole after the rollout: the learning rate keeps its
//! meaning (`rl.drafter_lr` was set against whole slices). One piece or step runs at a time
//! (they share the trainer). What the gaps did not take goes by `rl.advanced.drafter_work`:
//!
//! - `"after"` ([`DrafterSlices::begin`], [`DrafterSlices::finish`]): run on the caller's
//!   thread after the rollout, on the step's critical path;
//! - `"defer"` ([`DrafterSlices::begin_carrying`], [`DrafterSlices::defer`]): carried into
//!   the next step's budget, at most one step's budget (the rest is dropped and counted: a
//!   rollout whose gaps never take the work must not pile it up), and the held-out
//!   evaluation runs in the gaps too (the `"drafter eval"` source, [`super::eval`]): the
//!   drafter then trains only in idle time. Gradients accumulated towards an optimizer step
//!   stay accumulated across the step boundary; the step runs first in the next gaps.
//!
//! The router needs a cost line with a slope to size a piece below the one size it has
//! measured: with `"after"`, before any piece ran in a gap, [`DrafterSlices::begin`] sets a
//! prior line through the last whole slice [`DrafterSlices::finish`] measured (cost
//! proportional to the rows); with `"defer"`, where nothing runs after the rollout, the
//! priors of every kind are measured once before the first rollout on a scratch copy of the
//! drafter ([`super::prior`]). Either way the pieces measured then fit the line's level and
//! slope. Each step's [`DrafterAccount`] says what ran where.
//!
//! What limits it: a piece has a fixed cost (about half of it the GEMM packing the
//! drafter's weight matrices, which a piece of few rows pays as a whole slice does),
//! comparable to the tail's gaps, so only a few pieces fit a step (docs/benchmarks.md,
//! "Drafter training in the rollout's idle gaps"). Cheaper small pieces (weights streamed,
//! not packed, as the proposals' row kernels do) would let more fit.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use pipefill_actors::router::CostEstimate;
use pipefill_actors::{FillerRouter, FillerSource, Slice};
use serde::Serialize;

use super::eval::{EvalWork, Evals};
use crate::model::ModelError;
use crate::model::drafter::{DraftRow, DrafterTrainer, EvalStats};
use crate::tensor::Backend;

/// Kind (and label prefix) of the pieces of drafter training.
pub const DRAFTER: &str = "drafter";
/// Kind (and label prefix) of the drafter's optimizer steps.
pub const DRAFTER_STEP: &str = "drafter step";
/// The smallest piece, in layout rows: below it a piece's fixed cost would outweigh its
/// work (docs/benchmarks.md, "Drafter training in the rollout's idle gaps").
pub const MIN_PIECE_ROWS: usize = 16;

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the drafter's training did in one part of a step (the idle gaps, or after).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct DrafterWork {
    /// Pieces of training run.
    pub pieces: usize,
    /// Their layout rows.
    pub rows: usize,
    /// Optimizer steps taken.
    pub steps: usize,
    /// Seconds spent (pieces and steps).
    pub seconds: f64,
}

/// The drafter's work in one RL step and where it ran: the step's `drafter_work` in
/// metrics.jsonl, so that "trained only in idle time" can be checked (`after` all zero).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DrafterAccount {
    /// `"defer"` or `"after"` (`rl.advanced.drafter_work` `"idle"` or `"idle-then-after"`).
    pub leftover: &'static str,
    /// Layout rows the step had to train: `rl.drafter_slices` slices' worth, plus the
    /// carried ones.
    pub budget_rows: usize,
    /// Of those, the rows the previous step's gaps left (`"defer"`).
    pub carried_in_rows: usize,
    /// Training run in the rollout's idle gaps.
    pub idle: DrafterWork,
    /// Training run after the rollout, on the step's critical path (`"after"` only).
    pub after: DrafterWork,
    /// Pieces that failed in the gaps (their rows went back to the budget).
    pub failed_pieces: usize,
    /// Rows left at the end and carried into the next step (`"defer"`; at most one step's
    /// budget).
    pub carried_out_rows: usize,
    /// Rows left at the end beyond that cap: dropped, never trained.
    pub dropped_rows: usize,
    /// Rows whose gradients were accumulated but not yet applied at the end: their optimizer
    /// step comes first in the next step's gaps (`"defer"`).
    pub pending_rows: usize,
    /// The held-out evaluation in the gaps (`"defer"`) and after the rollout (`"after"`).
    pub eval_idle: EvalWork,
    pub eval_after: EvalWork,
    /// Held-out rows the gaps did not evaluate (`"defer"`): sent to training unevaluated;
    /// the agreement and acceptance are those of the rows evaluated (none: no figure this
    /// step, the threshold keeps the last acceptance).
    pub eval_skipped_rows: usize,
    /// Seconds of the one-off measurement of the router's priors before the first rollout
    /// (`"defer"`, first step only; on the critical path once).
    pub startup_seconds: f64,
    /// Kinds of drafter work whose stale estimate was reset to its prior at the step's start
    /// (`"defer"`: the last step had such work and its gaps took none).
    pub reset_estimates: usize,
}

/// The step's plan, shared by the sources and the caller.
#[derive(Debug, Default)]
pub(super) struct Plan {
    /// Layout rows left to train this step (a running piece's taken off already).
    rows_left: usize,
    /// Layout rows accumulated towards the next optimizer step (a running piece's counted).
    pending: usize,
    /// A piece, step or evaluation runs.
    pub(super) busy: bool,
    /// What ran in the idle gaps this step.
    idle: DrafterWork,
    /// Pieces that failed this step.
    failed: usize,
    /// This step's own budget (without the carried rows), and the rows carried into it.
    budget: usize,
    carried_in: usize,
    /// Set at the end of a `"defer"` step: rows carried out, dropped, still pending.
    carried_out: usize,
    dropped: usize,
    pending_out: usize,
    /// Held-out rows are evaluated in the gaps (`"defer"`).
    pub(super) evaluating: bool,
    /// Held-out rows waiting for their evaluation, oldest first.
    pub(super) held: VecDeque<DraftRow>,
    /// The held-out figures of this step's evaluated rows, and what that cost.
    pub(super) eval: Option<EvalStats>,
    pub(super) eval_idle: EvalWork,
    eval_skipped: usize,
    /// The last whole slice [`DrafterSlices::finish`] ran: `(layout rows, seconds)`.
    whole: Option<(usize, f64)>,
    /// The last optimizer step's seconds.
    step_seconds: Option<f64>,
    /// The priors measured before the first rollout ([`super::prior`]), by kind.
    pub(super) priors: Vec<(&'static str, CostEstimate)>,
    /// Kinds whose stale estimate was reset to its prior at this step's start.
    reset: usize,
}

impl Plan {
    /// The pieces since the last step make a whole slice, or the budget is spent with some.
    fn step_due(&self, full: usize) -> bool {
        self.pending >= full || (self.rows_left == 0 && self.pending > 0)
    }
}

pub(super) struct Shared<B: Backend> {
    pub(super) trainer: Arc<Mutex<DrafterTrainer<B>>>,
    /// A whole slice's layout rows.
    pub(super) full: usize,
    /// The target's sequence length (a held-out row's most positions).
    pub(super) seq_len: usize,
    pub(super) plan: Mutex<Plan>,
}

/// The drafter's training as the idle work of a rollout's stages, a step's budget at a time
/// (see the module docs). Clones share the plan.
#[derive(Clone)]
pub struct DrafterSlices<B: Backend>(pub(super) Arc<Shared<B>>);

impl<B: Backend> DrafterSlices<B> {
    /// Trains `trainer` in `router`'s idle time: registers the three sources with it (once:
    /// keep this value for the router's life, one step's budget at a time).
    pub fn new(trainer: Arc<Mutex<DrafterTrainer<B>>>, router: &FillerRouter) -> Self {
        let (full, seq_len) = {
            let t = lock(&trainer);
            (t.max_slice_rows(), t.drafter().target_config().seq_len)
        };
        let slices = DrafterSlices(Arc::new(Shared {
            trainer,
            full,
            seq_len,
            plan: Mutex::default(),
        }));
        // Steps first: a due step goes before more pieces (which wait for it); then the
        // held-out evaluation, whose rows wait out of training until it ran.
        router.add_source(Steps(slices.clone()), None);
        router.add_sized_source(Evals(slices.clone()), None);
        router.add_sized_source(Pieces(slices.clone()), None);
        slices
    }

    /// Starts a step with a budget of `slices` whole slices' worth of layout rows and one
    /// optimizer step each, whatever an earlier step left (`rl.advanced.drafter_work = "idle-then-after"`:
    /// [`DrafterSlices::finish`] runs the rest); sets the router's priors from what
    /// [`DrafterSlices::finish`] measured (kept once the router measured its own).
    pub fn begin(&self, slices: usize, router: &FillerRouter) {
        let mut plan = self.reset(slices);
        plan.rows_left = plan.budget;
        plan.evaluating = false;
        if let Some((rows, seconds)) = plan.whole {
            let per_row = seconds / rows.max(1) as f64;
            router.set_prior_line(
                DRAFTER,
                CostEstimate::prior_line(rows as f64, seconds, per_row),
            );
        }
        if let Some(seconds) = plan.step_seconds {
            router.set_prior(DRAFTER_STEP, seconds);
        }
    }

    /// Starts a step of `rl.advanced.drafter_work = "idle"`: a budget of `slices` slices' worth
    /// plus what the last step carried ([`DrafterSlices::defer`]), held-out rows evaluated in
    /// the gaps ([`DrafterSlices::hold`]). The router's priors come from
    /// [`DrafterSlices::measure_priors`].
    pub fn begin_carrying(&self, slices: usize, router: &FillerRouter) {
        let reset = self.reset_stale(router);
        let mut plan = self.reset(slices);
        plan.carried_in = plan.rows_left;
        plan.rows_left += plan.budget;
        plan.evaluating = true;
        plan.reset = reset;
    }

    /// Resets to its measured prior each kind of work the last step had but its gaps never
    /// took: a kind predicted not to fit is never handed out, so never measured again, and
    /// one preempted piece on a busy machine can leave its estimate (and deviation) too
    /// high for any gap for good. Returns how many were reset.
    fn reset_stale(&self, router: &FillerRouter) -> usize {
        let plan = lock(&self.0.plan);
        let had = |kind: &str| match kind {
            DRAFTER => plan.idle.pieces == 0 && plan.carried_out + plan.dropped > 0,
            DRAFTER_STEP => plan.idle.steps == 0 && plan.pending_out >= self.0.full,
            _ => plan.eval_idle.pieces == 0 && plan.eval_skipped > 0,
        };
        let kinds = router.stats().kinds;
        let mut reset = 0;
        for &(kind, prior) in &plan.priors {
            let measured = kinds.get(kind).is_some_and(|k| k.estimate.samples > 0);
            if measured && had(kind) {
                router.reset_estimate(kind, prior);
                reset += 1;
            }
        }
        reset
    }

    /// The per-step parts of the plan cleared for a new step of `slices` slices.
    fn reset(&self, slices: usize) -> MutexGuard<'_, Plan> {
        let mut plan = lock(&self.0.plan);
        plan.budget = slices * self.0.full;
        plan.idle = DrafterWork::default();
        plan.failed = 0;
        plan.carried_in = 0;
        plan.carried_out = 0;
        plan.dropped = 0;
        plan.pending_out = 0;
        plan.eval = None;
        plan.eval_idle = EvalWork::default();
        plan.eval_skipped = 0;
        plan.reset = 0;
        plan
    }

    /// Ends a `"defer"` step without running anything: the budget's rest is carried into
    /// the next step, at most one step's budget (the rest is dropped and counted), and the
    /// held-out rows the gaps did not evaluate go to training unevaluated. Returns the step's
    /// account.
    pub fn defer(&self) -> DrafterAccount {
        let mut plan = lock(&self.0.plan);
        let carried = plan.rows_left.min(plan.budget);
        plan.dropped = plan.rows_left - carried;
        plan.carried_out = carried;
        plan.rows_left = carried;
        plan.pending_out = plan.pending;
        let skipped: Vec<DraftRow> = plan.held.drain(..).collect();
        plan.eval_skipped = skipped.len();
        drop(plan);
        if !skipped.is_empty() {
            let buffer = lock(&self.0.trainer).buffer().clone();
            let mut b = buffer.lock();
            for row in skipped {
                // A row the buffer refuses (wrong width) only costs the drafter a row.
                if let Err(e) = b.push(row) {
                    tracing::warn!("held-out drafter row refused: {e}");
                }
            }
        }
        self.account()
    }

    /// Queues a held-out row for its evaluation in the gaps (`"defer"`); `false` (nothing
    /// queued) when the step evaluates after the rollout.
    pub fn hold(&self, row: &DraftRow) -> bool {
        let mut plan = lock(&self.0.plan);
        if plan.evaluating {
            plan.held.push_back(row.clone());
        }
        plan.evaluating
    }

    /// The drafter's agreement and acceptance on the held-out rows evaluated in the gaps
    /// since the step began (`None`: none was).
    pub fn held_out_stats(&self) -> Option<EvalStats> {
        lock(&self.0.plan).eval
    }

    /// What the step's drafter work did so far, and where (`after` is the caller's to fill).
    pub fn account(&self) -> DrafterAccount {
        let plan = lock(&self.0.plan);
        DrafterAccount {
            leftover: if plan.evaluating { "defer" } else { "after" },
            budget_rows: plan.budget + plan.carried_in,
            carried_in_rows: plan.carried_in,
            idle: plan.idle,
            after: DrafterWork::default(),
            failed_pieces: plan.failed,
            carried_out_rows: plan.carried_out,
            dropped_rows: plan.dropped,
            pending_rows: plan.pending_out,
            eval_idle: plan.eval_idle,
            eval_after: EvalWork::default(),
            eval_skipped_rows: plan.eval_skipped,
            startup_seconds: 0.0,
            reset_estimates: plan.reset,
        }
    }

    /// A whole slice's layout rows.
    pub fn full_rows(&self) -> usize {
        self.0.full
    }

    /// Layout rows of this step's budget not trained yet.
    pub fn rows_left(&self) -> usize {
        lock(&self.0.plan).rows_left
    }

    /// What ran in the idle gaps since [`DrafterSlices::begin`].
    pub fn idle_work(&self) -> DrafterWork {
        lock(&self.0.plan).idle
    }

    /// Runs on this thread what the idle gaps left of the step's budget: the rest of the
    /// current slice's rows, whole slices, and every optimizer step due. Returns what it ran.
    pub fn finish(&self) -> Result<DrafterWork, ModelError> {
        let full = self.0.full;
        let mut done = DrafterWork::default();
        loop {
            let plan = lock(&self.0.plan);
            if plan.step_due(full) {
                drop(plan);
                let t = Instant::now();
                lock(&self.0.trainer).step_accumulated()?;
                let seconds = t.elapsed().as_secs_f64();
                let mut plan = lock(&self.0.plan);
                plan.pending = 0;
                plan.step_seconds = Some(seconds);
                done.steps += 1;
                done.seconds += seconds;
                continue;
            }
            let want = plan.rows_left.min(full - plan.pending);
            if want == 0 {
                return Ok(done);
            }
            drop(plan);
            let t = Instant::now();
            let rows = {
                let mut trainer = lock(&self.0.trainer);
                let rows = trainer.slice_size(want);
                trainer.accumulate_within(rows)?;
                rows
            };
            let seconds = t.elapsed().as_secs_f64();
            let mut plan = lock(&self.0.plan);
            plan.rows_left -= rows.min(plan.rows_left);
            plan.pending += rows;
            if rows == full {
                plan.whole = Some((rows, seconds));
            }
            done.pieces += 1;
            done.rows += rows;
            done.seconds += seconds;
        }
    }

    /// Claims the trainer for one piece, step or evaluation; `None` while one runs.
    pub(super) fn claim(&self) -> Option<MutexGuard<'_, Plan>> {
        let plan = lock(&self.0.plan);
        (!plan.busy).then_some(plan)
    }
}

/// The `"drafter"` source: pieces of the current slice, sized by the router.
struct Pieces<B: Backend>(DrafterSlices<B>);

impl<B: Backend> FillerSource for Pieces<B> {
    fn kind(&self) -> &str {
        DRAFTER
    }

    fn sizes(&self) -> (u64, u64) {
        let full = self.0.0.full;
        (MIN_PIECE_ROWS.min(full) as u64, full as u64)
    }

    fn next(&mut self, _rank: usize, units: u64) -> Option<Slice> {
        let shared = &self.0.0;
        let mut plan = self.0.claim()?;
        if plan.step_due(shared.full) {
            return None;
        }
        let asked = usize::try_from(units).unwrap_or(usize::MAX);
        let want = asked.min(plan.rows_left).min(shared.full - plan.pending);
        let trainer = shared.trainer.try_lock().ok()?;
        if want == 0 || trainer.buffer().is_empty() {
            return None;
        }
        let rows = trainer.slice_size(want);
        drop(trainer);
        plan.busy = true;
        plan.rows_left -= rows.min(plan.rows_left);
        plan.pending += rows;
        drop(plan);
        let slices = self.0.clone();
        Some(Slice {
            label: format!("{DRAFTER} slice ({rows} rows)"),
            units: rows as u64,
            run: Box::new(move || {
                let shared = &slices.0;
                let t = Instant::now();
                let result = lock(&shared.trainer).accumulate_within(rows);
                let mut plan = lock(&shared.plan);
                plan.busy = false;
                match result {
                    Ok(_) => {
                        plan.idle.pieces += 1;
                        plan.idle.rows += rows;
                        plan.idle.seconds += t.elapsed().as_secs_f64();
                        Ok(())
                    }
                    // Not trained: the rows go back to the budget (a later piece, or
                    // `finish`, tries again).
                    Err(e) => {
                        plan.failed += 1;
                        plan.rows_left += rows;
                        plan.pending -= rows;
                        Err(e.to_string())
                    }
                }
            }),
        })
    }
}

/// The `"drafter step"` source: the optimizer step once a slice's worth accumulated.
struct Steps<B: Backend>(DrafterSlices<B>);

impl<B: Backend> FillerSource for Steps<B> {
    fn kind(&self) -> &str {
        DRAFTER_STEP
    }

    fn next(&mut self, _rank: usize, _units: u64) -> Option<Slice> {
        let shared = &self.0.0;
        let mut plan = self.0.claim()?;
        if !plan.step_due(shared.full) || shared.trainer.try_lock().is_err() {
            return None;
        }
        plan.busy = true;
        drop(plan);
        let slices = self.0.clone();
        Some(Slice {
            label: DRAFTER_STEP.into(),
            units: 1,
            run: Box::new(move || {
                let shared = &slices.0;
                let t = Instant::now();
                let result = lock(&shared.trainer).step_accumulated();
                let seconds = t.elapsed().as_secs_f64();
                let mut plan = lock(&shared.plan);
                plan.busy = false;
                let version = result.map_err(|e| e.to_string())?;
                plan.pending = 0;
                plan.idle.steps += 1;
                plan.idle.seconds += seconds;
                tracing::debug!("drafter step {version} in idle time");
                Ok(())
            }),
        })
    }
}
