//! The built-in schedule generators: each turns (ranks `p`, micro-batches `m`, chunks `v`)
//! into a compute-only [`Plan`].
//!
//! One file per family: [`gpipe`], [`one_f_one_b`], [`interleaved`], [`looped_bfs`],
//! [`zero_bubble`] (ZB-H1, ZB-H2), [`zb_v`] and [`dualpipe_v`]. Each builds its published
//! order directly (closed-form per-rank lists, no search), so generation is linear in the
//! number of actions. Every generator states its constraints on `p`, `m` and `v` and answers
//! [`ScheduleError::Unsupported`] outside them.

pub mod dualpipe_v;
pub mod gpipe;
pub mod interleaved;
pub mod looped_bfs;
pub mod one_f_one_b;
pub mod zb_v;
pub mod zero_bubble;

use std::fmt;
use std::str::FromStr;

use crate::error::{Result, ScheduleError};
use crate::plan::Plan;

/// The built-in schedule families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (one stage per rank).
    GPipe,
    /// One forward, one backward (PipeDream-flush / Megatron's default).
    OneFOneB,
    /// Megatron's interleaved 1F1B: `v` looped stages per rank.
    Interleaved1F1B,
    /// Breadth-first over looped stages: every micro-batch through a rank's chunk 0 first.
    LoopedBfs,
    /// Zero-bubble H1: 1F1B's memory, W deferred into the cool-down.
    ZbH1,
    /// Zero-bubble H2: more warm-up forwards, zero steady bubble when T_F + T_I ≤ 2 T_W.
    ZbH2,
    /// Zero-bubble V: two V-placed stages per rank, 1F1B's memory, zero steady bubble.
    ZbV,
    /// DeepSeek's DualPipeV: two V-placed stages per rank, overlapped F+B pairs.
    DualPipeV,
}

impl ScheduleKind {
    /// Every built-in kind, in the order reports list them.
    pub const ALL: [ScheduleKind; 8] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::LoopedBfs,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
        ScheduleKind::ZbV,
        ScheduleKind::DualPipeV,
    ];

    /// The kind's name on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved1F1B => "interleaved-1f1b",
            ScheduleKind::LoopedBfs => "looped-bfs",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::ZbH2 => "zb-h2",
            ScheduleKind::ZbV => "zb-v",
            ScheduleKind::DualPipeV => "dualpipe-v",
        }
    }

    /// Compute actions per (stage, micro-batch): F, I and W for the zero-bubble family
    /// (which splits the backward), F and B otherwise. For dualpipe-v, whose overlapped F+B
    /// pairs count as one action, 2 is a bound ([`compute_actions`](Self::compute_actions)
    /// has its exact count).
    pub fn actions_per_cell(self) -> u64 {
        match self {
            ScheduleKind::ZbH1 | ScheduleKind::ZbH2 | ScheduleKind::ZbV => 3,
            _ => 2,
        }
    }

    /// The compute actions of the plan [`generate`] builds for `ranks × chunks` stages and
    /// `microbatches` micro-batches, counted with checked arithmetic (`None` when the count
    /// overflows `u64`): what a caller bounds before asking for a plan that large.
    pub fn compute_actions(self, ranks: usize, microbatches: usize, chunks: usize) -> Option<u64> {
        if self == ScheduleKind::DualPipeV {
            return dualpipe_v::compute_actions(ranks, microbatches);
        }
        (ranks as u64)
            .checked_mul(chunks as u64)?
            .checked_mul(microbatches as u64)?
            .checked_mul(self.actions_per_cell())
    }

    /// Stages per rank used when the caller does not choose: 2 for the multi-chunk
    /// families (interleaved-1f1b, looped-bfs, zb-v, dualpipe-v), 1 otherwise.
    pub fn default_chunks(self) -> usize {
        match self {
            ScheduleKind::Interleaved1F1B
            | ScheduleKind::LoopedBfs
            | ScheduleKind::ZbV
            | ScheduleKind::DualPipeV => 2,
            _ => 1,
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.name() == t)
            .ok_or_else(|| ScheduleError::UnknownSchedule(s.to_string()))
    }
}

/// Builds the compute-only plan of `kind` for `ranks` ranks, `microbatches` micro-batches
/// and `chunks` stages per rank.
pub fn generate(
    kind: ScheduleKind,
    ranks: usize,
    microbatches: usize,
    chunks: usize,
) -> Result<Plan> {
    match kind {
        ScheduleKind::GPipe => gpipe::generate(ranks, microbatches, chunks),
        ScheduleKind::OneFOneB => one_f_one_b::generate(ranks, microbatches, chunks),
        ScheduleKind::Interleaved1F1B => interleaved::generate(ranks, microbatches, chunks),
        ScheduleKind::LoopedBfs => looped_bfs::generate(ranks, microbatches, chunks),
        ScheduleKind::ZbH1 => zero_bubble::generate_h1(ranks, microbatches, chunks),
        ScheduleKind::ZbH2 => zero_bubble::generate_h2(ranks, microbatches, chunks),
        ScheduleKind::ZbV => zb_v::generate(ranks, microbatches, chunks),
        ScheduleKind::DualPipeV => dualpipe_v::generate(ranks, microbatches, chunks),
    }
}

