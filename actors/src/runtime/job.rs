//! One running job's actors ([`Job`]): driving its iterations to the end or the first
//! failure, gathering the report, shutting down; and the optimizer steps the stages report
//! ([`Steps`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kameo::Actor;
use kameo::actor::ActorRef;
use kameo::error::Infallible;
use kameo::message::{Context, Message};

use super::RunReport;
use crate::clock::Clock;
use crate::compute::StageCompute;
use crate::error::{Result, RuntimeError};
use crate::profiler::{Collect, Profiler};
use crate::schedule::{Attach, Dispatch, Measurements, ScheduleActor};
use crate::stage::{RunIteration, Settle, StageActor, StageEvent};
use crate::step::{GradStats, RankStep, StepDecision, StepReport};
use crate::transport::Transport;

/// The actors of one running job.
pub(super) struct Job<C: StageCompute> {
    pub(super) schedule: ActorRef<ScheduleActor>,
    pub(super) profiler: ActorRef<Profiler>,
    /// The stage actors of this process's ranks, `(rank, actor)`.
    pub(super) stages: Vec<(usize, ActorRef<StageActor<C>>)>,
    /// Stands in for the ranks of other processes (a multi-process job).
    pub(super) remote: Option<ActorRef<RemoteRank>>,
    /// Ranks of the whole job.
    pub(super) ranks: usize,
    pub(super) transport: Arc<dyn Transport<C::Tensor>>,
    pub(super) stats: Arc<dyn Transport<GradStats>>,
    pub(super) abort: Arc<AtomicBool>,
}

impl<C: StageCompute> Job<C> {
    pub(super) async fn dispatch(&self, iteration: u64) -> Result<()> {
        if iteration == 0 {
            let stages = (0..self.ranks)
                .map(|rank| match self.stages.iter().find(|(r, _)| *r == rank) {
                    Some((_, s)) => s.clone().recipient(),
                    None => self
                        .remote
                        .as_ref()
                        .expect("a job with ranks elsewhere has a stand-in")
                        .clone()
                        .recipient(),
                })
                .collect();
            self.schedule
                .tell(Attach {
                    stages,
                    memory: Some(self.profiler.clone().recipient()),
                })
                .await
                .map_err(|e| RuntimeError::Actor(format!("schedule actor: {e}")))?;
        }
        match self.schedule.ask(Dispatch { iteration }).await {
            Ok(()) => Ok(()),
            Err(kameo::error::SendError::HandlerError(e)) => Err(e),
            Err(e) => Err(RuntimeError::Actor(format!("schedule actor: {e}"))),
        }
    }

    /// Runs `iterations` iterations, keeping `in_flight` queued at each stage, then settles
    /// the last optimizer step; returns the steps.
    pub(super) async fn drive(
        &self,
        events: &mut tokio::sync::mpsc::UnboundedReceiver<StageEvent>,
        iterations: u64,
        in_flight: u64,
        stall_timeout: Option<Duration>,
    ) -> Result<Vec<StepReport>> {
        let ranks = self.stages.len();
        let mut steps = Steps::default();
        let mut next = 0;
        while next < iterations.min(in_flight) {
            self.dispatch(next).await?;
            next += 1;
        }
        // Ranks that finished each open iteration.
        let mut finished: HashMap<u64, Vec<usize>> = HashMap::new();
        let mut complete = 0;
        let mut progress = Instant::now();
        let mut watchdog = tokio::time::interval(Duration::from_millis(100));
        while complete < iterations {
            let event = tokio::select! {
                event = events.recv() => event,
                _ = watchdog.tick() => {
                    if let Some((rank, _)) = self.stages.iter().find(|(_, s)| !s.is_alive()) {
                        return Err(RuntimeError::Actor(format!(
                            "rank {rank}'s stage actor stopped without reporting"
                        )));
                    }
                    if let Some(timeout) = stall_timeout.filter(|t| progress.elapsed() > *t) {
                        let iteration = complete;
                        let done = finished.get(&iteration).map_or(&[][..], Vec::as_slice);
                        let waiting = self
                            .stages
                            .iter()
                            .map(|(r, _)| *r)
                            .filter(|r| !done.contains(r))
                            .collect();
                        return Err(RuntimeError::Stalled { iteration, waiting, timeout });
                    }
                    continue;
                }
            };
            match event {
                Some(StageEvent::Done { rank, iteration }) => {
                    progress = Instant::now();
                    let done = finished.entry(iteration).or_default();
                    done.push(rank);
                    if done.len() == ranks {
                        finished.remove(&iteration);
                        tracing::debug!(iteration, "iteration done on every rank");
                        complete += 1;
                        if next < iterations {
                            self.dispatch(next).await?;
                            next += 1;
                        }
                    }
                }
                Some(StageEvent::Stepped {
                    iteration,
                    grad_norm,
                    decision,
                    step,
                }) => steps.add(iteration, grad_norm, decision, step),
                Some(StageEvent::Failed(e)) => {
                    // The caller gets the error and reports it: one line, not two.
                    tracing::debug!("stopping the job: {e}");
                    return Err(e);
                }
                None => return Err(RuntimeError::Actor("every stage actor is gone".into())),
            }
        }
        // Every rank has sent its last statistics (before reporting done), so settling
        // only waits for the ranks' mailboxes to drain.
        for (rank, stage) in &self.stages {
            stage
                .ask(Settle)
                .await
                .map_err(|e| RuntimeError::Actor(format!("rank {rank}'s stage actor: {e}")))?;
        }
        while let Ok(event) = events.try_recv() {
            match event {
                StageEvent::Stepped {
                    iteration,
                    grad_norm,
                    decision,
                    step,
                } => steps.add(iteration, grad_norm, decision, step),
                StageEvent::Failed(e) => return Err(e),
                StageEvent::Done { .. } => {}
            }
        }
        steps.finish(ranks, iterations)
    }

