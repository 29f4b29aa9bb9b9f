//! Rule 3: execute every rank together under blocking point-to-point semantics.
//!
//! Each rank walks its list. Before an action runs, each of its dependencies is either
//! satisfied, an *order error* (a same-rank dependency that has not run yet, so it sits
//! later in the list), or a *wait* on another rank (a RECV's SEND; in a compute-only plan,
//! the cross-rank producer itself). A waiting rank parks on that one event and is woken
//! when it fires, so the whole run costs O(actions). When no rank can move and some are
//! unfinished, that is a deadlock, reported with what every unfinished rank waits for.

use super::checks::Structure;
use super::{bit, invalid};
use crate::action::{Action, ActionKind};
use crate::error::{Result, ScheduleError};
use crate::plan::Plan;

/// Event kinds a rank can wait for; an event id is `kind · keys + key`.
const EV_F: usize = 0;
const EV_BWD: usize = 1;
const EV_SEND_F: usize = 2;
const EV_SEND_B: usize = 3;
const EV_KINDS: usize = 4;

const NO_RANK: u32 = u32::MAX;

struct Exec<'a> {
    plan: &'a Plan,
    st: &'a Structure,
    /// Bits of the actions that have run, per (stage, micro-batch).
    done: Vec<u8>,
    /// `waiter[event]`: the rank parked on it. Every event has at most one consumer
    /// (F(s,mb) feeds only F(s+1,mb), a SEND only its RECV), hence one slot.
    waiter: Vec<u32>,
    /// Ranks that can move (a stack: the order does not change the outcome).
    ready: Vec<usize>,
}

/// Runs all ranks; `Ok` when every rank reaches the end of its list.
pub(crate) fn execute(plan: &Plan, st: &Structure) -> Result<()> {
    let keys = st.seen.len();
    let ranks = plan.num_ranks();
    let mut ex = Exec {
        plan,
        st,
        done: vec![0; keys],
        waiter: vec![NO_RANK; EV_KINDS * keys],
        ready: (0..ranks).rev().collect(),
    };
    let mut pc = vec![0usize; ranks];
    let mut parked_on = vec![usize::MAX; ranks];
    while let Some(r) = ex.ready.pop() {
        let list = &plan.ranks[r];
        while let Some(step) = list.get(pc[r]) {
            let Some(action) = step else {
                pc[r] += 1;
                continue;
            };
            match ex.check(r, pc[r], action)? {
                None => {
                    ex.run(action);
                    pc[r] += 1;
                }
                Some(event) => {
                    ex.waiter[event] = r as u32;
                    parked_on[r] = event;
                    break;
                }
            }
        }
    }
    let waiting: Vec<String> = (0..ranks)
        .filter(|&r| pc[r] < plan.ranks[r].len())
        .map(|r| format!("rank {r} waits for {}", ex.describe(parked_on[r])))
        .collect();
    if waiting.is_empty() {
        Ok(())
    } else {
        Err(ScheduleError::Deadlock(waiting.join(", ")))
    }
}

