//! The action IR: one unit of work of one rank, and its text form.
//!
//! The text form is PyTorch pipelining's grammar, so schedules move between the two
//! ecosystems unchanged: `{stage}{kind}{microbatch}` (`0F3`, `2I0`, `2W0`, `1B5`,
//! `3SEND_F1`, `1RECV_B4`) and the composite `(0F7;7B3)OVERLAP_F_B`, a forward and a
//! full backward run as one overlapped pair.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What an action does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ActionKind {
    /// Forward of one micro-batch through one stage.
    F,
    /// Input-gradient backward (the zero-bubble paper's "B"): what the previous stage waits for.
    I,
    /// Weight-gradient backward: nobody waits for it until the optimizer step.
    W,
    /// Full backward: I and W fused.
    B,
    /// A forward and a full backward run as one overlapped pair (DualPipe-style). The action's
    /// own `stage`/`microbatch` are the forward's; [`Action::pair`] holds the backward's.
    OverlapFB,
    /// Send the forward output of (stage, micro-batch) to the rank holding stage + 1.
    SendF,
    /// Receive the forward input of (stage, micro-batch) from the rank holding stage − 1.
    RecvF,
    /// Send the input gradient of (stage, micro-batch) to the rank holding stage − 1.
    SendB,
    /// Receive the output gradient of (stage, micro-batch) from the rank holding stage + 1.
    RecvB,
}

impl ActionKind {
    /// The kind's token in the text form.
    pub fn as_str(self) -> &'static str {
        match self {
            ActionKind::F => "F",
            ActionKind::I => "I",
            ActionKind::W => "W",
            ActionKind::B => "B",
            ActionKind::OverlapFB => "OVERLAP_F_B",
            ActionKind::SendF => "SEND_F",
            ActionKind::RecvF => "RECV_F",
            ActionKind::SendB => "SEND_B",
            ActionKind::RecvB => "RECV_B",
        }
    }

    /// True for the kinds that run model compute (everything but SEND/RECV).
    pub fn is_compute(self) -> bool {
        !self.is_comm()
    }

    /// True for SEND_F, RECV_F, SEND_B, RECV_B.
    pub fn is_comm(self) -> bool {
        matches!(
            self,
            ActionKind::SendF | ActionKind::RecvF | ActionKind::SendB | ActionKind::RecvB
        )
    }

    /// True for the kinds that carry a backward (I, B, or the backward half of an overlap).
    pub fn is_backward(self) -> bool {
        matches!(self, ActionKind::I | ActionKind::B)
    }
}

impl fmt::Display for ActionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A (stage, micro-batch) pair: the unit every dependency is stated in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StageMb {
    pub stage: u32,
    pub microbatch: u32,
}

/// One unit of work of one rank.
///
/// `stage` is a model chunk (a "virtual stage"); a rank may hold several.
/// For [`ActionKind::OverlapFB`], `stage`/`microbatch` name the forward and `pair` the
/// full backward that runs overlapped with it; for every other kind `pair` is `None`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Action {
    pub kind: ActionKind,
    pub stage: u32,
    pub microbatch: u32,
    pub pair: Option<StageMb>,
}

impl Action {
    /// A plain (non-overlapped) action.
    pub const fn new(kind: ActionKind, stage: u32, microbatch: u32) -> Self {
        Action {
            kind,
            stage,
            microbatch,
            pair: None,
        }
    }

    pub const fn f(stage: u32, microbatch: u32) -> Self {
        Self::new(ActionKind::F, stage, microbatch)
    }
    pub const fn i(stage: u32, microbatch: u32) -> Self {
        Self::new(ActionKind::I, stage, microbatch)
    }
    pub const fn w(stage: u32, microbatch: u32) -> Self {
        Self::new(ActionKind::W, stage, microbatch)
    }
    pub const fn b(stage: u32, microbatch: u32) -> Self {
        Self::new(ActionKind::B, stage, microbatch)
    }

    /// `(F of forward; B of backward)OVERLAP_F_B`.
    pub const fn overlap(forward: StageMb, backward: StageMb) -> Self {
        Action {
            kind: ActionKind::OverlapFB,
            stage: forward.stage,
            microbatch: forward.microbatch,
            pair: Some(backward),
        }
    }

    /// The (stage, micro-batch) this action is about (the forward's, for an overlap).
    pub const fn key(&self) -> StageMb {
        StageMb {
            stage: self.stage,
            microbatch: self.microbatch,
        }
    }