    pub(super) async fn report(&self, clock: Clock, steps: Vec<StepReport>) -> Result<RunReport> {
        let profile = self
            .profiler
            .ask(Collect)
            .await
            .map_err(|e| RuntimeError::Actor(format!("profiler: {e}")))?;
        let (measured_cost, plan) = self
            .schedule
            .ask(Measurements)
            .await
            .map_err(|e| RuntimeError::Actor(format!("schedule actor: {e}")))?;
        Ok(RunReport {
            clock,
            iterations: profile.iterations,
            overall: profile.overall,
            measured_cost,
            plan,
            steps,
        })
    }

    /// Stops every actor. Blocked receives fail at once (the transport is closed); a stage in
    /// the middle of a compute action stops when that action returns.
    pub(super) fn shutdown(&self) {
        self.abort.store(true, Ordering::Release);
        self.transport.close();
        self.stats.close();
        for (_, s) in &self.stages {
            s.kill();
        }
        if let Some(r) = &self.remote {
            r.kill();
        }
        self.schedule.kill();
        self.profiler.kill();
    }
}

/// Receives the iterations dispatched to ranks of other processes and drops them: each
/// process dispatches the same plan to its own ranks.
pub(super) struct RemoteRank;

impl Actor for RemoteRank {
    type Args = Self;
    type Error = Infallible;

    async fn on_start(args: Self::Args, _actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(args)
    }
}

impl Message<RunIteration> for RemoteRank {
    type Reply = ();

    async fn handle(&mut self, _msg: RunIteration, _ctx: &mut Context<Self, Self::Reply>) {}
}

/// The optimizer steps reported so far, by iteration.
#[derive(Default)]
pub(super) struct Steps {
    by_iteration: BTreeMap<u64, StepReport>,
    /// Iterations whose ranks reported different norms or decisions.
    disagreed: Vec<u64>,
}

impl Steps {
    pub(super) fn add(
        &mut self,
        iteration: u64,
        grad_norm: f64,
        decision: StepDecision,
        step: RankStep,
    ) {
        let report = self
            .by_iteration
            .entry(iteration)
            .or_insert_with(|| StepReport {
                iteration,
                grad_norm,
                decision,
                ranks: Vec::new(),
            });
        if !report.decision.same_as(&decision) || report.grad_norm.to_bits() != grad_norm.to_bits()
        {
            self.disagreed.push(iteration);
        }
        report.ranks.push(step);
    }

    /// Every iteration's step from every rank, ranks in order; ranks that disagree on the
    /// decision are a bug in the runtime, reported rather than hidden.
    pub(super) fn finish(self, ranks: usize, iterations: u64) -> Result<Vec<StepReport>> {
        if let Some(iteration) = self.disagreed.first() {
            return Err(RuntimeError::Actor(format!(
                "optimizer step of iteration {iteration}: ranks reached different decisions"
            )));
        }
        let mut out = Vec::with_capacity(self.by_iteration.len());
        for (iteration, mut report) in self.by_iteration {
            report.ranks.sort_by_key(|r| r.rank);
            if report.ranks.len() != ranks {
                return Err(RuntimeError::Actor(format!(
                    "optimizer step of iteration {iteration}: {} of {ranks} ranks reported it",
                    report.ranks.len()
                )));
            }
            out.push(report);
        }
        if out.len() as u64 != iterations {
            return Err(RuntimeError::Actor(format!(
                "{} optimizer steps reported for {iterations} iterations",
                out.len()
            )));
        }
        Ok(out)
    }
}
