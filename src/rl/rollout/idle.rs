//! The rollout stages' idle work, routed by a [`FillerRouter`] (the long-tail bubbles).
//!
//! While the live batch is large every stage always has a group to run; in the long tail
//! few groups are in flight and a stage waits for the others most of the time. A
//! [`RolloutRouter`] is the engine's [`MessageHook`]: each stage thread, when its inbox is
//! empty, asks its rank's [`RoutedFiller`] of a job's router for work:
//!
//! 1. **verification** (kind `"verify"`, one-off requests pinned to the stage): a
//!    speculative verification message is filed with the router when it reaches a stage,
//!    and handed back to that stage (the one holding the layers it needs) as the first
//!    request it may run; the stage then runs it as its own work. The router thereby
//!    learns the verification passes' cost and orders them ahead of every source;
//! 2. **drafter training** ([`DrafterSlices`], the router's sources `"drafter step"` and
//!    `"drafter"`, while the step's budget lasts): pieces of the drafter's training on the
//!    rows this step's rollouts produced (each finished sequence's row reaches the buffer
//!    at once through [`MessageHook::row`]) and the previous step's, each sized by the
//!    router to the idle time the stage has left, and the optimizer step once they add up
//!    to a whole slice (see `slices`: the gaps are far shorter than a whole slice);
//!    with `rl.advanced.drafter_work = "idle"` also the held-out evaluation (`"drafter eval"`,
//!    see `eval`), and the budget's rest carried into the next step instead of run after
//!    the rollout.
//!
//! The idle time a stage has left is predicted from what it observed: the moving average
//! of its idle gaps (from going idle to the next message), measured whenever the arrival
//! was seen; when a message arrived while a piece ran, the gap is only known to exceed the
//! time before the piece, and that lower bound is what the average learns, so an estimate
//! that let pieces overrun shrinks. Every piece of work is recorded as an [`IdleSpan`].
//!
//! The samples do not change: idle work never touches the stages' caches, and the drafter
//! being trained is not the one proposing during this rollout (that one was loaded before
//! it), so the rollout is as lossless and, for greedy decoding and for sampling with the
//! same proposer, as deterministic as without.

mod eval;
mod prior;
mod slices;

pub use eval::{DRAFTER_EVAL, EvalWork, merge_eval};
pub use prior::DrafterPriors;
pub use slices::{
    DRAFTER, DRAFTER_STEP, DrafterAccount, DrafterSlices, DrafterWork, MIN_PIECE_ROWS,
};

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use pipefill_actors::{
    Bubble, BubbleFiller, FillerRouter, FillerSpan, Request as RouterRequest, RoutedFiller,
};
use pipefill_schedules::Action;
use serde::Serialize;

use super::pipe::{IdleTurn, MessageHook, WorkKind};
use crate::model::drafter::{DraftBufferHandle, DraftRow};
use crate::tensor::Backend;

/// Weight of the newest observed gap in a stage's idle-gap average.
const GAP_EMA: f64 = 0.3;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One piece of work a rollout stage ran through the router.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct IdleSpan {
    pub stage: usize,
    /// Seconds since the router's rollout began.
    pub start: f64,
    pub end: f64,
    /// `"verify"` (the stage's own message, routed) or `"drafter"` (idle work: a piece of
    /// training, an optimizer step or a held-out evaluation, see `label`).
    pub kind: String,
    pub label: String,
    /// The work's error, if it failed.
    pub error: Option<String>,
}

/// What the stages did through the router in one rollout.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct IdleReport {
    pub spans: Vec<IdleSpan>,
    /// Seconds each stage blocked on its inbox with nothing to do.
    pub waited_s: Vec<f64>,
    /// Seconds of idle work (drafter pieces and steps) each stage ran.
    pub filled_s: Vec<f64>,
    /// Pieces of drafter training run in idle time.
    pub drafter_slices: usize,
    /// Their layout rows.
    pub drafter_rows: usize,
    /// Drafter optimizer steps taken in idle time.
    pub drafter_steps: usize,
    /// Held-out evaluation pieces run in idle time.
    pub drafter_evals: usize,
    /// Verification messages routed.
    pub verifications: usize,
}

impl IdleReport {
    pub fn filled_total(&self) -> f64 {
        self.filled_s.iter().sum()
    }
}

/// One stage's side of the router.
struct StageSide {
    filler: RoutedFiller,
    /// Moving average of the stage's idle gaps, seconds (`None` before one was seen).
    gap: Option<f64>,
    /// When the stage went idle (`None` while it works).
    idle_since: Option<Instant>,
    /// When the last idle work of this idle period started.
    last_work: Option<Instant>,
    /// The arrival ending this idle period was observed (the stage blocked).
    observed: bool,
}

