//! The stage threads of the rollout engine: one thread per [`InferStage`], joined by
//! channels, so that groups of sequences flow through the stages one behind another.
//!
//! A [`Work`] message is one group's step (prefill, decode or speculative verification):
//! stage `s` runs it against its KV cache and sends the activations on to stage `s + 1`;
//! the last stage sends logits and hidden states back to the driver. A verification is the
//! same message with K+1 positions per sequence, and its spans' `start` rolls back whatever
//! an earlier verification left beyond the accepted tokens. Each stage files every message
//! it takes with the optional [`MessageHook`], the seam through which a bubble router
//! (`FillerRouter`) can see the traffic.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use crate::model::ModelError;
use crate::model::infer::{InferStage, Span, StageInput, StageOutput};
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

/// Sees every message a stage takes (e.g. to file it with a bubble router).
pub trait MessageHook: Send + Sync {
    /// Stage `stage` starts `kind` for `rows` positions of group `group`.
    fn filed(&self, stage: usize, group: usize, kind: WorkKind, rows: usize);
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
    },
    /// The sequences finished: drop their caches.
    Release(Vec<usize>),
}

/// What the last stage returns to the driver.
pub(crate) struct Done {
    pub group: usize,
    pub logits: Vec<f32>,
    pub hidden: Vec<f32>,
}

/// Runs stage `index` until its inbox closes; returns the time it spent computing.
pub(crate) fn stage_loop<B: Backend>(
    index: usize,
    stage: &mut InferStage<B>,
    inbox: Receiver<Msg<B>>,
    next: Option<Sender<Msg<B>>>,
    driver: Sender<Result<Done, ModelError>>,
    hook: Option<Arc<dyn MessageHook>>,
) -> Duration {
    let mut busy = Duration::ZERO;
    for msg in inbox {
        let (group, kind, spans, ids, hidden) = match msg {
            Msg::Release(slots) => {
                slots.iter().for_each(|&s| stage.release(s));
                if let Some(n) = &next {
                    let _ = n.send(Msg::Release(slots));
                }
                continue;
            }
            Msg::Work {
                group,
                kind,
                spans,
                ids,
                hidden,
            } => (group, kind, spans, ids, hidden),
        };
        if let Some(h) = &hook {
            h.filed(index, group, kind, spans.iter().map(|s| s.len).sum());
        }
        let t = Instant::now();
        let input = match hidden {
            Some(h) => StageInput::Hidden(h),
            None => StageInput::Tokens(&ids),
        };
        let out = stage.forward(&spans, input);
        busy += t.elapsed();
        let sent = match out {
            Ok(StageOutput::Hidden(h)) => match &next {
                Some(n) => n
                    .send(Msg::Work {
                        group,
                        kind,
                        spans,
                        ids: Vec::new(),
                        hidden: Some(h),
                    })
                    .is_ok(),
                None => driver
                    .send(Err(ModelError::Input {
                        stage: index,
                        mb: group,
                        reason: "the last stage has no LM head".into(),
                    }))
                    .is_ok(),
            },
            Ok(StageOutput::Final { logits, hidden }) => driver
                .send(Ok(Done {
                    group,
                    logits,
                    hidden,
                }))
                .is_ok(),
            Err(e) => driver.send(Err(e)).is_ok(),
        };
        if !sent {
            break;
        }
    }
    busy
}
