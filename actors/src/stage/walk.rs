//! The walk of one rank through one iteration of its plan: receives (and the bubbles they
//! cause), compute with panic capture and timing, local hand-offs and sends.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use pipefill_schedules::{Action, ActionKind, Plan};

use super::{RunIteration, StageActor};
use crate::compute::StageCompute;
use crate::error::{LinkError, RuntimeError};
use crate::filler::{Bubble, BubbleSpan, FillerSpan};
use crate::record::{ActionRecord, StageReport, StepRecord, StepWork};
use crate::transport::{Envelope, Flow, Tag};

/// A wall-clock receive that still blocked this long (seconds) after filling saw its
/// payload arrive; a shorter one found it already there.
const ARRIVAL_SEEN: f64 = 20e-6;

/// Key of a payload held on the rank: `(flow, consuming stage, micro-batch)`.
pub(super) type Key = (Flow, u32, u32);

/// A payload held on the rank with the time it became available.
pub(super) struct Held<T> {
    pub(super) payload: T,
    pub(super) at: f64,
}

/// The walk of one rank through one iteration.
pub(super) struct Walk<'a, C: StageCompute> {
    pub(super) actor: &'a mut StageActor<C>,
    plan: &'a Plan,
    pub(super) iteration: u64,
    lowered: bool,
    /// Predicted idle before each compute action of this rank (wall-clock filler hint).
    predicted_idle: HashMap<Action, f64>,
    /// Inputs ready for a compute action: local hand-offs and received payloads.
    ready: HashMap<Key, Held<C::Tensor>>,
    /// Outputs waiting for their SEND action (lowered plans only).
    outbox: HashMap<Key, Held<C::Tensor>>,
    /// Outputs of forwards that ran on speculatively stepped weights, kept on the rank
    /// until the step is validated (and recomputed if it was rolled back).
    pub(super) speculative: Vec<(Action, Key, Held<C::Tensor>)>,
    records: Vec<ActionRecord>,
    /// The walk's start and optimizer-step work (see [`StepRecord`]).
    steps: Vec<StepRecord>,
    /// Position in the action list of the action being run (the list's length after it).
    at: usize,
    bubbles: Vec<BubbleSpan>,
    fillers: Vec<FillerSpan>,
    /// Bubble time spent waiting for the action being run.
    waited: f64,
}

impl<'a, C: StageCompute> Walk<'a, C> {
    pub(super) fn new(actor: &'a mut StageActor<C>, msg: &'a RunIteration) -> Self {
        let rank = actor.wiring.rank;
        let predicted_idle = msg
            .predicted
            .iter()
            .flat_map(|t| t.slots.iter())
            .filter(|s| s.rank == rank)
            .filter_map(|s| s.after.map(|a| (a, s.length)))
            .collect();
        let n = msg.plan.ranks.get(rank).map_or(0, Vec::len);
        Walk {
            actor,
            plan: &msg.plan,
            iteration: msg.iteration,
            lowered: !msg.plan.is_compute_only(),
            predicted_idle,
            ready: HashMap::new(),
            outbox: HashMap::new(),
            speculative: Vec::new(),
            records: Vec::with_capacity(n),
            steps: Vec::new(),
            at: 0,
            bubbles: Vec::new(),
            fillers: Vec::new(),
            waited: 0.0,
        }
    }

    fn rank(&self) -> usize {
        self.actor.wiring.rank
    }

    pub(super) fn fail(&self, action: Action, cause: impl Into<String>) -> RuntimeError {
        RuntimeError::Stage {
            rank: self.rank(),
            iteration: self.iteration,
            action,
            cause: cause.into(),
        }
    }

