//! The stage threads of the rollout engine, joined by channels, so that groups of
//! sequences flow through the stages one behind another. A thread runs one [`InferStage`],
//! or a run of consecutive ones where the stages outnumber the cores (never with a hook:
//! its routing and idle work are per stage).
//!
//! A [`Work`] message is one group's step (prefill, decode or speculative verification):
//! stage `s` runs it against its KV cache and sends the activations on to stage `s + 1`;
//! the last stage sends logits and hidden states back to the driver. A verification is the
//! same message with K+1 positions per sequence, and its spans' `start` rolls back whatever
//! an earlier verification left beyond the accepted tokens. Each stage files every message
//! it takes with the optional [`MessageHook`], the seam through which a bubble router
//! (`FillerRouter`, see [`super::idle`]) sees the traffic and fills the stages' idle time:
//!
//! - a message of a kind the hook [`routes`](MessageHook::routes) (verification) waits at
//!   its stage until the hook hands it back ([`IdleTurn::Routed`]); the stage runs it then,
//!   as its own work;
//! - when its inbox is empty (the long tail: few groups in flight, the stage waits for the
//!   others), the stage asks the hook for idle work ([`MessageHook::idle`]), e.g. a slice of
//!   drafter training, and only blocks on its inbox when the hook has none.
//!
//! The stage's compute (what the rollout measures as busy) is its messages' forwards; idle
//! work is the hook's to time and record.
//!
//! A step that is the only group in flight may instead run through every stage on the
//! driver's thread ([`run_inline`]): the stages would run one after another anyway, and
//! each hand-off between threads is a wake-up that, on a machine with fewer cores than
//! threads, waits for a core. Each stage sits behind a lock that its thread holds only
//! while it runs a message.

use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::model::drafter::DraftRow;

use crate::model::ModelError;
use crate::model::infer::{InferStage, Span, StageInput, StageOutput, TreeStep};
use crate::tensor::Backend;

/// What kind of step a message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkKind {
    Prefill,
    Decode,
    /// Verification of K draft tokens (K+1 positions per sequence).
    Verify {
        k: usize,
    },
}

/// Sees every message a stage takes (e.g. to file it with a bubble router) and may route
/// messages and fill the stages' idle time (see the module docs). Only
/// [`MessageHook::filed`] is required: by default nothing is routed and no idle work runs.
pub trait MessageHook: Send + Sync {
    /// Stage `stage` starts `kind` for `rows` positions of group `group`.
    fn filed(&self, stage: usize, group: usize, kind: WorkKind, rows: usize);

    /// Whether stage `stage` queues messages of `kind` with the hook ([`MessageHook::queue`])
    /// and runs them when [`MessageHook::idle`] hands them back.
    fn routes(&self, _stage: usize, _kind: WorkKind) -> bool {
        false
    }

    /// Group `group`'s message of `kind` waits at stage `stage` for the hook.
    fn queue(&self, _stage: usize, _group: usize, _kind: WorkKind) {}

    /// Stage `stage` has nothing in its inbox; `waiting`: routed messages wait at it. What
    /// it does next.
    fn idle(&self, _stage: usize, _waiting: bool) -> IdleTurn {
        IdleTurn::Wait
    }

    /// The routed message handed back last by [`MessageHook::idle`] ran over
    /// `[start, end)`.
    fn routed_ran(&self, _stage: usize, _start: Instant, _end: Instant) {}

    /// Stage `stage` blocked on its inbox over `[start, end)`.
    fn waited(&self, _stage: usize, _start: Instant, _end: Instant) {}

    /// A sequence finished; its drafter-training row (rollouts that record rows only).
    fn row(&self, _row: &DraftRow) {}

    /// Sequence `seq` (its request's index) grew by `tokens`, what one step accepted (a
    /// plain step's token, or a verification's accepted draft and bonus token), in order,
    /// on the driver's thread as the step ends; the last may be the EOS that ends it.
    fn tokens(&self, _seq: usize, _tokens: &[u32]) {}
}

/// What an idle stage does next (the answer of [`MessageHook::idle`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleTurn {
    /// Run the routed message of this group now.
    Routed { group: usize },
    /// The hook ran a piece of idle work on the stage's thread; ask again.
    Worked,
    /// Nothing to do: block on the inbox.
    Wait,
}

