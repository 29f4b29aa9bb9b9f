//! `FillerRouter`: the job's queue of filler work, routed into the stages' bubbles.
//!
//! Filler work comes in two shapes:
//! - **sources** ([`FillerSource`]): work that is always there while their data lasts, one
//!   slice at a time — drafter training (a forward + backward on a small batch). A source
//!   may size its slices ([`FillerSource::sizes`], in units of its own work): the router
//!   asks for a slice of the size that fits the idle time left, or, for a source whose
//!   slices are fixed in advance ([`FillerSource::fixed_size`]), hands out the next one only
//!   where it fits;
//! - **requests** ([`Request`]): one-off pieces queued first-in first-out — rollout
//!   verification — optionally pinned to one rank.
//!
//! Each rank's [`BubbleFiller`] is a [`RoutedFiller`] that shares the router's queue. When
//! its stage offers a bubble, it hands out the oldest request, then a source slice, whose
//! **predicted cost fits the predicted remaining idle time**, so the pipeline's critical path
//! does not stretch; a sized source's slice is made as large as fits, so little of a bubble
//! is left over. The work runs on the stage's own thread, timed by the stage's clock.
//!
//! - **Cost.** Each kind of work (`"drafter"`, `"verify"`) has a running estimate of what its
//!   slices cost, from every measured slice ([`CostEstimate`]: a line in the slice's size
//!   fitted from exponential moving averages, and the moving absolute deviation of the
//!   measured costs from it). A slice is predicted to cost the line plus a margin of
//!   deviations, so that a slice a little dearer than usual still ends before the input
//!   arrives: [`RouterConfig::margin`] when the idle time is a wall-clock prediction,
//!   [`RouterConfig::exact_margin`] when it is exact (virtual clock), where only the slice's
//!   own cost is uncertain. Before any slice was measured, the source's prior is used (slices
//!   measured before the job), and without one the kind waits.
//! - **Idle time.** In virtual-clock mode the stage knows a bubble's length exactly. In wall
//!   mode the stage passes the schedule's prediction, and each rank corrects it by what it
//!   observed ([`ArrivalCorrection`]): the moving average of observed / predicted idle time
//!   over the bubbles whose input arrival was seen.
//!
//! [`FillerRouter`] is a kameo actor owning the queue, so asynchronous producers (the
//! rollout engine) can [`Submit`] requests and ask for [`Stats`]; stages never wait on its
//! mailbox, they share the queue through their `RoutedFiller`. [`WeightBoard`] hands the
//! newest drafter weights, versioned by drafter step, to whoever subscribes.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kameo::Actor;
use kameo::actor::ActorRef;
use kameo::error::Infallible;
use kameo::message::{Context, Message};
use pipefill_schedules::Action;
use tokio::sync::watch;

use crate::filler::{Bubble, BubbleFiller, BubbleSpan, FillerSpan, FillerWork};

mod cost;
pub use cost::CostEstimate;

/// The work of one slice, run once on a stage's thread. An error is recorded on the filler
/// span; it does not stop the job.
pub type SliceRun = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// One slice of a source's work.
pub struct Slice {
    /// Shown in the profile (`drafter 12.3`).
    pub label: String,
    /// Its size in the source's units (at most what was asked for; 1 for a source with one
    /// size): the router's cost line is fitted against it.
    pub units: u64,
    pub run: SliceRun,
}

/// Filler work that is there whenever it has data: one slice at a time.
pub trait FillerSource: Send + 'static {
    /// The kind of work: slices of one kind share a cost estimate.
    fn kind(&self) -> &str;
    /// The sizes `(smallest, largest)` its slices can take, in units of its own work (e.g.
    /// drafter pairs). Default `(1, 1)`: one size.
    fn sizes(&self) -> (u64, u64) {
        (1, 1)
    }
    /// A slice of at most `units` units (within [`FillerSource::sizes`]) for `rank` to run
    /// now, or `None` when there is nothing to do yet.
    fn next(&mut self, rank: usize, units: u64) -> Option<Slice>;
    /// For a source whose slices are fixed in advance (a planned placement): the size of
    /// `rank`'s next slice, which the router asks for with [`FillerSource::next`] only where
    /// its predicted cost fits the idle time (else the bubble gets none of it: the order is
    /// fixed). `None` (the default): the router sizes each slice to the idle time.
    fn fixed_size(&mut self, _rank: usize) -> Option<u64> {
        None
    }
}