    pub(super) fn run(mut self) -> Result<StageReport, RuntimeError> {
        let rank = self.rank();
        let plan = self.plan;
        let list = plan.ranks.get(rank).ok_or_else(|| {
            RuntimeError::Config(format!(
                "rank {rank} has no action list: the plan has {} ranks",
                plan.num_ranks()
            ))
        })?;
        let began = self.actor.clock.now();
        self.record_step(StepWork::Began, (began, began));
        for (index, step) in list.iter().enumerate() {
            let Some(action) = *step else { continue };
            self.at = index;
            if self.actor.wiring.abort.load(Ordering::Relaxed) {
                return Err(RuntimeError::Link {
                    rank,
                    iteration: self.iteration,
                    action,
                    source: LinkError::Closed,
                });
            }
            self.waited = 0.0;
            let (start, end) = match action.kind {
                ActionKind::RecvF | ActionKind::RecvB => self.recv_action(index, action)?,
                ActionKind::SendF | ActionKind::SendB => self.send_action(action)?,
                _ => self.compute_action(index, action)?,
            };
            self.records.push(ActionRecord {
                rank,
                iteration: self.iteration,
                index,
                action,
                start,
                end,
                waited: self.waited,
            });
        }
        self.at = list.len();
        // The last action stands for "the end of the iteration" in a barrier's bubble.
        let last = list
            .iter()
            .flatten()
            .last()
            .copied()
            .unwrap_or(Action::f(0, 0));
        // A rank whose actions all ran speculatively validates here at the latest.
        self.validate(last)?;
        if let Some(&(flow, stage, mb)) = self.outbox.keys().next() {
            let producer = match flow {
                Flow::Activation => Action::f(stage - 1, mb),
                Flow::Gradient | Flow::GradStats => Action::i(stage + 1, mb),
            };
            return Err(self.fail(
                producer,
                "its output was never sent: the plan has no SEND for it",
            ));
        }
        let optimizer = self.end_step(last)?;
        Ok(StageReport {
            rank,
            iteration: self.iteration,
            records: self.records,
            bubbles: self.bubbles,
            fillers: self.fillers,
            optimizer,
            steps: self.steps,
        })
    }

    /// Records optimizer-step work that ran over `(start, end)` before the current action.
    pub(super) fn record_step(&mut self, work: StepWork, (start, end): (f64, f64)) {
        self.steps.push(StepRecord {
            rank: self.rank(),
            iteration: self.iteration,
            before: self.at,
            work,
            start,
            end,
        });
    }

    /// The tag of the payload a RECV (or an on-demand receive) waits for.
    fn tag(&self, flow: Flow, stage: u32, microbatch: u32) -> Tag {
        Tag {
            flow,
            stage,
            microbatch,
            iteration: self.iteration,
        }
    }

    /// The next compute action at or after `index` (what a bubble delays).
    fn next_compute(&self, index: usize) -> Option<Action> {
        self.plan.ranks[self.rank()][index..]
            .iter()
            .flatten()
            .find(|a| a.kind.is_compute())
            .copied()
    }

    /// Takes a payload from the transport, recording the bubble spent waiting for it and
    /// offering that bubble to the filler. Returns the payload and when it became available.
    fn receive(
        &mut self,
        index: usize,
        action: Action,
        tag: Tag,
    ) -> Result<Held<C::Tensor>, RuntimeError> {
        let rank = self.rank();
        let transport = Arc::clone(&self.actor.wiring.transport);
        let iteration = self.iteration;
        let link = |source| RuntimeError::Link {
            rank,
            iteration,
            action,
            source,
        };
        let waiting_for = self.next_compute(index).unwrap_or(action);
        if self.actor.clock.is_virtual() {
            // Virtual: the payload's arrival time is known once it is here; the bubble is
            // the gap between the rank's clock and that arrival, exactly.
            let env = transport.recv(rank, &tag).map_err(link)?;
            let arrival = self.actor.clock.arrival(env.from, rank, env.sent_at);
            let start = self.actor.clock.now();
            if arrival > start {
                self.fill(waiting_for, |clock| Some(arrival - clock));
                self.actor.clock.advance_to(arrival);
                let span = self.bubble(start, waiting_for);
                let idle = Some(arrival - start);
                self.actor.wiring.filler.bubble_ended(&span, idle, idle);
            }
            return Ok(Held {
                payload: env.payload,
                at: arrival,
            });
        }
        if let Some(env) = transport.try_recv(rank, &tag).map_err(link)? {
            return Ok(Held {
                payload: env.payload,
                at: self.actor.clock.now(),
            });
        }
        // Wall: the payload is late, so this is a bubble; its length is only predicted.
        let start = self.actor.clock.now();
        let predicted = self.predicted_idle.get(&waiting_for).copied();
        self.fill(waiting_for, |clock| {
            predicted.map(|p| (p - (clock - start)).max(0.0))
        });
        let blocked = self.actor.clock.now();
        let env = transport.recv(rank, &tag).map_err(link)?;
        let span = self.bubble(start, waiting_for);
        // The arrival was seen only if the receive still had to wait once filling was done.
        let observed = (span.end - blocked > ARRIVAL_SEEN).then_some(span.end - span.start);
        self.actor
            .wiring
            .filler
            .bubble_ended(&span, predicted, observed);
        Ok(Held {
            payload: env.payload,
            at: self.actor.clock.now(),
        })
    }