/// One message between stages.
pub(crate) enum Msg<B: Backend> {
    Work {
        group: usize,
        kind: WorkKind,
        spans: Vec<Span>,
        /// Token ids (to the first stage only).
        ids: Vec<u32>,
        /// Activations (to every later stage).
        hidden: Option<B::Buf>,
        /// Draft-tree spans and cache compactions (see [`TreeStep`]), for every stage.
        tree: Option<TreeStep>,
        /// Compute time the stages before this one spent on the step.
        spent: Duration,
    },
    /// The sequences finished: drop their caches.
    Release(Vec<usize>),
}

/// What the last stage returns to the driver.
pub(crate) struct Done {
    pub group: usize,
    pub logits: Vec<f32>,
    pub hidden: Vec<f32>,
    /// Compute time every stage spent on the step (not the time it waited in their
    /// queues behind other groups): what the step cost the pipeline.
    pub spent: Duration,
}

/// Runs the stages `stages` (stage `index` and the ones after it, in order: one stage
/// with a hook) until the inbox closes; returns the time each spent computing. A stage is
/// locked only while a message runs through it (the driver may run a lone group through it
/// in between: [`run_inline`]).
pub(crate) fn stage_loop<B: Backend>(
    index: usize,
    stages: &[Mutex<&mut InferStage<B>>],
    inbox: Receiver<Msg<B>>,
    next: Option<Sender<Msg<B>>>,
    driver: Sender<Result<Done, ModelError>>,
    hook: Option<Arc<dyn MessageHook>>,
) -> Vec<Duration> {
    let mut busy = vec![Duration::ZERO; stages.len()];
    // Routed messages waiting for the hook, oldest first.
    let mut routed: Vec<(usize, Msg<B>)> = Vec::new();
    let out = Outlets {
        index,
        next: &next,
        driver: &driver,
    };
    loop {
        // The work to run now, and whether the hook picked it from the routed queue.
        let next_work = match inbox.try_recv() {
            Ok(msg) => intake(msg, &hook, index, &mut routed, stages, &next).map(|w| (w, false)),
            Err(TryRecvError::Disconnected) if routed.is_empty() => break,
            Err(_) => {
                let turn = hook
                    .as_ref()
                    .map_or(IdleTurn::Wait, |h| h.idle(index, !routed.is_empty()));
                match turn {
                    IdleTurn::Worked => None,
                    IdleTurn::Routed { group } => {
                        let at = routed.iter().position(|(rg, _)| *rg == group).unwrap_or(0);
                        Some((routed.remove(at).1, true))
                    }
                    // A hook that keeps a routed message waiting would stall the rollout:
                    // the oldest runs now.
                    IdleTurn::Wait if !routed.is_empty() => Some((routed.remove(0).1, false)),
                    IdleTurn::Wait => {
                        let t = Instant::now();
                        let Ok(msg) = inbox.recv() else { break };
                        if let Some(h) = &hook {
                            h.waited(index, t, Instant::now());
                        }
                        intake(msg, &hook, index, &mut routed, stages, &next).map(|w| (w, false))
                    }
                }
            }
        };
        let Some((work, picked)) = next_work else {
            continue;
        };
        let t = Instant::now();
        let sent = run(stages, work, &out, &mut busy);
        let end = Instant::now();
        if let (Some(h), true) = (&hook, picked) {
            h.routed_ran(index, t, end);
        }
        if !sent {
            break;
        }
    }
    busy
}

/// Where a stage's results go.
struct Outlets<'a, B: Backend> {
    index: usize,
    next: &'a Option<Sender<Msg<B>>>,
    driver: &'a Sender<Result<Done, ModelError>>,
}

/// Takes one message in: releases run at once (and travel on), routed work waits in
/// `routed`; returns the work to run now.
fn intake<B: Backend>(
    msg: Msg<B>,
    hook: &Option<Arc<dyn MessageHook>>,
    index: usize,
    routed: &mut Vec<(usize, Msg<B>)>,
    stages: &[Mutex<&mut InferStage<B>>],
    next: &Option<Sender<Msg<B>>>,
) -> Option<Msg<B>> {
    match msg {
        Msg::Release(slots) => {
            for stage in stages {
                let mut stage = lock(stage);
                slots.iter().for_each(|&s| stage.release(s));
            }
            if let Some(n) = next {
                let _ = n.send(Msg::Release(slots));
            }
            None
        }
        Msg::Work {
            group,
            kind,
            ref spans,
            ..
        } => {
            if let Some(h) = hook {
                h.filed(index, group, kind, spans.iter().map(|s| s.len).sum());
                if h.routes(index, kind) {
                    routed.push((group, msg));
                    h.queue(index, group, kind);
                    return None;
                }
            }
            Some(msg)
        }
    }
}

