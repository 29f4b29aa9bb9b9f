//! The `StageCompute` trait: what one rank does for each action of its plan.
//!
//! The runtime is model-free: it moves payloads between ranks and decides *when* each
//! action runs; an implementation of this trait decides *what* it does. `src/` implements
//! it for a real model shard; tests implement it with a fake whose costs are known.
//!
//! Inputs follow the pipeline's data flow. A forward (F) of stage `s` receives the
//! activation stage `s − 1` produced (none for the first stage) and returns the activation
//! for stage `s + 1` (ignored for the last stage). An input-gradient backward (I) or a full
//! backward (B) of stage `s` receives the gradient stage `s + 1` produced (none for the last
//! stage, which starts the backward from its loss) and returns the gradient for stage
//! `s − 1` (ignored for the first stage). A weight-gradient backward (W) takes nothing and
//! returns nothing: it only uses what the stage stashed itself.
//!
//! After its part of an iteration, a rank reports its gradient statistics
//! ([`StageCompute::grad_stats`]) and steps with the decision the ranks reach
//! ([`StageCompute::apply_step`]), possibly speculatively, to be undone with
//! [`StageCompute::rollback_step`]; [`crate::step`] explains the protocol. Every one of
//! these has a default, so an implementation that neither clips nor checks for NaN/Inf only
//! implements [`StageCompute::optimizer_step`].

use std::fmt::Display;

use crate::step::{GradStats, StepDecision};

/// One rank's computation, for every stage (model chunk) the rank holds.
///
/// Methods run on the stage actor's own OS thread, never on a tokio worker, so they may
/// block and spin freely; in virtual-clock mode the thread CPU time they use is their cost.
pub trait StageCompute: Send + 'static {
    /// What travels between stages: activations forward, gradients backward. It is moved,
    /// never copied, by the in-process transport.
    type Tensor: Send + 'static;
    /// What a failing action reports; it becomes the cause in [`crate::RuntimeError`].
    type Error: Display + Send + 'static;

    /// Forward of `microbatch` through `stage`. `input` is `None` only for stage 0.
    /// Returns the activation for `stage + 1`; `None` is allowed only for the last stage.
    fn forward(
        &mut self,
        stage: u32,
        microbatch: u32,
        input: Option<Self::Tensor>,
    ) -> Result<Option<Self::Tensor>, Self::Error>;

    /// Input-gradient backward of `microbatch` through `stage`. `grad` is `None` only for
    /// the last stage. Returns the gradient for `stage − 1`; `None` is allowed only for
    /// stage 0.
    fn backward_input(
        &mut self,
        stage: u32,
        microbatch: u32,
        grad: Option<Self::Tensor>,
    ) -> Result<Option<Self::Tensor>, Self::Error>;

    /// Weight-gradient backward of `microbatch` through `stage`, from what the matching
    /// [`StageCompute::backward_input`] left stashed.
    fn backward_weight(&mut self, stage: u32, microbatch: u32) -> Result<(), Self::Error>;

    /// Full backward (I then W fused). The default runs the two halves in that order;
    /// an implementation may fuse them.
    fn backward(
        &mut self,
        stage: u32,
        microbatch: u32,
        grad: Option<Self::Tensor>,
    ) -> Result<Option<Self::Tensor>, Self::Error> {
        let out = self.backward_input(stage, microbatch, grad)?;
        self.backward_weight(stage, microbatch)?;
        Ok(out)
    }

    /// The optimizer step of every stage this rank holds for `iteration`, unclipped. The
    /// default does nothing. The runtime calls it through the default
    /// [`StageCompute::apply_step`]; an implementation that reports [`GradStats`] overrides
    /// `apply_step` instead, and this method is then never called by the runtime.
    fn optimizer_step(&mut self, iteration: u64) -> Result<(), Self::Error> {
        let _ = iteration;
        Ok(())
    }

    /// This rank's gradient statistics for `iteration`, over every stage it holds, once its
    /// whole part of the iteration has run: the sum of squared gradient entries and whether
    /// any is NaN/Inf. They decide global-norm clipping and skipping (see [`crate::step`]).
    /// The default reports a zero, finite norm: never clip, never skip.
    fn grad_stats(&mut self, iteration: u64) -> Result<GradStats, Self::Error> {
        let _ = iteration;
        Ok(GradStats::default())
    }

    /// The optimizer step of `iteration` with the decision the ranks reached: scale the
    /// gradients by `clip_scale` and step, or skip (keep parameters and optimizer state,
    /// discard the gradients). Either way the iteration's gradients are consumed, ready
    /// for the next iteration to accumulate into.
    ///
    /// `speculative` is true when the decision may still be wrong: the implementation must
    /// then keep what [`StageCompute::rollback_step`] needs to undo the step (parameters,
    /// optimizer state and the gradients before the step) until the runtime calls
    /// [`StageCompute::rollback_step`] or [`StageCompute::confirm_step`] for `iteration`,
    /// which it does before any action of the next iteration. The runtime passes `true`
    /// only when [`StageCompute::can_roll_back`] is true.
    ///
    /// The default calls [`StageCompute::optimizer_step`] for `Apply` (ignoring the scale:
    /// with the default [`StageCompute::grad_stats`] it is always 1) and does nothing for
    /// `Skip`.
    fn apply_step(
        &mut self,
        iteration: u64,
        decision: StepDecision,
        speculative: bool,
    ) -> Result<(), Self::Error> {
        let _ = speculative;
        match decision {
            StepDecision::Apply { .. } => self.optimizer_step(iteration),
            StepDecision::Skip => Ok(()),
        }
    }

    /// Whether this compute can undo a speculative step ([`StageCompute::rollback_step`]).
    /// When false (the default) the runtime never steps speculatively: under
    /// [`crate::StepMode::PostValidate`] it defers the step until it knows every rank's
    /// statistics, just before the next iteration's first action.
    ///
    /// When true, two more things may happen, and the implementation must allow them:
    /// forwards of the first stage (stage 0, input `None`) of iteration k+1 may run after
    /// the speculative step of k and before it is confirmed; and after a rollback the
    /// runtime calls [`StageCompute::forward`] again for each of those (same stage and
    /// micro-batch, on the corrected weights), and that second call must replace whatever
    /// the first one stashed and feed the same data.
    fn can_roll_back(&self) -> bool {
        false
    }

    /// Undoes the speculative step of `iteration`: parameters, optimizer state and
    /// gradients are restored to what they were before it, so that
    /// [`StageCompute::apply_step`] can redo it with the exact decision. Called only after
    /// a speculative step, and only when [`StageCompute::can_roll_back`] is true.
    fn rollback_step(&mut self, iteration: u64) -> Result<(), Self::Error> {
        let _ = iteration;
        Ok(())
    }

    /// The speculative step of `iteration` was right: its snapshot may be dropped.
    fn confirm_step(&mut self, iteration: u64) -> Result<(), Self::Error> {
        let _ = iteration;
        Ok(())
    }
}
