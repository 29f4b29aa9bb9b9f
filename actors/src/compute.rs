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

use std::fmt::Display;

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

    /// The optimizer step of every stage this rank holds, once the rank has run its whole
    /// part of `iteration`. It runs without a barrier: other ranks may still be busy with
    /// the same iteration. The default does nothing.
    fn optimizer_step(&mut self, iteration: u64) -> Result<(), Self::Error> {
        let _ = iteration;
        Ok(())
    }
}