impl StageSide {
    fn learn(&mut self, gap: f64) {
        let gap = gap.max(0.0);
        self.gap = Some(match self.gap {
            None => gap,
            Some(g) => g + GAP_EMA * (gap - g),
        });
    }
}

/// Kind of the routed verification requests.
pub const VERIFY: &str = "verify";

/// What the router asks of the drafter's idle work, whatever device the drafter trains on.
trait IdleDrafter: Send + Sync {
    fn idle_work(&self) -> DrafterWork;
    fn hold(&self, row: &DraftRow) -> bool;
}

impl<B: Backend> IdleDrafter for DrafterSlices<B> {
    fn idle_work(&self) -> DrafterWork {
        DrafterSlices::idle_work(self)
    }
    fn hold(&self, row: &DraftRow) -> bool {
        DrafterSlices::hold(self, row)
    }
}

/// The rollout engine's [`MessageHook`] over a [`FillerRouter`] (see the module docs).
pub struct RolloutRouter {
    router: FillerRouter,
    route_verify: bool,
    stages: Vec<Mutex<StageSide>>,
    /// Groups whose routed message the router handed to each stage, oldest first.
    handed: Arc<Vec<Mutex<VecDeque<usize>>>>,
    /// Where finished sequences' rows go, all but the first `hold_out`, which are kept.
    rows: Option<DraftBufferHandle>,
    hold_out: usize,
    held: Mutex<Vec<DraftRow>>,
    origin: Instant,
    report: Mutex<IdleReport>,
    drafter: Option<Box<dyn IdleDrafter>>,
}

impl RolloutRouter {
    /// A hook for `stages` stages taking work from `router`; verification messages are
    /// routed when `route_verify`. A verification is only handed out once the router has
    /// a cost estimate for `"verify"`: this sets a prior of 0 if none was measured (a
    /// stage's own message always fits its idle time).
    pub fn new(router: FillerRouter, stages: usize, route_verify: bool) -> Self {
        if route_verify {
            router.set_prior(VERIFY, 0.0);
        }
        RolloutRouter {
            stages: (0..stages)
                .map(|s| {
                    Mutex::new(StageSide {
                        filler: router.filler(s),
                        gap: None,
                        idle_since: None,
                        last_work: None,
                        observed: false,
                    })
                })
                .collect(),
            router,
            route_verify,
            handed: Arc::new((0..stages).map(|_| Mutex::new(VecDeque::new())).collect()),
            rows: None,
            hold_out: 0,
            held: Mutex::new(Vec::new()),
            origin: Instant::now(),
            report: Mutex::new(IdleReport {
                waited_s: vec![0.0; stages],
                filled_s: vec![0.0; stages],
                ..IdleReport::default()
            }),
            drafter: None,
        }
    }

    /// Reports the drafter training `slices` (registered with this hook's router) ran in
    /// idle time.
    pub fn with_drafter<B: Backend>(mut self, slices: DrafterSlices<B>) -> Self {
        self.drafter = Some(Box::new(slices));
        self
    }

    /// Sends finished sequences' drafter rows to `buffer`, except the first `hold_out`,
    /// kept apart ([`RolloutRouter::held_out`]) to measure the drafter on rows it never
    /// trained on; with a drafter evaluating in the gaps ([`DrafterSlices::hold`]) they are
    /// queued there too, and reach the buffer once evaluated.
    pub fn with_rows(mut self, buffer: DraftBufferHandle, hold_out: usize) -> Self {
        self.rows = Some(buffer);
        self.hold_out = hold_out;
        self
    }

    /// The rows held out of training.
    pub fn held_out(&self) -> Vec<DraftRow> {
        lock(&self.held).clone()
    }

    /// What the stages did so far.
    pub fn report(&self) -> IdleReport {
        let mut report = lock(&self.report).clone();
        if let Some(d) = &self.drafter {
            report.drafter_rows = d.idle_work().rows;
        }
        report
    }

    fn seconds(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.origin).as_secs_f64()
    }

    fn record(&self, span: IdleSpan) {
        let mut r = lock(&self.report);
        if span.kind == DRAFTER {
            r.filled_s[span.stage] += span.end - span.start;
        }
        r.spans.push(span);
    }

    /// A bubble of `idle` seconds at `stage`, taken as it is (the stage's own estimate,
    /// already learned from its observed gaps).
    fn bubble(stage: usize, idle: f64) -> Bubble {
        Bubble {
            rank: stage,
            iteration: 0,
            waiting_for: Action::f(stage as u32, 0),
            predicted_idle: Some(idle),
            exact: true,
        }
    }

    /// Runs `work` on this thread as idle work of `stage` and tells the filler.
    fn run_idle(&self, stage: usize, side: &mut StageSide, work: pipefill_actors::FillerWork) {
        let start = Instant::now();
        side.last_work = Some(start);
        let result = (work.run)();
        let end = Instant::now();
        let error = result.err();
        side.filler.finished(&FillerSpan {
            rank: stage,
            iteration: 0,
            start: self.seconds(start),
            end: self.seconds(end),
            label: work.label.clone(),
            predicted_cost: work.predicted_cost,
            error: error.clone(),
        });
        let is_drafter = work.label.starts_with(DRAFTER);
        if work.label.starts_with(DRAFTER_STEP) {
            lock(&self.report).drafter_steps += 1;
        } else if work.label.starts_with(DRAFTER_EVAL) {
            lock(&self.report).drafter_evals += 1;
        } else if is_drafter {
            lock(&self.report).drafter_slices += 1;
        }
        self.record(IdleSpan {
            stage,
            start: self.seconds(start),
            end: self.seconds(end),
            kind: if is_drafter { DRAFTER } else { "other" }.into(),
            label: work.label,
            error,
        });
    }
}