    /// The plain compute actions this action stands for: itself, or for an overlap its
    /// forward and its backward. Dependency checks and simulation reason on these.
    pub fn parts(&self) -> impl Iterator<Item = Action> + '_ {
        let (first, second) = match (self.kind, self.pair) {
            (ActionKind::OverlapFB, Some(b)) => (
                Action::f(self.stage, self.microbatch),
                Some(Action::b(b.stage, b.microbatch)),
            ),
            _ => (*self, None),
        };
        std::iter::once(first).chain(second)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.kind, self.pair) {
            (ActionKind::OverlapFB, Some(b)) => write!(
                f,
                "({}F{};{}B{})OVERLAP_F_B",
                self.stage, self.microbatch, b.stage, b.microbatch
            ),
            _ => write!(f, "{}{}{}", self.stage, self.kind, self.microbatch),
        }
    }
}

/// Why a piece of text is not an action.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{}` is not an action: {reason}", crate::error::cut(.text))]
pub struct ParseActionError {
    pub text: String,
    pub reason: &'static str,
}

impl FromStr for Action {
    type Err = ParseActionError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseActionError {
            text: s.to_string(),
            reason,
        };
        let t = s.trim();
        if t.is_empty() {
            return Err(err(
                "empty (an idle step is an empty CSV cell, not an action)",
            ));
        }
        if let Some(rest) = t.strip_prefix('(') {
            let inner = rest
                .strip_suffix(")OVERLAP_F_B")
                .ok_or_else(|| err("a composite must read `(xFy;xBy)OVERLAP_F_B`"))?;
            let (a, b) = inner
                .split_once(';')
                .ok_or_else(|| err("a composite holds two actions separated by `;`"))?;
            let fwd = parse_simple(a).map_err(err)?;
            let bwd = parse_simple(b).map_err(err)?;
            if fwd.kind != ActionKind::F || bwd.kind != ActionKind::B {
                return Err(err(
                    "OVERLAP_F_B pairs a forward (F) with a full backward (B)",
                ));
            }
            return Ok(Action::overlap(fwd.key(), bwd.key()));
        }
        parse_simple(t).map_err(err)
    }
}

fn parse_simple(s: &str) -> Result<Action, &'static str> {
    let s = s.trim();
    let digits_end = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or("missing the kind (F, I, W, B, SEND_F, RECV_F, SEND_B, RECV_B)")?;
    if digits_end == 0 {
        return Err("must start with the stage number");
    }
    let stage: u32 = s[..digits_end]
        .parse()
        .map_err(|_| "stage number out of range")?;
    let rest = &s[digits_end..];
    let kind_end = rest
        .find(|c: char| c.is_ascii_digit())
        .ok_or("must end with the micro-batch number")?;
    let kind = match &rest[..kind_end] {
        "F" => ActionKind::F,
        "I" => ActionKind::I,
        "W" => ActionKind::W,
        "B" => ActionKind::B,
        "SEND_F" => ActionKind::SendF,
        "RECV_F" => ActionKind::RecvF,
        "SEND_B" => ActionKind::SendB,
        "RECV_B" => ActionKind::RecvB,
        _ => return Err("unknown kind (expected F, I, W, B, SEND_F, RECV_F, SEND_B, RECV_B)"),
    };
    let mb = &rest[kind_end..];
    if !mb.bytes().all(|b| b.is_ascii_digit()) {
        return Err("micro-batch must be a number");
    }
    let microbatch: u32 = mb.parse().map_err(|_| "micro-batch number out of range")?;
    Ok(Action::new(kind, stage, microbatch))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_kind() {
        for text in [
            "0F3",
            "2I0",
            "2W0",
            "1B5",
            "3SEND_F1",
            "3RECV_F1",
            "12SEND_B40",
            "0RECV_B7",
            "(0F7;7B3)OVERLAP_F_B",
        ] {
            let a: Action = text.parse().unwrap();
            assert_eq!(a.to_string(), text);
        }
    }

    #[test]
    fn overlap_parts_are_forward_then_backward() {
        let a: Action = "(0F7;7B3)OVERLAP_F_B".parse().unwrap();
        let parts: Vec<_> = a.parts().collect();
        assert_eq!(parts, vec![Action::f(0, 7), Action::b(7, 3)]);
    }

    #[test]
    fn rejects_malformed_text() {
        for text in [
            "",
            "F3",
            "0X3",
            "0F",
            "0F3x",
            "(0F1;0F2)OVERLAP_F_B",
            "(0F1,0B2)",
            "0SEND3",
        ] {
            assert!(text.parse::<Action>().is_err(), "{text:?} parsed");
        }
    }
}
