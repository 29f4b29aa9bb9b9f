//! `StageActor`: one per rank. It owns the rank's [`StageCompute`] and walks the rank's
//! action list of each iteration's plan.
//!
//! The actor is spawned with kameo's `spawn_in_thread`, so it owns an OS thread: compute,
//! blocking receives and filler work all run there, never on a tokio worker, and in
//! virtual-clock mode the thread's CPU time is exactly the cost of the rank's work.
//!
//! Payloads move through the [`Transport`] for cross-rank edges (executing the lowered
//! plan's SEND/RECV actions, or sending/receiving on demand when the plan is compute-only)
//! and through a local buffer between stages that live on the same rank. When the next
//! action's input has not arrived, the rank is in a bubble: the bubble is recorded and
//! offered to the [`BubbleFiller`].
//!
//! Iterations are queued in the actor's mailbox, so a rank starts iteration k+1 as soon as
//! its own part of k is done; payloads are tagged by iteration, so early arrivals wait in
//! the transport's buffer.
//!
//! After its part of an iteration the rank reports its gradient statistics to every other
//! rank and takes the optimizer step under the job's [`StepPolicy`] (see [`crate::step`]):
//! at once after a barrier, or speculatively, validated before the next iteration's first
//! compute action (`step.rs`).

mod step;
mod walk;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kameo::Actor;
use kameo::actor::{ActorRef, Recipient};
use kameo::error::Infallible;
use kameo::message::{Context, Message};
use pipefill_schedules::{Plan, Timeline};
use tokio::sync::mpsc::UnboundedSender;

use crate::clock::{Clock, RankClock};
use crate::compute::StageCompute;
use crate::error::RuntimeError;
use crate::filler::BubbleFiller;
use crate::record::StageReport;
use crate::step::{GradStats, RankStep, StepDecision, StepPolicy};
use crate::transport::Transport;

use step::Pending;

use walk::Walk;

/// Runs one iteration of a plan on every stage that receives it.
#[derive(Clone, Debug)]
pub struct RunIteration {
    pub iteration: u64,
    pub plan: Arc<Plan>,
    /// The schedule's prediction for this iteration (seconds), used to tell the bubble
    /// filler how long a wall-clock bubble should last.
    pub predicted: Option<Arc<Timeline>>,
}

/// A stage's report of one iteration, shared with every observer (profiler, schedule).
#[derive(Clone, Debug)]
pub struct Measured(pub Arc<StageReport>);

/// What a stage tells the job's coordinator.
#[derive(Debug)]
pub enum StageEvent {
    /// The rank finished its part of `iteration` (its report went to the observers first).
    Done { rank: usize, iteration: u64 },
    /// The rank knows the exact optimizer step of `iteration` and has taken it.
    Stepped {
        iteration: u64,
        /// The global gradient norm (NaN when a gradient was non-finite).
        grad_norm: f64,
        decision: StepDecision,
        step: RankStep,
    },
    /// The rank failed; the job must stop.
    Failed(RuntimeError),
}

/// Settles the optimizer step of the last iteration a stage ran (its validation would
/// otherwise wait for an iteration that never comes). Sent once, after the last iteration.
#[derive(Clone, Copy, Debug)]
pub struct Settle;

/// How a stage is wired into its job.
pub struct StageWiring<T> {
    pub rank: usize,
    pub clock: Clock,
    /// The job's time origin (wall-clock mode).
    pub epoch: Instant,
    pub transport: Arc<dyn Transport<T>>,
    /// Carries each rank's [`GradStats`] to every other rank ([`crate::Flow::GradStats`]).
    pub stats: Arc<dyn Transport<GradStats>>,
    /// Clipping and how the ranks agree on each optimizer step.
    pub step: StepPolicy,
    pub filler: Box<dyn BubbleFiller>,
    /// Who receives each iteration's report (profiler, schedule actor).
    pub observers: Vec<Recipient<Measured>>,
    pub events: UnboundedSender<StageEvent>,
    /// Set by the coordinator when the job stops: queued iterations are then skipped.
    pub abort: Arc<AtomicBool>,
}

/// The actor of one rank.
pub struct StageActor<C: StageCompute> {
    compute: C,
    wiring: StageWiring<C::Tensor>,
    clock: RankClock,
    /// The optimizer step of the previous iteration, not yet validated.
    pending: Option<Pending>,
}

impl<C: StageCompute> StageActor<C> {
    pub fn new(compute: C, wiring: StageWiring<C::Tensor>) -> Self {
        let clock = RankClock::new(wiring.clock, wiring.epoch);
        StageActor {
            compute,
            wiring,
            clock,
            pending: None,
        }
    }
}

impl<C: StageCompute> Actor for StageActor<C> {
    type Args = Self;
    type Error = Infallible;

    async fn on_start(args: Self::Args, _actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(args)
    }
}

impl<C: StageCompute> Message<RunIteration> for StageActor<C> {
    type Reply = ();

    async fn handle(&mut self, msg: RunIteration, _ctx: &mut Context<Self, Self::Reply>) {
        if self.wiring.abort.load(Ordering::Acquire) {
            return;
        }
        let rank = self.wiring.rank;
        let iteration = msg.iteration;
        let event = match Walk::new(self, &msg).run() {
            Ok(report) => {
                let report = Arc::new(report);
                for observer in &self.wiring.observers {
                    // An observer that stopped only loses measurements; the job goes on.
                    let _ = observer.tell(Measured(Arc::clone(&report))).try_send();
                }
                StageEvent::Done { rank, iteration }
            }
            Err(e) => StageEvent::Failed(e),
        };
        let _ = self.wiring.events.send(event);
    }
}

impl<C: StageCompute> Message<Settle> for StageActor<C> {
    type Reply = ();

    async fn handle(&mut self, _msg: Settle, _ctx: &mut Context<Self, Self::Reply>) {
        if self.wiring.abort.load(Ordering::Acquire) {
            return;
        }
        if let Err(e) = self.settle_final() {
            let _ = self.wiring.events.send(StageEvent::Failed(e));
        }
    }
}
