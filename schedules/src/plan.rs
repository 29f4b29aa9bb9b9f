//! A plan: one ordered action list per rank, plus where each stage lives.

use serde::{Deserialize, Serialize};

use crate::action::Action;

/// How stages (model chunks) are placed on ranks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Rank `r` holds stages `r·v .. (r+1)·v` (one stage per rank when `v = 1`).
    Contiguous,
    /// Stage `s` lives on rank `s % p` (interleaved 1F1B, looped BFS, ZB1P).
    Looped,
    /// `v = 2`; rank `r` holds stages `r` and `2p − 1 − r` (ZB-V, DualPipeV).
    VShape,
    /// An explicit stage → rank table.
    Custom(Vec<usize>),
}

impl Placement {
    /// The stage → rank table for `ranks` ranks holding `stages` stages.
    ///
    /// Callers validate the shape first ([`Placement::check`]); this assumes it is valid.
    pub fn stage_ranks(&self, ranks: usize, stages: usize) -> Vec<usize> {
        match self {
            Placement::Contiguous => {
                let v = stages / ranks.max(1);
                (0..stages).map(|s| s / v.max(1)).collect()
            }
            Placement::Looped => (0..stages).map(|s| s % ranks).collect(),
            Placement::VShape => (0..stages)
                .map(|s| if s < ranks { s } else { 2 * ranks - 1 - s })
                .collect(),
            Placement::Custom(table) => table.clone(),
        }
    }

    /// Whether `ranks` ranks can hold `stages` stages this way; the reason if not.
    pub fn check(&self, ranks: usize, stages: usize) -> Result<(), String> {
        if ranks == 0 {
            return Err("a plan needs at least one rank".into());
        }
        if stages < ranks {
            return Err(format!("{stages} stages cannot cover {ranks} ranks"));
        }
        match self {
            Placement::Contiguous | Placement::Looped if !stages.is_multiple_of(ranks) => Err(
                format!("{stages} stages do not divide evenly over {ranks} ranks"),
            ),
            Placement::VShape if stages != 2 * ranks => Err(format!(
                "V-shaped placement needs exactly 2 stages per rank (2×{ranks}), not {stages}"
            )),
            Placement::Custom(table) => {
                if table.len() != stages {
                    return Err(format!(
                        "placement lists {} stages but the plan has {stages}",
                        table.len()
                    ));
                }
                if let Some((s, r)) = table.iter().enumerate().find(|(_, r)| **r >= ranks) {
                    return Err(format!(
                        "stage {s} is placed on rank {r}, but there are {ranks} ranks"
                    ));
                }
                if let Some(r) = (0..ranks).find(|r| !table.contains(r)) {
                    return Err(format!("rank {r} holds no stage"));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Short name used in files and reports.
    pub fn name(&self) -> &'static str {
        match self {
            Placement::Contiguous => "contiguous",
            Placement::Looped => "looped",
            Placement::VShape => "v-shape",
            Placement::Custom(_) => "custom",
        }
    }
}

/// One ordered action list per rank (`None` is an idle step, as an empty CSV cell),
/// plus the stage → rank placement.
///
/// A plan is *compute-only* when it holds no SEND/RECV; [`crate::lower`](fn@crate::lower) inserts
/// them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Number of stages (model chunks) in the whole pipeline.
    pub stages: usize,
    /// Number of micro-batches per iteration.
    pub microbatches: usize,
    pub placement: Placement,
    /// `stage_rank[s]` is the rank that holds stage `s`.
    pub stage_rank: Vec<usize>,
    /// `ranks[r]` is rank `r`'s ordered action list.
    pub ranks: Vec<Vec<Option<Action>>>,
}

impl Plan {
    /// An empty plan of `ranks` ranks; the placement is assumed valid (see [`Placement::check`]).
    pub fn new(ranks: usize, stages: usize, microbatches: usize, placement: Placement) -> Self {
        let stage_rank = placement.stage_ranks(ranks, stages);
        Plan {
            stages,
            microbatches,
            placement,
            stage_rank,
            ranks: vec![Vec::new(); ranks],
        }
    }

    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Stages per rank (`v`), assuming every rank holds the same number.
    pub fn stages_per_rank(&self) -> usize {
        self.stages / self.num_ranks().max(1)
    }

    /// The rank that holds `stage`.
    pub fn rank_of(&self, stage: u32) -> usize {
        self.stage_rank[stage as usize]
    }

    /// The stages rank `r` holds, in ascending order.
    pub fn stages_of(&self, rank: usize) -> Vec<u32> {
        (0..self.stages as u32)
            .filter(|&s| self.stage_rank[s as usize] == rank)
            .collect()
    }

    /// Appends `action` to rank `rank`'s list.
    pub fn push(&mut self, rank: usize, action: Action) {
        self.ranks[rank].push(Some(action));
    }

    /// Every action of every rank, with its rank and position.
    pub fn iter(&self) -> impl Iterator<Item = (usize, usize, &Action)> {
        self.ranks.iter().enumerate().flat_map(|(r, list)| {
            list.iter()
                .enumerate()
                .filter_map(move |(i, a)| a.as_ref().map(|a| (r, i, a)))
        })
    }

    /// Total number of actions (idle steps excluded).
    pub fn num_actions(&self) -> usize {
        self.ranks.iter().map(|l| l.iter().flatten().count()).sum()
    }

    /// True when the plan holds no SEND/RECV actions.
    pub fn is_compute_only(&self) -> bool {
        self.iter().all(|(_, _, a)| a.kind.is_compute())
    }

    /// Whether the plan splits its backwards into I and W (true if any I or W occurs).
    pub fn splits_backward(&self) -> bool {
        use crate::action::ActionKind::{I, W};
        self.iter().any(|(_, _, a)| matches!(a.kind, I | W))
    }

    /// The same plan with every SEND/RECV (and idle step) removed.
    pub fn compute_only(&self) -> Plan {
        let mut p = self.clone();
        for list in &mut p.ranks {
            list.retain(|a| matches!(a, Some(a) if a.kind.is_compute()));
        }
        p
    }
}