impl MessageHook for RolloutRouter {
    fn filed(&self, stage: usize, _group: usize, _kind: WorkKind, _rows: usize) {
        let mut side = lock(&self.stages[stage]);
        if let Some(since) = side.idle_since.take()
            && !side.observed
        {
            // The message came while idle work ran: the gap was at least the time
            // before the last piece started.
            let lower = side.last_work.map_or(0.0, |t| (t - since).as_secs_f64());
            side.learn(lower);
        }
        side.observed = false;
        side.last_work = None;
    }

    fn routes(&self, _stage: usize, kind: WorkKind) -> bool {
        self.route_verify && matches!(kind, WorkKind::Verify { .. })
    }

    fn queue(&self, stage: usize, group: usize, kind: WorkKind) {
        let handed = Arc::clone(&self.handed);
        let k = match kind {
            WorkKind::Verify { k } => k,
            _ => 0,
        };
        self.router.submit(RouterRequest {
            kind: VERIFY.into(),
            label: format!("verify group {group} k {k}"),
            rank: Some(stage),
            run: Box::new(move || {
                lock(&handed[stage]).push_back(group);
                Ok(())
            }),
        });
    }

    fn idle(&self, stage: usize, waiting: bool) -> IdleTurn {
        let mut side = lock(&self.stages[stage]);
        if waiting {
            // The stage's own routed message: the oldest request the router has for it.
            let Some(work) = side.filler.fill(&Self::bubble(stage, f64::INFINITY)) else {
                return IdleTurn::Wait;
            };
            if !work.label.starts_with(VERIFY) {
                // No request for this stage: the router handed out a source's slice.
                self.run_idle(stage, &mut side, work);
                return IdleTurn::Worked;
            }
            let _ = (work.run)();
            return match lock(&self.handed[stage]).pop_front() {
                // The filler measures the verification when the stage reports it ran.
                Some(group) => IdleTurn::Routed { group },
                None => IdleTurn::Wait,
            };
        }
        let now = Instant::now();
        let since = *side.idle_since.get_or_insert(now);
        // No idle work before the stage has seen how long it waits.
        let Some(gap) = side.gap else {
            return IdleTurn::Wait;
        };
        let left = gap - (now - since).as_secs_f64();
        if left <= 0.0 {
            return IdleTurn::Wait;
        }
        match side.filler.fill(&Self::bubble(stage, left)) {
            Some(work) => {
                self.run_idle(stage, &mut side, work);
                IdleTurn::Worked
            }
            None => IdleTurn::Wait,
        }
    }

    fn routed_ran(&self, stage: usize, start: Instant, end: Instant) {
        let mut side = lock(&self.stages[stage]);
        let span = FillerSpan {
            rank: stage,
            iteration: 0,
            start: self.seconds(start),
            end: self.seconds(end),
            label: VERIFY.into(),
            predicted_cost: 0.0,
            error: None,
        };
        side.filler.finished(&span);
        drop(side);
        lock(&self.report).verifications += 1;
        self.record(IdleSpan {
            stage,
            start: span.start,
            end: span.end,
            kind: VERIFY.into(),
            label: VERIFY.into(),
            error: None,
        });
    }

    fn waited(&self, stage: usize, start: Instant, end: Instant) {
        let mut side = lock(&self.stages[stage]);
        let since = side.idle_since.unwrap_or(start);
        side.learn((end - since).as_secs_f64());
        side.observed = true;
        drop(side);
        lock(&self.report).waited_s[stage] += (end - start).as_secs_f64();
    }

    fn row(&self, row: &DraftRow) {
        let Some(buffer) = &self.rows else {
            return;
        };
        {
            let mut held = lock(&self.held);
            if held.len() < self.hold_out {
                held.push(row.clone());
                if let Some(d) = &self.drafter {
                    d.hold(row);
                }
                return;
            }
        }
        // A row the buffer refuses (wrong width) only costs the drafter a row.
        if let Err(e) = buffer.lock().push(row.clone()) {
            tracing::warn!("drafter row refused: {e}");
        }
    }
}