/// [`generate`], then [`crate::lower`](fn@crate::lower): the plan with SEND/RECV for every
/// cross-rank edge.
pub fn build(kind: ScheduleKind, ranks: usize, microbatches: usize, chunks: usize) -> Result<Plan> {
    crate::lower::lower(&generate(kind, ranks, microbatches, chunks)?)
}

/// Checks the parameters every generator shares: at least one rank and one micro-batch,
/// stage and micro-batch numbers that fit the IR's `u32`, and (when `fixed_chunks` is
/// given) the one number of chunks the family supports.
fn check_common(
    kind: ScheduleKind,
    ranks: usize,
    microbatches: usize,
    chunks: usize,
    fixed_chunks: Option<usize>,
) -> Result<()> {
    let unsupported = |reason: String| ScheduleError::Unsupported {
        schedule: kind.name().to_string(),
        reason,
    };
    if ranks == 0 {
        return Err(unsupported("needs at least one rank (p = 0)".into()));
    }
    if microbatches == 0 {
        return Err(unsupported("needs at least one micro-batch (m = 0)".into()));
    }
    if chunks == 0 {
        return Err(unsupported(
            "needs at least one stage per rank (v = 0)".into(),
        ));
    }
    if let Some(v) = fixed_chunks
        && chunks != v
    {
        return Err(unsupported(format!(
            "places exactly {v} stage(s) per rank, not v = {chunks}"
        )));
    }
    let too_big = |n: usize| u32::try_from(n).is_err();
    if too_big(ranks.saturating_mul(chunks)) || too_big(microbatches) {
        return Err(unsupported(format!(
            "p × v = {ranks} × {chunks} stages or m = {microbatches} micro-batches exceed {}",
            u32::MAX
        )));
    }
    Ok(())
}

/// Rank `rank`'s actions in text form, idle steps left out: what the generator tests compare.
#[cfg(test)]
pub(crate) fn rank_text(plan: &Plan, rank: usize) -> Vec<String> {
    plan.ranks[rank]
        .iter()
        .flatten()
        .map(|a| a.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for kind in ScheduleKind::ALL {
            assert_eq!(kind.name().parse::<ScheduleKind>().unwrap(), kind);
            assert_eq!(kind.to_string(), kind.name());
        }
        assert_eq!(" ZB-V ".parse::<ScheduleKind>().unwrap(), ScheduleKind::ZbV);
        assert_eq!(
            "DualPipe-V".parse::<ScheduleKind>().unwrap(),
            ScheduleKind::DualPipeV
        );
        assert!(matches!(
            "2f2b".parse::<ScheduleKind>(),
            Err(ScheduleError::UnknownSchedule(name)) if name == "2f2b"
        ));
    }

    #[test]
    fn default_chunks_match_the_families() {
        let multi: Vec<_> = ScheduleKind::ALL
            .into_iter()
            .filter(|k| k.default_chunks() == 2)
            .collect();
        assert_eq!(
            multi,
            [
                ScheduleKind::Interleaved1F1B,
                ScheduleKind::LoopedBfs,
                ScheduleKind::ZbV,
                ScheduleKind::DualPipeV
            ]
        );
    }

    #[test]
    fn compute_actions_counts_what_each_generator_builds() {
        for kind in ScheduleKind::ALL {
            let v = kind.default_chunks();
            for (p, m) in [(1, 1), (2, 4), (4, 8), (3, 6)] {
                let Ok(plan) = generate(kind, p, m, v) else {
                    continue;
                };
                assert_eq!(
                    kind.compute_actions(p, m, v),
                    Some(plan.num_actions() as u64),
                    "{kind} p={p} m={m}"
                );
            }
        }
        let huge = ScheduleKind::ZbH1.compute_actions(100_000, 100_000, 1);
        assert_eq!(huge, Some(30_000_000_000));
        assert_eq!(
            ScheduleKind::ZbV.compute_actions(usize::MAX, usize::MAX, 2),
            None
        );
    }

    #[test]
    fn zero_ranks_or_microbatches_are_unsupported_for_every_kind() {
        for kind in ScheduleKind::ALL {
            let v = kind.default_chunks();
            for (p, m) in [(0, 4), (4, 0)] {
                let err = generate(kind, p, m, v).unwrap_err();
                assert!(
                    matches!(&err, ScheduleError::Unsupported { schedule, .. } if schedule == kind.name()),
                    "{kind} p={p} m={m}: {err}"
                );
            }
            assert!(generate(kind, 4, 8, 0).is_err(), "{kind} accepted v = 0");
        }
    }
}
