//! Subcommands of the `pipefill` binary, one module each.

pub mod schedule;
pub mod train;