/// One queued piece of work (e.g. a rollout verification).
pub struct Request {
    pub kind: String,
    pub label: String,
    /// Only this rank may run it (the rank that holds what it needs), or any rank.
    pub rank: Option<usize>,
    pub run: SliceRun,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("kind", &self.kind)
            .field("label", &self.label)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

/// How the router predicts costs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterConfig {
    /// Weight of the newest measurement in the running estimates, in `(0, 1]`.
    pub ema: f64,
    /// Deviations added to the mean cost to predict a slice's cost when the idle time is a
    /// prediction (wall clock).
    pub margin: f64,
    /// The same when the idle time is exact (virtual clock): only the slice's own cost is
    /// uncertain, and a smaller margin leaves less of each bubble unused.
    pub exact_margin: f64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            ema: 0.2,
            margin: 2.0,
            // Measured on the default job (zb-h1, virtual clock, a loaded 2-core machine):
            // 1.5 fills ~1 point more than 2 for a similar count of (µs-sized) overruns.
            exact_margin: 1.5,
        }
    }
}

/// What the router did for one kind of work.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KindStats {
    pub estimate: CostEstimate,
    /// Slices handed out and measured.
    pub slices: u64,
    /// Their measured time, seconds.
    pub seconds: f64,
    /// Slices whose work returned an error or panicked.
    pub failed: u64,
    /// Slices that ran longer than the idle time left when they were handed out.
    pub overran: u64,
    /// Their sizes, summed (units of the kind's work).
    pub units: u64,
}

/// The router's figures, by kind of work.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouterStats {
    pub kinds: BTreeMap<String, KindStats>,
    /// Requests still queued.
    pub queued: usize,
}

/// The queue and the estimates, shared by the router actor and every rank's filler.
struct State {
    config: RouterConfig,
    sources: Vec<Box<dyn FillerSource>>,
    requests: VecDeque<Request>,
    kinds: BTreeMap<String, KindStats>,
}

/// A piece of work handed out: what it is and what it was predicted to cost.
struct Taken {
    kind: String,
    cost: f64,
    units: u64,
    label: String,
    run: SliceRun,
}

impl State {
    /// The predicted cost of a one-size piece of `kind` under `margin` deviations.
    fn estimate(&self, kind: &str, margin: f64) -> Option<f64> {
        self.kinds.get(kind).map(|k| k.estimate.predicted(margin))
    }

    /// The oldest request, then the first source's slice (as large as fits), that `rank`
    /// may run and whose predicted cost fits `idle`; `exact`: the idle time is exact.
    fn take(&mut self, rank: usize, idle: f64, exact: bool) -> Option<Taken> {
        let margin = if exact {
            self.config.exact_margin
        } else {
            self.config.margin
        };
        let fits = |cost: Option<f64>| cost.filter(|&c| c <= idle);
        let position = self.requests.iter().position(|r| {
            r.rank.is_none_or(|only| only == rank) && fits(self.estimate(&r.kind, margin)).is_some()
        });
        if let Some(i) = position {
            let r = self.requests.remove(i).expect("position is in range");
            let cost = self.estimate(&r.kind, margin).expect("checked by fits");
            return Some(Taken {
                kind: r.kind,
                cost,
                units: 1,
                label: r.label,
                run: r.run,
            });
        }
        for i in 0..self.sources.len() {
            let kind = self.sources[i].kind().to_string();
            let Some(estimate) = self.kinds.get(&kind).map(|k| k.estimate) else {
                continue;
            };
            let units = match self.sources[i].fixed_size(rank) {
                Some(fixed) if estimate.predicted_at(fixed as f64, margin) <= idle => fixed,
                Some(_) => continue,
                None => {
                    let (min, max) = self.sources[i].sizes();
                    let Some(units) = estimate.size(idle, min, max, margin) else {
                        continue;
                    };
                    units
                }
            };
            if let Some(slice) = self.sources[i].next(rank, units) {
                let units = slice.units.max(1);
                return Some(Taken {
                    kind,
                    cost: estimate.predicted_at(units as f64, margin),
                    units,
                    label: slice.label,
                    run: slice.run,
                });
            }
        }
        None
    }
}

/// The per-rank correction of wall-clock idle predictions (see the module docs).
#[derive(Clone, Debug)]
pub struct ArrivalCorrection {
    ema: f64,
    /// Moving average of observed / predicted idle time.
    ratio: f64,
    samples: u64,
    /// The idle time predicted when the current bubble began, by bubble.
    first: Option<((u64, Action), f64)>,
}

impl ArrivalCorrection {
    pub fn new(ema: f64) -> Self {
        ArrivalCorrection {
            ema,
            ratio: 1.0,
            samples: 0,
            first: None,
        }
    }

