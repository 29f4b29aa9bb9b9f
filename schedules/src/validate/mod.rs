//! The validator: is a plan (compute-only or lowered) a correct, executable iteration?
//!
//! Rules, checked in this order (the first broken one is reported, naming the rank, the
//! step — the 0-based position in the rank's list, idle steps included — the offending
//! action and the rule):
//!
//! 1. **Shape and placement.** The stage → rank table covers every stage and matches the
//!    named placement; every action names an existing stage and micro-batch; all actions
//!    of a stage are on one rank, and that rank is `rank_of(stage)`.
//! 2. **Exactly once.** Every (stage, micro-batch) has one forward and one backward: I+W,
//!    or B (a plain B or the backward half of an OVERLAP_F_B), never a mix or a repeat.
//!    In a lowered plan, every hand-over between stages on different ranks has its SEND
//!    and its RECV, exactly once; none exists between stages on the same rank.
//! 3. **Dependencies and deadlock.** All ranks are executed together, each walking its
//!    list in order. A SEND is buffered: it completes locally at once. A RECV blocks until
//!    its matching SEND has executed. In a compute-only plan, a cross-rank data dependency
//!    (F(s,mb) on F(s−1,mb); the backward of (s,mb) on the backward of (s+1,mb)) blocks the
//!    same way, as if its RECV sat right before the action. Dependencies inside one rank
//!    (on the same rank the previous stage's forward, the own forward before I/B, I before
//!    W, a SEND after what it sends, an action after its RECV) are order checks: if the
//!    dependency has not run yet it comes later in the list, which is an error. If every
//!    unfinished rank is blocked, the plan deadlocks and every waiting rank is named by
//!    the data it waits for and the stage that sends it: "deadlock: rank 0 waits for
//!    RECV_B 1/4, rank 1 waits for RECV_F 0/5".
//! 4. **Memory.** Per-rank peak activation memory ([`crate::memory`]), checked against
//!    an optional limit.
//!
//! Everything is O(actions): per-(stage, micro-batch) state lives in flat vectors indexed
//! by `stage · microbatches + microbatch`, and blocked ranks are woken by the event they
//! wait for, never polled.

mod checks;
mod exec;
#[cfg(test)]
mod tests;

use crate::error::{Result, ScheduleError};
use crate::memory::peak_memory;
use crate::plan::Plan;
use crate::timeline::CostModel;

pub(crate) use checks::Structure;

/// What [`validate`] checks beyond correctness.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ValidateOptions {
    /// Memory costs (`m_b`, `m_w`) for the peak-memory figure.
    pub cost: CostModel,
    /// Per-rank activation memory limit, in the cost model's units; `None` = unlimited.
    pub memory_limit: Option<f64>,
}

/// What a valid plan is found to need.
#[derive(Clone, Debug, PartialEq)]
pub struct Validation {
    /// Per-rank peak activation memory (index = rank).
    pub peak_memory: Vec<f64>,
}

/// Checks every rule of the module docs; the first broken one is the error.
pub fn validate(plan: &Plan, opts: &ValidateOptions) -> Result<Validation> {
    check_executable(plan)?;
    let peak = peak_memory(plan, &opts.cost);
    if let Some(limit) = opts.memory_limit
        && let Some((rank, &p)) = peak.iter().enumerate().find(|(_, p)| **p > limit)
    {
        return Err(ScheduleError::Memory {
            rank,
            peak: p,
            limit,
        });
    }
    Ok(Validation { peak_memory: peak })
}

/// Rules 1 to 3 (everything but memory); what exists per (stage, micro-batch) on success.
pub(crate) fn check_executable(plan: &Plan) -> Result<Structure> {
    let structure = checks::check_structure(plan)?;
    checks::check_complete(plan, &structure)?;
    exec::execute(plan, &structure)?;
    Ok(structure)
}

/// Bits of the per-(stage, micro-batch) state: which actions exist / have run.
pub(crate) mod bit {
    use crate::action::ActionKind;

    pub const F: u8 = 1;
    pub const I: u8 = 2;
    pub const W: u8 = 4;
    /// A full backward, plain or the backward half of an overlap.
    pub const B: u8 = 8;
    pub const SEND_F: u8 = 16;
    pub const RECV_F: u8 = 32;
    pub const SEND_B: u8 = 64;
    pub const RECV_B: u8 = 128;
    /// Either kind of input-gradient backward: what the previous stage waits for.
    pub const BWD: u8 = I | B;

    /// The bit of a plain (non-composite) action kind.
    pub fn of(kind: ActionKind) -> u8 {
        match kind {
            ActionKind::F => F,
            ActionKind::I => I,
            ActionKind::W => W,
            ActionKind::B | ActionKind::OverlapFB => B,
            ActionKind::SendF => SEND_F,
            ActionKind::RecvF => RECV_F,
            ActionKind::SendB => SEND_B,
            ActionKind::RecvB => RECV_B,
        }
    }
}

/// "rank 1, step 14": where a step-level error is.
fn at(rank: usize, step: usize) -> String {
    format!("rank {rank}, step {step}")
}

fn invalid(rank: usize, step: usize, rule: String) -> ScheduleError {
    ScheduleError::Invalid {
        at: at(rank, step),
        rule,
    }
}
