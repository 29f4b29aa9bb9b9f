//! The drafter's training cut to the rollout stages' idle gaps: [`DrafterSlices`].
//!
//! In the long tail a stage's idle time comes in many short gaps (while the other stages
//! and the driver handle the few groups in flight: ~3-5 ms each at d_model 256 on the
//! 2-core box), while a whole drafter slice (`drafter.batch_rows` windows of
//! `drafter.max_positions`) costs ~25 ms there: a whole slice never fits a gap, and running
//! one anyway holds the next message back by as much. So the step's budget of
//! `rl.drafter_slices` slices is trained in **pieces** sized to the gaps, through two sources
//! of the rollout's [`FillerRouter`]:
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
//! (they share the trainer); what the gaps did not take, [`DrafterSlices::finish`] runs on
//! the caller's thread after the rollout, as before.
//!
//! The router needs a cost line with a slope to size a piece below the one size it has
//! measured: before any piece ran in a gap, [`DrafterSlices::begin`] sets a prior line
//! through the last whole slice [`DrafterSlices::finish`] measured (cost proportional to
//! the rows; the pieces measured then fit the line's level and slope).
//!
//! What limits it (measured on the shared 2-core box, `pipefill rl examples/rl-longtail.toml`,
//! one run each): a piece has a fixed cost of ~1.7 ms at d_model 256 (a 16-row piece ~3 ms
//! alone, ~0.09 ms a row more; perf puts half of it in the GEMM packing the drafter's weight
//! matrices, which a piece of few rows pays as a whole slice does), comparable to the tail's
//! gaps (1-5 ms), so only a few pieces fit a step; at d_model 512 the gaps are 10-17 ms and
//! 64-row pieces took 57-120 ms on the stage threads under load. Cheaper small pieces
//! (weights streamed, not packed, as the proposals' row kernels do) would let more fit.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use pipefill_actors::router::CostEstimate;
use pipefill_actors::{FillerRouter, FillerSource, Slice};

use crate::model::drafter::{DrafterError, DrafterTrainer};
use crate::tensor::CpuBackend;

/// Kind (and label prefix) of the pieces of drafter training.
pub const DRAFTER: &str = "drafter";
/// Kind (and label prefix) of the drafter's optimizer steps.
pub const DRAFTER_STEP: &str = "drafter step";
/// The smallest piece, in layout rows: below it a piece's fixed cost (~1.5 ms at
/// d_model 256, about 20 rows' worth) would outweigh its work.
pub const MIN_PIECE_ROWS: usize = 16;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the drafter's training did in one part of a step (the idle gaps, or after).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
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

/// The step's plan, shared by the sources and the caller.
#[derive(Debug, Default)]
struct Plan {
    /// Layout rows left to train this step (a running piece's taken off already).
    rows_left: usize,
    /// Layout rows accumulated towards the next optimizer step (a running piece's counted).
    pending: usize,
    /// A piece or step runs.
    busy: bool,
    /// What ran in the idle gaps this step.
    idle: DrafterWork,
    /// The last whole slice [`DrafterSlices::finish`] ran: `(layout rows, seconds)`.
    whole: Option<(usize, f64)>,
    /// The last optimizer step's seconds.
    step_seconds: Option<f64>,
}

impl Plan {
    /// The pieces since the last step make a whole slice, or the budget is spent with some.
    fn step_due(&self, full: usize) -> bool {
        self.pending >= full || (self.rows_left == 0 && self.pending > 0)
    }
}

struct Shared {
    trainer: Arc<Mutex<DrafterTrainer<CpuBackend>>>,
    /// A whole slice's layout rows.
    full: usize,
    plan: Mutex<Plan>,
}

/// The drafter's training as the idle work of a rollout's stages, a step's budget at a time
/// (see the module docs). Clones share the plan.
#[derive(Clone)]
pub struct DrafterSlices(Arc<Shared>);

impl DrafterSlices {
    /// Trains `trainer` in `router`'s idle time: registers the two sources with it (once:
    /// keep this value for the router's life, one step's budget at a time).
    pub fn new(trainer: Arc<Mutex<DrafterTrainer<CpuBackend>>>, router: &FillerRouter) -> Self {
        let full = lock(&trainer).max_slice_rows();
        let slices = DrafterSlices(Arc::new(Shared {
            trainer,
            full,
            plan: Mutex::default(),
        }));
        // Steps first: a due step goes before more pieces (which wait for it).
        router.add_source(Steps(slices.clone()), None);
        router.add_sized_source(Pieces(slices.clone()), None);
        slices
    }

    /// Starts a step with a budget of `slices` whole slices' worth of layout rows and one
    /// optimizer step each; sets the router's priors from what [`DrafterSlices::finish`]
    /// measured (kept once the router measured its own).
    pub fn begin(&self, slices: usize, router: &FillerRouter) {
        let mut plan = lock(&self.0.plan);
        plan.rows_left = slices * self.0.full;
        plan.idle = DrafterWork::default();
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
    pub fn finish(&self) -> Result<DrafterWork, DrafterError> {
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

    /// Claims the trainer for one piece or step; `None` while one runs or the caller holds
    /// the trainer.
    fn claim(&self) -> Option<MutexGuard<'_, Plan>> {
        let plan = lock(&self.0.plan);
        (!plan.busy).then_some(plan)
    }
}

/// The `"drafter"` source: pieces of the current slice, sized by the router.
struct Pieces(DrafterSlices);

impl FillerSource for Pieces {
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
                    // Not trained: the rows go back to the budget (`finish` tries again).
                    Err(e) => {
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
struct Steps(DrafterSlices);

impl FillerSource for Steps {
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