    /// Observed / predicted idle time, as learned so far (1 before any observation).
    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    /// The idle time `bubble` has left, corrected: exact predictions are used as they are;
    /// a wall-clock prediction `p` made at the bubble's start becomes `p · ratio`, minus the
    /// time already spent. `None` without a prediction.
    pub fn remaining(&mut self, bubble: &Bubble) -> Option<f64> {
        let left = bubble.predicted_idle?;
        if bubble.exact {
            return Some(left);
        }
        let key = (bubble.iteration, bubble.waiting_for);
        let start = match self.first {
            Some((k, p)) if k == key => p,
            _ => {
                self.first = Some((key, left));
                left
            }
        };
        Some((left + start * (self.ratio - 1.0)).max(0.0))
    }

    /// Learns from a bubble whose input arrival was observed.
    pub fn observe(&mut self, predicted: Option<f64>, observed: Option<f64>) {
        let (Some(p), Some(o)) = (predicted, observed) else {
            return;
        };
        if p <= 0.0 {
            return;
        }
        let r = o / p;
        self.ratio = if self.samples == 0 {
            r
        } else {
            self.ratio + self.ema * (r - self.ratio)
        };
        self.samples += 1;
    }
}

/// A job's filler router: the queue of filler work and its cost estimates (see the module
/// docs). Cloning shares the queue.
#[derive(Clone)]
pub struct FillerRouter {
    state: Arc<Mutex<State>>,
}

impl Default for FillerRouter {
    fn default() -> Self {
        Self::new(RouterConfig::default())
    }
}