    /// Records the bubble `[start, now)` spent waiting for `waiting_for`'s input.
    pub(super) fn bubble(&mut self, start: f64, waiting_for: Action) -> BubbleSpan {
        let end = self.actor.clock.now();
        self.waited += end - start;
        let span = BubbleSpan {
            rank: self.rank(),
            iteration: self.iteration,
            start,
            end,
            waiting_for,
        };
        self.bubbles.push(span);
        span
    }

    /// Offers the bubble to the filler until it declines; `remaining(clock)` is the idle
    /// time still expected at rank time `clock`.
    pub(super) fn fill(&mut self, waiting_for: Action, remaining: impl Fn(f64) -> Option<f64>) {
        loop {
            let bubble = Bubble {
                rank: self.rank(),
                iteration: self.iteration,
                waiting_for,
                predicted_idle: remaining(self.actor.clock.now()),
                exact: self.actor.clock.is_virtual(),
            };
            if matches!(bubble.predicted_idle, Some(t) if t <= 0.0) {
                return;
            }
            let Some(work) = self.actor.wiring.filler.fill(&bubble) else {
                return;
            };
            let watch = self.actor.clock.start();
            let outcome = catch_unwind(AssertUnwindSafe(work.run));
            let (start, end) = self.actor.clock.stop(watch);
            let error = match outcome {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(p) => Some(format!("panicked: {}", panic_text(&*p))),
            };
            if let Some(e) = &error {
                tracing::warn!(rank = self.rank(), label = %work.label, "filler work failed: {e}");
            }
            let span = FillerSpan {
                rank: self.rank(),
                iteration: self.iteration,
                start,
                end,
                label: work.label,
                predicted_cost: work.predicted_cost,
                error,
            };
            self.actor.wiring.filler.finished(&span);
            self.fillers.push(span);
        }
    }

    /// RECV_F / RECV_B: take the payload from the link and hold it for its compute action.
    fn recv_action(&mut self, index: usize, action: Action) -> Result<(f64, f64), RuntimeError> {
        let flow = match action.kind {
            ActionKind::RecvF => Flow::Activation,
            _ => Flow::Gradient,
        };
        let tag = self.tag(flow, action.stage, action.microbatch);
        let held = self.receive(index, action, tag)?;
        let t = self.actor.clock.now();
        self.ready
            .insert((flow, action.stage, action.microbatch), held);
        Ok((t, t))
    }

    /// SEND_F / SEND_B: ship the output its compute action left in the outbox.
    fn send_action(&mut self, action: Action) -> Result<(f64, f64), RuntimeError> {
        let (flow, to_stage) = match action.kind {
            ActionKind::SendF => (Flow::Activation, action.stage + 1),
            _ => (Flow::Gradient, action.stage.wrapping_sub(1)),
        };
        let key = (flow, to_stage, action.microbatch);
        // What it sends must not come from weights that may still be rolled back.
        self.validate(action)?;
        let held = self.outbox.remove(&key).ok_or_else(|| {
            self.fail(
                action,
                "nothing to send: the action that produces it has not run on this rank",
            )
        })?;
        let t = self.actor.clock.now();
        self.ship(action, key, held)?;
        Ok((t, self.actor.clock.now()))
    }

    fn ship(
        &mut self,
        action: Action,
        key: Key,
        held: Held<C::Tensor>,
    ) -> Result<(), RuntimeError> {
        let (flow, stage, microbatch) = key;
        let to = *self.plan.stage_rank.get(stage as usize).ok_or_else(|| {
            self.fail(
                action,
                format!("stage {stage} has no rank in the plan's placement"),
            )
        })?;
        let envelope = Envelope {
            tag: self.tag(flow, stage, microbatch),
            from: self.rank(),
            sent_at: held.at.max(self.actor.clock.now()),
            payload: held.payload,
        };
        self.actor
            .wiring
            .transport
            .send(to, envelope)
            .map_err(|source| RuntimeError::Link {
                rank: self.rank(),
                iteration: self.iteration,
                action,
                source,
            })
    }

