//! `Profiler`: gathers every stage's reports and builds the measured timelines.
//!
//! Metrics are never computed here: the profiler turns measured spans into the same
//! [`Timeline`] the simulator predicts, through [`Timeline::from_spans`], so measured and
//! predicted figures share one definition and can be printed side by side.
//!
//! A run that wants figures while it goes (a progress bar) registers a listener: as soon as
//! every rank has reported iteration k, the profiler builds that iteration's profile (the
//! same one the end-of-run [`Profile`] holds) and sends it there.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::Sender;

use kameo::Actor;
use kameo::actor::ActorRef;
use kameo::error::Infallible;
use kameo::message::{Context, Message};
use pipefill_schedules::Timeline;
use serde::{Deserialize, Serialize};

use crate::filler::{BubbleSpan, FillerSpan};
use crate::record::{ActionRecord, StageReport, StepRecord};
use crate::stage::Measured;

/// What was measured during one iteration, over every rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IterationProfile {
    pub iteration: u64,
    /// Built from this iteration's spans only (its makespan runs from its own first start).
    pub timeline: Timeline,
    /// Every action record, sorted by rank then position in the rank's list.
    pub records: Vec<ActionRecord>,
    pub bubbles: Vec<BubbleSpan>,
    pub fillers: Vec<FillerSpan>,
    /// Every rank's walk start and optimizer-step work, by rank then in the order it ran.
    #[serde(default)]
    pub steps: Vec<StepRecord>,
    /// How many ranks reported this iteration.
    pub ranks_reported: usize,
}

impl IterationProfile {
    /// The records of one rank, in the order it ran them.
    pub fn rank_records(&self, rank: usize) -> impl Iterator<Item = &ActionRecord> {
        self.records.iter().filter(move |r| r.rank == rank)
    }

    /// Seconds the ranks spent in bubbles, waiting for input (filled or not), summed.
    pub fn waited(&self) -> f64 {
        self.bubbles.iter().map(|b| b.end - b.start).sum()
    }

    /// Seconds of filler work the ranks ran in their bubbles, summed.
    pub fn filled(&self) -> f64 {
        self.fillers.iter().map(|f| f.end - f.start).sum()
    }
}

/// Everything the profiler holds at the end of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub iterations: Vec<IterationProfile>,
    /// One timeline over all iterations: with overlapping iterations its steady bubble
    /// ratio is the per-iteration cost of the pipeline.
    pub overall: Timeline,
}

/// The profiler actor.
pub struct Profiler {
    ranks: usize,
    /// Per-rank peak activation memory of the plans run, by the first iteration that ran
    /// each plan (the validator's figures, sent by the schedule actor).
    peak_memory: BTreeMap<u64, Vec<f64>>,
    reports: BTreeMap<u64, Vec<Arc<StageReport>>>,
    /// Where each iteration's profile goes once every rank has reported it.
    listener: Option<Sender<IterationProfile>>,
}

impl Profiler {
    /// A profiler for `ranks` ranks.
    pub fn new(ranks: usize) -> Self {
        Profiler {
            ranks,
            peak_memory: BTreeMap::new(),
            reports: BTreeMap::new(),
            listener: None,
        }
    }

    /// Sends each iteration's profile to `listener` as soon as every rank has reported it.
    pub fn with_listener(mut self, listener: Sender<IterationProfile>) -> Self {
        self.listener = Some(listener);
        self
    }

    /// Peak memory of the plan `iteration` ran (empty when unknown).
    fn peak_of(&self, iteration: u64) -> &[f64] {
        self.peak_memory
            .range(..=iteration)
            .next_back()
            .map_or(&[], |(_, p)| p.as_slice())
    }

    /// Per-rank maximum over every plan run.
    fn overall_peak(&self) -> Vec<f64> {
        let mut peak = vec![0.0f64; self.ranks];
        for plan in self.peak_memory.values() {
            for (p, &q) in peak.iter_mut().zip(plan) {
                *p = p.max(q);
            }
        }
        peak
    }

    /// The profile of one iteration from its ranks' reports.
    fn iteration_profile(&self, iteration: u64, reports: &[Arc<StageReport>]) -> IterationProfile {
        let mut reports: Vec<&StageReport> = reports.iter().map(Arc::as_ref).collect();
        reports.sort_by_key(|r| r.rank);
        let records: Vec<ActionRecord> = reports
            .iter()
            .flat_map(|r| r.records.iter().copied())
            .collect();
        let spans: Vec<_> = records.iter().map(ActionRecord::span).collect();
        IterationProfile {
            iteration,
            timeline: Timeline::from_spans(self.ranks, spans, self.peak_of(iteration)),
            records,
            bubbles: reports
                .iter()
                .flat_map(|r| r.bubbles.iter().copied())
                .collect(),
            fillers: reports
                .iter()
                .flat_map(|r| r.fillers.iter().cloned())
                .collect(),
            steps: reports
                .iter()
                .flat_map(|r| r.steps.iter().copied())
                .collect(),
            ranks_reported: reports.len(),
        }
    }

    /// Builds the profile of everything reported so far.
    pub fn profile(&self) -> Profile {
        let iterations: Vec<IterationProfile> = self
            .reports
            .iter()
            .map(|(&iteration, reports)| self.iteration_profile(iteration, reports))
            .collect();
        let all_spans = iterations
            .iter()
            .flat_map(|it| it.records.iter().map(ActionRecord::span))
            .collect();
        Profile {
            iterations,
            overall: Timeline::from_spans(self.ranks, all_spans, &self.overall_peak()),
        }
    }

    /// Files one rank's report; when it completes its iteration, publishes the iteration's
    /// profile to the listener (a listener that has gone away is not an error: the run
    /// goes on, and its figures are still in the end-of-run profile).
    fn add(&mut self, report: Arc<StageReport>) {
        let iteration = report.iteration;
        let reports = self.reports.entry(iteration).or_default();
        reports.push(report);
        if reports.len() != self.ranks {
            return;
        }
        if let Some(listener) = &self.listener {
            let profile = self.iteration_profile(iteration, &self.reports[&iteration]);
            let _ = listener.send(profile);
        }
    }
}

impl Actor for Profiler {
    type Args = Self;
    type Error = Infallible;

    async fn on_start(args: Self::Args, _actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(args)
    }
}

impl Message<Measured> for Profiler {
    type Reply = ();

    async fn handle(&mut self, msg: Measured, _ctx: &mut Context<Self, Self::Reply>) {
        self.add(msg.0);
    }
}

/// The per-rank peak activation memory of the plan run from `iteration` on.
#[derive(Clone, Debug)]
pub struct PlanMemory {
    pub iteration: u64,
    pub peak: Vec<f64>,
}

impl Message<PlanMemory> for Profiler {
    type Reply = ();

    async fn handle(&mut self, msg: PlanMemory, _ctx: &mut Context<Self, Self::Reply>) {
        self.peak_memory.insert(msg.iteration, msg.peak);
    }
}

/// Asks the profiler for the [`Profile`] of everything reported so far.
#[derive(Clone, Copy, Debug)]
pub struct Collect;

impl Message<Collect> for Profiler {
    type Reply = Box<Profile>;

    async fn handle(
        &mut self,
        _msg: Collect,
        _ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        Box::new(self.profile())
    }
}