impl FillerRouter {
    pub fn new(config: RouterConfig) -> Self {
        FillerRouter {
            state: Arc::new(Mutex::new(State {
                config,
                sources: Vec::new(),
                requests: VecDeque::new(),
                kinds: BTreeMap::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a source whose slices are predicted to cost `prior` seconds until one is
    /// measured (`None`: its slices wait for [`FillerRouter::set_prior`]).
    pub fn add_source(&self, source: impl FillerSource, prior: Option<f64>) {
        self.add_sized_source(source, prior.map(CostEstimate::prior));
    }

    /// Adds a source with a prior cost line (e.g. [`CostEstimate::prior_line`], from slices
    /// of two sizes measured before the job); `None`: its slices wait for a prior.
    pub fn add_sized_source(&self, source: impl FillerSource, prior: Option<CostEstimate>) {
        let kind = source.kind().to_string();
        let mut state = self.lock();
        if let Some(estimate) = prior {
            state.kinds.entry(kind).or_default().estimate = estimate;
        }
        state.sources.push(Box::new(source));
    }

    /// Sets the prior cost of `kind` (kept if a slice of it was measured already).
    pub fn set_prior(&self, kind: &str, cost: f64) {
        self.set_prior_line(kind, CostEstimate::prior(cost));
    }

    /// Sets a prior cost line of `kind` ([`CostEstimate::prior_line`]: a sized source's
    /// slices need a slope to be sized below the one size measured), kept if a slice of it
    /// was measured already.
    pub fn set_prior_line(&self, kind: &str, prior: CostEstimate) {
        let mut state = self.lock();
        let k = state.kinds.entry(kind.to_string()).or_default();
        if k.estimate.samples == 0 {
            k.estimate = prior;
        }
    }

    /// Replaces `kind`'s estimate with `prior`, forgetting its measurements: for a kind
    /// whose estimate went stale high (a kind predicted not to fit is never handed out, so
    /// never measured again).
    pub fn reset_estimate(&self, kind: &str, prior: CostEstimate) {
        self.lock()
            .kinds
            .entry(kind.to_string())
            .or_default()
            .estimate = prior;
    }

    /// Queues a one-off request behind those already queued.
    pub fn submit(&self, request: Request) {
        self.lock().requests.push_back(request);
    }

    /// The estimates and counts so far.
    pub fn stats(&self) -> RouterStats {
        let state = self.lock();
        RouterStats {
            kinds: state.kinds.clone(),
            queued: state.requests.len(),
        }
    }

    /// The bubble filler of `rank`, handing out this router's work.
    pub fn filler(&self, rank: usize) -> RoutedFiller {
        let ema = self.lock().config.ema;
        RoutedFiller {
            rank,
            router: self.clone(),
            running: None,
            correction: ArrivalCorrection::new(ema),
        }
    }

    /// One filler per rank, ready for [`crate::Pipeline::fillers`].
    pub fn fillers(&self, ranks: usize) -> Vec<Box<dyn BubbleFiller>> {
        (0..ranks)
            .map(|r| Box::new(self.filler(r)) as Box<dyn BubbleFiller>)
            .collect()
    }

    /// Records one measured slice of `kind` and `units` units; `idle` is the idle time it
    /// was handed out for.
    fn measured(&self, kind: &str, span: &FillerSpan, idle: f64, units: u64) {
        let mut state = self.lock();
        let ema = state.config.ema;
        let k = state.kinds.entry(kind.to_string()).or_default();
        let cost = (span.end - span.start).max(0.0);
        k.estimate.observe_sized(units as f64, cost, ema);
        k.slices += 1;
        k.units += units;
        k.seconds += cost;
        k.failed += u64::from(span.error.is_some());
        k.overran += u64::from(cost > idle);
    }
}

/// One rank's [`BubbleFiller`]: takes fitting work from its [`FillerRouter`].
pub struct RoutedFiller {
    rank: usize,
    router: FillerRouter,
    /// `(kind, idle time it was given, units)` of the work handed out last.
    running: Option<(String, f64, u64)>,
    correction: ArrivalCorrection,
}

impl RoutedFiller {
    /// The rank's learned observed / predicted idle ratio (wall clock).
    pub fn idle_ratio(&self) -> f64 {
        self.correction.ratio()
    }
}

impl BubbleFiller for RoutedFiller {
    fn fill(&mut self, bubble: &Bubble) -> Option<FillerWork> {
        let idle = self.correction.remaining(bubble)?;
        let taken = self.router.lock().take(self.rank, idle, bubble.exact)?;
        self.running = Some((taken.kind, idle, taken.units));
        Some(FillerWork {
            label: taken.label,
            predicted_cost: taken.cost,
            run: taken.run,
        })
    }

    fn finished(&mut self, span: &FillerSpan) {
        if let Some((kind, idle, units)) = self.running.take() {
            self.router.measured(&kind, span, idle, units);
        }
    }

    fn bubble_ended(&mut self, _: &BubbleSpan, predicted: Option<f64>, observed: Option<f64>) {
        self.correction.observe(predicted, observed);
    }
}

impl Actor for FillerRouter {
    type Args = Self;
    type Error = Infallible;

    async fn on_start(args: Self::Args, _actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(args)
    }
}

/// Queues a request (from asynchronous code, e.g. the rollout engine).
#[derive(Debug)]
pub struct Submit(pub Request);

impl Message<Submit> for FillerRouter {
    type Reply = ();

    async fn handle(&mut self, msg: Submit, _ctx: &mut Context<Self, Self::Reply>) {
        self.submit(msg.0);
    }
}

/// Asks the router for its [`RouterStats`].
#[derive(Clone, Copy, Debug)]
pub struct Stats;

impl Message<Stats> for FillerRouter {
    type Reply = Box<RouterStats>;

    async fn handle(&mut self, _msg: Stats, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Box::new(self.stats())
    }
}

/// A value with the step that produced it.
#[derive(Debug)]
pub struct Versioned<T> {
    pub version: u64,
    pub value: Arc<T>,
}

impl<T> Clone for Versioned<T> {
    fn clone(&self) -> Self {
        Versioned {
            version: self.version,
            value: Arc::clone(&self.value),
        }
    }
}

/// The newest version of something trained in the bubbles (the drafter's weights), for
/// whoever needs it: each [`WeightBoard::publish`] is a message to every subscriber, who
/// sees the newest version (older ones it missed are superseded).
pub struct WeightBoard<T> {
    tx: watch::Sender<Option<Versioned<T>>>,
}

impl<T> Default for WeightBoard<T> {
    fn default() -> Self {
        WeightBoard {
            tx: watch::Sender::new(None),
        }
    }
}

impl<T> WeightBoard<T> {
    /// Publishes `value` as version `version`; an older version than the current is ignored.
    pub fn publish(&self, version: u64, value: T) {
        self.tx.send_if_modified(|cur| {
            if cur.as_ref().is_some_and(|c| c.version > version) {
                return false;
            }
            *cur = Some(Versioned {
                version,
                value: Arc::new(value),
            });
            true
        });
    }

    /// A receiver of every newer version (`changed().await`, or `borrow()` now).
    pub fn subscribe(&self) -> watch::Receiver<Option<Versioned<T>>> {
        self.tx.subscribe()
    }

    /// The newest version, if any was published.
    pub fn latest(&self) -> Option<Versioned<T>> {
        self.tx.borrow().clone()
    }
}

#[cfg(test)]
mod tests;