/// A stage's lock (poisoned only by a panic, which ends the rollout anyway).
fn lock<'a, 'b, B: Backend>(
    stage: &'a Mutex<&'b mut InferStage<B>>,
) -> MutexGuard<'a, &'b mut InferStage<B>> {
    stage.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs work message `msg` through every stage in turn on the calling thread, adding each
/// stage's compute time to `busy`: what the stage threads would have done, without their
/// hand-offs.
pub(crate) fn run_inline<B: Backend>(
    stages: &[Mutex<&mut InferStage<B>>],
    msg: Msg<B>,
    busy: &mut [Duration],
) -> Result<Done, ModelError> {
    let Msg::Work {
        group,
        spans,
        ids,
        tree,
        mut spent,
        ..
    } = msg
    else {
        return Err(ModelError::Input {
            stage: 0,
            mb: 0,
            reason: "only work runs inline".into(),
        });
    };
    match forward_through(stages, &spans, tree.as_ref(), &ids, None, busy, &mut spent)? {
        StageOutput::Final { logits, hidden } => Ok(Done {
            group,
            logits,
            hidden,
            spent,
        }),
        StageOutput::Hidden(_) => Err(no_head(stages.len().saturating_sub(1), group)),
    }
}

/// Runs one step through `stages` in turn, each locked while it runs, from `hidden` (the
/// previous stage's activations) or else from `ids` (the first stage's tokens); adds each
/// stage's compute time to its `busy` and to `spent`. The last stage's output.
fn forward_through<B: Backend>(
    stages: &[Mutex<&mut InferStage<B>>],
    spans: &[Span],
    tree: Option<&TreeStep>,
    ids: &[u32],
    mut hidden: Option<B::Buf>,
    busy: &mut [Duration],
    spent: &mut Duration,
) -> Result<StageOutput<B>, ModelError> {
    let last = stages.len().saturating_sub(1);
    for (s, (stage, busy)) in stages.iter().zip(busy).enumerate() {
        let input = match hidden.take() {
            Some(h) => StageInput::Hidden(h),
            None => StageInput::Tokens(ids),
        };
        let t = Instant::now();
        let out = lock(stage).forward_with(spans, tree, input);
        let took = t.elapsed();
        *busy += took;
        *spent += took;
        match out? {
            StageOutput::Hidden(h) if s < last => hidden = Some(h),
            out => return Ok(out),
        }
    }
    Err(ModelError::Input {
        stage: 0,
        mb: 0,
        reason: "no stage to run".into(),
    })
}

/// The error of a step that left the last stage without logits.
fn no_head(stage: usize, group: usize) -> ModelError {
    ModelError::Input {
        stage,
        mb: group,
        reason: "the last stage has no LM head".into(),
    }
}

/// Runs one work message through the thread's stages and sends the result on; `false`
/// when the receiver is gone (the rollout stopped).
fn run<B: Backend>(
    stages: &[Mutex<&mut InferStage<B>>],
    msg: Msg<B>,
    out: &Outlets<'_, B>,
    busy: &mut [Duration],
) -> bool {
    let Msg::Work {
        group,
        kind,
        spans,
        ids,
        hidden,
        tree,
        mut spent,
    } = msg
    else {
        return true;
    };
    let result = forward_through(
        stages,
        &spans,
        tree.as_ref(),
        &ids,
        hidden,
        busy,
        &mut spent,
    );
    match result {
        Ok(StageOutput::Hidden(h)) => match out.next {
            Some(n) => n
                .send(Msg::Work {
                    group,
                    kind,
                    spans,
                    ids: Vec::new(),
                    hidden: Some(h),
                    tree,
                    spent,
                })
                .is_ok(),
            None => out
                .driver
                .send(Err(no_head(out.index + stages.len() - 1, group)))
                .is_ok(),
        },
        Ok(StageOutput::Final { logits, hidden }) => out
            .driver
            .send(Ok(Done {
                group,
                logits,
                hidden,
                spent,
            }))
            .is_ok(),
        Err(e) => out.driver.send(Err(e)).is_ok(),
    }
}
