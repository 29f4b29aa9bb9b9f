//! Subcommands of the `pipefill` binary, one module each.

pub mod bench;
pub mod export;
pub mod generate;
pub mod job;
pub mod launch;
pub mod profile;
pub mod rl;
pub mod schedule;
pub mod show;
pub mod train;