    /// A compute action: gather its inputs (receiving on demand when a compute-only plan
    /// crosses ranks), run it on this thread with panic capture, and pass its outputs on.
    fn compute_action(&mut self, index: usize, action: Action) -> Result<(f64, f64), RuntimeError> {
        // The previous iteration's optimizer step changed the weights this action uses: it
        // must be exact before the action runs, unless the action may run speculatively.
        let speculative = self.before_compute(action)?;
        // At most two parts (an overlapped F+B); gather every input before timing, so that
        // waiting is a bubble, not compute.
        let mut inputs: [Option<C::Tensor>; 2] = [None, None];
        for (slot, part) in inputs.iter_mut().zip(action.parts()) {
            *slot = self.input_for(index, action, part)?.map(|h| h.payload);
        }
        let watch = self.actor.clock.start();
        let mut outputs: [Option<C::Tensor>; 2] = [None, None];
        for ((input, output), part) in inputs
            .iter_mut()
            .zip(outputs.iter_mut())
            .zip(action.parts())
        {
            *output = self.call(action, part, input.take())?;
        }
        let (start, end) = self.actor.clock.stop(watch);
        for (output, part) in outputs.iter_mut().zip(action.parts()) {
            let Some((flow, consumer)) = self.consumer(part) else {
                continue; // the last stage's forward or the first stage's backward
            };
            let payload = output.take().ok_or_else(|| {
                self.fail(
                    action,
                    format!("{part} returned no output, but stage {consumer} needs one"),
                )
            })?;
            let key = (flow, consumer, part.microbatch);
            let held = Held { payload, at: end };
            if speculative {
                self.speculative.push((action, key, held));
            } else {
                self.deliver(action, key, held)?;
            }
        }
        Ok((start, end))
    }

    /// Which stage consumes `part`'s output, and how it flows there.
    fn consumer(&self, part: Action) -> Option<(Flow, u32)> {
        let last = self.plan.stages.saturating_sub(1) as u32;
        match part.kind {
            ActionKind::F if part.stage < last => Some((Flow::Activation, part.stage + 1)),
            ActionKind::I | ActionKind::B if part.stage > 0 => {
                Some((Flow::Gradient, part.stage - 1))
            }
            _ => None,
        }
    }

    /// The input `part` consumes, if any: from the local buffer, or received on demand.
    fn input_for(
        &mut self,
        index: usize,
        action: Action,
        part: Action,
    ) -> Result<Option<Held<C::Tensor>>, RuntimeError> {
        let last = self.plan.stages.saturating_sub(1) as u32;
        let (flow, producer) = match part.kind {
            ActionKind::F if part.stage > 0 => {
                (Flow::Activation, Action::f(part.stage - 1, part.microbatch))
            }
            ActionKind::I | ActionKind::B if part.stage < last => {
                (Flow::Gradient, Action::i(part.stage + 1, part.microbatch))
            }
            _ => return Ok(None),
        };
        if let Some(held) = self.ready.remove(&(flow, part.stage, part.microbatch)) {
            return Ok(Some(held));
        }
        let producer_rank = self.plan.stage_rank.get(producer.stage as usize).copied();
        if producer_rank == Some(self.rank()) {
            return Err(self.fail(
                action,
                format!(
                    "its input is not there: stage {} on this rank has not produced it yet",
                    producer.stage
                ),
            ));
        }
        let tag = self.tag(flow, part.stage, part.microbatch);
        self.receive(index, action, tag).map(Some)
    }

    /// Runs one plain compute part through the [`StageCompute`], turning an error or a
    /// panic into a [`RuntimeError`] that names the rank and the action.
    pub(super) fn call(
        &mut self,
        action: Action,
        part: Action,
        input: Option<C::Tensor>,
    ) -> Result<Option<C::Tensor>, RuntimeError> {
        let compute = &mut self.actor.compute;
        let (s, mb) = (part.stage, part.microbatch);
        let outcome = catch_unwind(AssertUnwindSafe(|| match part.kind {
            ActionKind::F => compute.forward(s, mb, input),
            ActionKind::I => compute.backward_input(s, mb, input),
            ActionKind::W => compute.backward_weight(s, mb).map(|()| None),
            _ => compute.backward(s, mb, input),
        }));
        match outcome {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e)) => Err(self.fail(action, e.to_string())),
            Err(p) => Err(RuntimeError::Panic {
                rank: self.rank(),
                iteration: self.iteration,
                action,
                cause: panic_text(&*p),
            }),
        }
    }

    /// Hands an output to its consumer: locally when the consuming stage is on this rank,
    /// to the outbox when a SEND action of the plan will ship it, or straight to the link.
    pub(super) fn deliver(
        &mut self,
        action: Action,
        key: Key,
        held: Held<C::Tensor>,
    ) -> Result<(), RuntimeError> {
        let consumer_rank = self.plan.stage_rank.get(key.1 as usize).copied();
        let buffer = if consumer_rank == Some(self.rank()) {
            &mut self.ready
        } else if self.lowered {
            &mut self.outbox
        } else {
            return self.ship(action, key, held);
        };
        if buffer.insert(key, held).is_some() {
            return Err(self.fail(
                action,
                "it ran twice in one iteration: its output is already waiting",
            ));
        }
        Ok(())
    }
}

/// The text of a panic payload.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-text panic payload".to_string()
    }
}
