//! pipefill: a pipeline-parallel training engine in which every stage is an actor and the
//! pipeline's bubbles do useful work.
//!
//! This crate is the concrete engine (DESIGN.md, "src/"):
//! - [`tensor`]: the `Backend` trait, its CPU implementation and (feature `cuda`) its CUDA one.
//! - [`model`]: GPT layers with the backward split into I and W, stage chunks, AdamW,
//!   checkpoints, and the single-device reference trainer.
//! - [`data`]: synthetic reasoning tasks with verifiable answers, and the tokenizer.
//! - [`profile`]: trace and timeline writers (Chrome/Perfetto JSON, SVG).
//! - [`rl`]: RL rollouts: the KV-cache generation engine and speculative decoding.
//! - [`run`]: what every way of running a job shares (the run directory).
//! - [`input`]: the one bounded reader of the files a user hands the program.
//!
//! The schedule IR, generators and simulator live in `pipefill-schedules`, re-exported as
//! [`schedules`] with the reading of schedule files.

pub mod comm;
pub mod config;
pub mod data;
pub mod input;
pub mod launch;
pub mod model;
pub mod pipeline;
pub mod profile;
pub mod rl;
pub mod run;
pub mod schedules;
pub mod tensor;
pub mod train;