impl Exec<'_> {
    fn key(&self, stage: u32, mb: u32) -> usize {
        self.st.key(stage, mb)
    }

    fn event(&self, kind: usize, key: usize) -> usize {
        kind * self.st.seen.len() + key
    }

    /// "RECV_F 0/5": what a parked rank waits for, named by the *sending* stage's data.
    fn describe(&self, event: usize) -> String {
        let keys = self.st.seen.len();
        let (kind, key) = (event / keys, event % keys);
        let (s, mb) = (key / self.st.m, key % self.st.m);
        let what = if kind == EV_F || kind == EV_SEND_F {
            "RECV_F"
        } else {
            "RECV_B"
        };
        format!("{what} {s}/{mb}")
    }

    /// The backward (I or B) that exists for (stage, mb), for messages.
    fn backward_of(&self, stage: u32, mb: u32) -> Action {
        if self.st.seen[self.key(stage, mb)] & bit::I != 0 {
            Action::i(stage, mb)
        } else {
            Action::b(stage, mb)
        }
    }

    /// `None` when `action` can run now, `Some(event)` when the rank must wait for one;
    /// an error when a same-rank dependency has not run (it comes later in the list).
    fn check(&self, rank: usize, step: usize, action: &Action) -> Result<Option<usize>> {
        let order = |dep: Action| invalid(rank, step, format!("{action} before {dep} has run"));
        let plan = self.plan;
        let lowered = self.st.lowered;
        // An overlap's forward half counts as run for its own backward half.
        let mut own_forward = None;
        for part in action.parts() {
            let (s, mb) = (part.stage, part.microbatch);
            let k = self.key(s, mb);
            let done = self.done[k];
            match part.kind {
                ActionKind::F => {
                    if s > 0 {
                        let pk = self.key(s - 1, mb);
                        let local = plan.rank_of(s - 1) == rank;
                        if local && self.done[pk] & bit::F == 0 {
                            return Err(order(Action::f(s - 1, mb)));
                        }
                        if !local && lowered && done & bit::RECV_F == 0 {
                            return Err(order(Action::new(ActionKind::RecvF, s, mb)));
                        }
                        if !local && !lowered && self.done[pk] & bit::F == 0 {
                            return Ok(Some(self.event(EV_F, pk)));
                        }
                    }
                    own_forward = Some(k);
                }
                ActionKind::I | ActionKind::B | ActionKind::OverlapFB => {
                    if done & bit::F == 0 && own_forward != Some(k) {
                        return Err(order(Action::f(s, mb)));
                    }
                    if (s as usize) + 1 < plan.stages {
                        let nk = self.key(s + 1, mb);
                        let local = plan.rank_of(s + 1) == rank;
                        if local && self.done[nk] & bit::BWD == 0 {
                            return Err(order(self.backward_of(s + 1, mb)));
                        }
                        if !local && lowered && done & bit::RECV_B == 0 {
                            return Err(order(Action::new(ActionKind::RecvB, s, mb)));
                        }
                        if !local && !lowered && self.done[nk] & bit::BWD == 0 {
                            return Ok(Some(self.event(EV_BWD, nk)));
                        }
                    }
                }
                ActionKind::W => {
                    if done & bit::I == 0 {
                        return Err(order(Action::i(s, mb)));
                    }
                }
                ActionKind::SendF => {
                    if done & bit::F == 0 {
                        return Err(order(Action::f(s, mb)));
                    }
                }
                ActionKind::SendB => {
                    if done & bit::BWD == 0 {
                        return Err(order(self.backward_of(s, mb)));
                    }
                }
                ActionKind::RecvF => {
                    let pk = self.key(s - 1, mb);
                    if self.done[pk] & bit::SEND_F == 0 {
                        return Ok(Some(self.event(EV_SEND_F, pk)));
                    }
                }
                ActionKind::RecvB => {
                    let nk = self.key(s + 1, mb);
                    if self.done[nk] & bit::SEND_B == 0 {
                        return Ok(Some(self.event(EV_SEND_B, nk)));
                    }
                }
            }
        }
        Ok(None)
    }

    /// Marks `action` as run and wakes the rank waiting for what it produces, if any.
    fn run(&mut self, action: &Action) {
        for part in action.parts() {
            let k = self.key(part.stage, part.microbatch);
            let b = bit::of(part.kind);
            self.done[k] |= b;
            let kind = match b {
                bit::F => EV_F,
                bit::I | bit::B => EV_BWD,
                bit::SEND_F => EV_SEND_F,
                bit::SEND_B => EV_SEND_B,
                _ => continue,
            };
            let ev = self.event(kind, k);
            let w = std::mem::replace(&mut self.waiter[ev], NO_RANK);
            if w != NO_RANK {
                self.ready.push(w as usize);
            }
        }
    }
}
