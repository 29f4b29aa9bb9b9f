//! Timelines and the one set of metric definitions (DESIGN.md, "Metrics").
//!
//! The simulator produces a [`Timeline`] from a plan and a [`CostModel`] ("predicted"); the
//! runtime's profiler builds the same type from measured spans ("measured"), so both are
//! computed by [`Timeline::from_spans`] and can be printed side by side.

use serde::{Deserialize, Serialize};

use crate::action::{Action, ActionKind};

/// Costs of one stage's actions, in arbitrary time units.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageCost {
    /// Forward.
    pub f: f64,
    /// Input-gradient backward.
    pub i: f64,
    /// Weight-gradient backward.
    pub w: f64,
}

impl StageCost {
    /// A full backward (B) costs I + W.
    pub fn b(&self) -> f64 {
        self.i + self.w
    }

    /// Per-stage **mean** T_F, T_I, T_W over the compute spans of `timelines` (measured
    /// iterations); `None` when some stage of the `stages` has no forward among them. A
    /// plan of fused backwards measures B only: T_I = T_B, T_W = 0, as the runtime's own
    /// cost model does.
    ///
    /// Why means next to the runtime's medians: a timeline's busy time is a *sum* of action
    /// costs, which means reproduce exactly; action costs are skewed to the right, so a
    /// prediction under medians under-estimates busy time, and the bubble ratio
    /// (`1 − busy / (ranks × makespan)`) amplifies that error by `(1 − ratio) / ratio`.
    pub fn means<'a>(
        stages: usize,
        timelines: impl IntoIterator<Item = &'a Timeline>,
    ) -> Option<Vec<StageCost>> {
        let kinds = [ActionKind::F, ActionKind::I, ActionKind::W, ActionKind::B];
        let mut sums = vec![[(0.0f64, 0usize); 4]; stages];
        for s in timelines.into_iter().flat_map(|t| &t.spans) {
            let Some(k) = kinds.iter().position(|&k| k == s.action.kind) else {
                continue;
            };
            if let Some(e) = sums.get_mut(s.action.stage as usize) {
                e[k].0 += s.duration();
                e[k].1 += 1;
            }
        }
        let mean = |e: (f64, usize)| (e.1 > 0).then(|| e.0 / e.1 as f64);
        sums.iter()
            .map(|e| {
                let f = mean(e[0])?;
                let (i, w) = match (mean(e[1]), mean(e[3])) {
                    (Some(i), _) => (i, mean(e[2]).unwrap_or(0.0)),
                    (None, b) => (b.unwrap_or(0.0), 0.0),
                };
                Some(StageCost { f, i, w })
            })
            .collect()
    }
}

/// What each action costs in time and activation memory.
///
/// Time: per-stage T_F, T_I, T_W (B = I + W, an overlapped F+B = F + B), a latency per
/// point-to-point link between ranks (none between stages on the same rank), and an optional
/// per-rank speed factor (a rank with speed 2 runs every action in half the time).
///
/// Memory, in units: a forward holds `m_b` until its I (or B); the I releases `m_b − m_w`
/// and the W releases the last `m_w`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// One entry per stage, or a single entry that applies to every stage.
    pub stage: Vec<StageCost>,
    /// Latency of one send over a link between two ranks.
    pub comm: f64,
    /// Per-rank speed factor; empty means every rank has speed 1.
    pub rank_speed: Vec<f64>,
    /// Activation memory one forward holds until its input-gradient backward.
    pub m_b: f64,
    /// Of that, what stays held after I until W.
    pub m_w: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel::uniform(1.0, 1.0, 1.0, 0.0)
    }
}

impl CostModel {
    /// The same T_F, T_I, T_W for every stage and `comm` per link; M_B = 1, M_W = 0.5.
    pub fn uniform(f: f64, i: f64, w: f64, comm: f64) -> Self {
        CostModel {
            stage: vec![StageCost { f, i, w }],
            comm,
            rank_speed: Vec::new(),
            m_b: 1.0,
            m_w: 0.5,
        }
    }

    /// The costs of `stage`.
    pub fn of(&self, stage: u32) -> StageCost {
        match self.stage.len() {
            0 => StageCost {
                f: 1.0,
                i: 1.0,
                w: 1.0,
            },
            1 => self.stage[0],
            _ => self.stage[stage as usize],
        }
    }

    /// Speed factor of `rank` (1 unless set).
    pub fn speed(&self, rank: usize) -> f64 {
        self.rank_speed.get(rank).copied().unwrap_or(1.0)
    }

    /// Time `action` takes on `rank`; SEND/RECV take no compute time (their latency is
    /// the link's, see [`CostModel::comm`]).
    pub fn duration(&self, rank: usize, action: &Action) -> f64 {
        let base: f64 = action
            .parts()
            .map(|a| {
                let c = self.of(a.stage);
                match a.kind {
                    ActionKind::F => c.f,
                    ActionKind::I => c.i,
                    ActionKind::W => c.w,
                    ActionKind::B => c.b(),
                    _ => 0.0,
                }
            })
            .sum();
        base / self.speed(rank)
    }
}

/// One action executed on one rank over `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Span {
    pub rank: usize,
    pub start: f64,
    pub end: f64,
    pub action: Action,
}

impl Span {
    pub fn duration(&self) -> f64 {
        self.end - self.start
    }
}

/// One maximal idle interval of one rank inside the makespan.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct BubbleSlot {
    pub rank: usize,
    pub start: f64,
    pub length: f64,
    /// The compute action that ends just before the slot (`None` at the rank's start).
    pub before: Option<Action>,
    /// The compute action that starts just after the slot (`None` at the rank's end).
    pub after: Option<Action>,
}

/// Per-rank figures of a timeline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankStats {
    pub rank: usize,
    /// Sum of the rank's compute actions' durations.
    pub busy: f64,
    /// makespan − busy.
    pub idle: f64,
    /// From the rank's first action's start to its last action's end.
    pub span: f64,
    /// idle / makespan.
    pub bubble_ratio: f64,
    /// Peak activation memory, in the cost model's units (0 when not tracked).
    pub peak_memory: f64,
}

/// What ran where and when, and the metrics derived from it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// Compute spans, sorted by rank then start.
    pub spans: Vec<Span>,
    /// From the first start on any rank to the last end on any rank.
    pub makespan: f64,
    /// Σ (makespan − busy) / (ranks × makespan).
    pub bubble_ratio: f64,
    /// 1 − Σ busy / (ranks × max span).
    pub steady_bubble_ratio: f64,
    pub ranks: Vec<RankStats>,
    /// Every idle interval of every rank inside the makespan, sorted by rank then start.
    pub slots: Vec<BubbleSlot>,
}

/// Idle gaps shorter than this (relative to the makespan) are rounding, not bubbles.
const GAP_EPS: f64 = 1e-9;

impl Timeline {
    /// Builds a timeline from compute spans of `ranks` ranks. SEND/RECV spans are ignored
    /// (they are not compute); `peak_memory[r]` is copied into the rank's stats when given.
    pub fn from_spans(ranks: usize, mut spans: Vec<Span>, peak_memory: &[f64]) -> Timeline {
        spans.retain(|s| s.action.kind.is_compute());
        spans.sort_by(|a, b| a.rank.cmp(&b.rank).then(a.start.total_cmp(&b.start)));
        let t0 = spans.iter().map(|s| s.start).fold(f64::INFINITY, f64::min);
        let t1 = spans
            .iter()
            .map(|s| s.end)
            .fold(f64::NEG_INFINITY, f64::max);
        let (t0, t1) = if spans.is_empty() {
            (0.0, 0.0)
        } else {
            (t0, t1)
        };
        let makespan = t1 - t0;
        let eps = GAP_EPS * makespan.max(1.0);

        let mut stats = Vec::with_capacity(ranks);
        let mut slots = Vec::new();
        let mut lo = 0;
        for rank in 0..ranks {
            let hi = lo + spans[lo..].iter().take_while(|s| s.rank == rank).count();
            let own = &spans[lo..hi];
            lo = hi;
            let busy: f64 = own.iter().map(Span::duration).sum();
            let span = match (own.first(), own.iter().map(|s| s.end).reduce(f64::max)) {
                (Some(first), Some(end)) => end - first.start,
                _ => 0.0,
            };
            // Idle intervals: before the first action, between actions, after the last.
            let mut cursor = t0;
            let mut prev: Option<Action> = None;
            for s in own {
                if s.start - cursor > eps {
                    slots.push(BubbleSlot {
                        rank,
                        start: cursor,
                        length: s.start - cursor,
                        before: prev,
                        after: Some(s.action),
                    });
                }
                cursor = cursor.max(s.end);
                prev = Some(s.action);
            }
            if t1 - cursor > eps {
                slots.push(BubbleSlot {
                    rank,
                    start: cursor,
                    length: t1 - cursor,
                    before: prev,
                    after: None,
                });
            }
            let idle = makespan - busy;
            stats.push(RankStats {
                rank,
                busy,
                idle,
                span,
                bubble_ratio: if makespan > 0.0 { idle / makespan } else { 0.0 },
                peak_memory: peak_memory.get(rank).copied().unwrap_or(0.0),
            });
        }

        let total_busy: f64 = stats.iter().map(|s| s.busy).sum();
        let max_span = stats.iter().map(|s| s.span).fold(0.0, f64::max);
        let n = ranks as f64;
        Timeline {
            spans,
            makespan,
            bubble_ratio: if makespan > 0.0 {
                (n * makespan - total_busy) / (n * makespan)
            } else {
                0.0
            },
            steady_bubble_ratio: if max_span > 0.0 {
                1.0 - total_busy / (n * max_span)
            } else {
                0.0
            },
            ranks: stats,
            slots,
        }
    }

    /// When the first span starts (0 for a timeline without spans): the origin of the
    /// makespan, which need not be 0 for a measured step.
    pub fn start(&self) -> f64 {
        let t0 = self
            .spans
            .iter()
            .map(|s| s.start)
            .fold(f64::INFINITY, f64::min);
        if t0.is_finite() { t0 } else { 0.0 }
    }

    /// The most activation memory any rank holds at once.
    pub fn peak_memory(&self) -> f64 {
        self.ranks.iter().map(|r| r.peak_memory).fold(0.0, f64::max)
    }

    /// The worst rank's idle time when iterations overlap: the longest span less that
    /// rank's busy time (what the closed forms of DESIGN.md's steady bubble state).
    pub fn worst_idle(&self) -> f64 {
        let max_span = self.ranks.iter().map(|r| r.span).fold(0.0, f64::max);
        self.ranks
            .iter()
            .map(|r| max_span - r.busy)
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// Total idle time over all ranks inside the makespan.
    pub fn bubble_time(&self) -> f64 {
        self.ranks.iter().map(|r| r.idle).sum()
    }

    /// The same timeline on another time axis: every time `t` becomes `(t - origin) ×
    /// scale` (a measured step in seconds drawn in milliseconds from its start, say). Peak
    /// memory is kept; the ratios do not change.
    pub fn rescaled(&self, origin: f64, scale: f64) -> Timeline {
        let spans = self
            .spans
            .iter()
            .map(|s| Span {
                start: (s.start - origin) * scale,
                end: (s.end - origin) * scale,
                ..*s
            })
            .collect();
        let peak: Vec<f64> = self.ranks.iter().map(|r| r.peak_memory).collect();
        Timeline::from_spans(self.ranks.len(), spans, &peak)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(rank: usize, start: f64, end: f64, action: Action) -> Span {
        Span {
            rank,
            start,
            end,
            action,
        }
    }

    /// Two ranks, one micro-batch: F and B of stage 0 then 1, one time unit each, from `t0`.
    fn two_stages(t0: f64) -> Vec<Span> {
        vec![
            span(0, t0, t0 + 1.0, Action::f(0, 0)),
            span(1, t0 + 1.0, t0 + 2.0, Action::f(1, 0)),
            span(0, t0 + 2.0, t0 + 3.0, Action::b(0, 0)),
            span(1, t0 + 3.0, t0 + 4.0, Action::b(1, 0)),
        ]
    }

    #[test]
    fn a_rescaled_timeline_moves_every_time_and_keeps_the_ratios_and_memory() {
        let t = Timeline::from_spans(2, two_stages(10.0), &[5.0, 7.0]);
        assert_eq!((t.start(), t.peak_memory()), (10.0, 7.0));
        let ms = t.rescaled(10.0, 1e3);
        assert_eq!((ms.start(), ms.peak_memory()), (0.0, 7.0));
        assert_eq!(ms.makespan, 4000.0);
        assert_eq!(ms.spans[0].start, 0.0);
        assert_eq!(ms.spans.last().unwrap().end, 4000.0);
        assert_eq!(ms.ranks[1].busy, 2000.0);
        assert_eq!(ms.bubble_ratio, t.bubble_ratio);
        assert_eq!(ms.steady_bubble_ratio, t.steady_bubble_ratio);
        assert_eq!(ms.ranks[1].peak_memory, 7.0);
        assert_eq!(ms.slots.len(), t.slots.len());
    }

    #[test]
    fn metrics_follow_the_design_definitions() {
        // rank 0: busy [0,1) and [2,3); rank 1: busy [1,2) and [3,4). makespan 4.
        let t = Timeline::from_spans(2, two_stages(0.0), &[]);
        assert_eq!(t.makespan, 4.0);
        assert_eq!(t.ranks[0].busy, 2.0);
        assert_eq!(t.ranks[0].span, 3.0);
        assert_eq!(t.bubble_ratio, 0.5);
        assert_eq!(t.steady_bubble_ratio, 1.0 - 4.0 / 6.0);
        // rank 0: [1,2) and [3,4); rank 1: [0,1) and [2,3).
        let lens: Vec<_> = t
            .slots
            .iter()
            .map(|s| (s.rank, s.start, s.length))
            .collect();
        assert_eq!(
            lens,
            vec![(0, 1.0, 1.0), (0, 3.0, 1.0), (1, 0.0, 1.0), (1, 2.0, 1.0)]
        );
        assert_eq!(t.slots[1].after, None);
        assert_eq!(t.slots[2].before, None);
        assert_eq!(t.bubble_time(), 4.0);
    }

    #[test]
    fn stage_means_average_every_span_and_read_fused_backwards_as_i() {
        let split = Timeline::from_spans(
            1,
            vec![
                span(0, 0.0, 1.0, Action::f(0, 0)),
                span(0, 1.0, 4.0, Action::f(0, 1)),
                span(0, 4.0, 6.0, Action::i(0, 0)),
                span(0, 6.0, 6.5, Action::w(0, 0)),
            ],
            &[],
        );
        let fused = Timeline::from_spans(1, vec![span(0, 0.0, 3.0, Action::b(0, 0))], &[]);
        let means = StageCost::means(1, [&split, &fused]).unwrap();
        // F: (1 + 3) / 2; a plan with I takes I's mean, not B's.
        assert_eq!(
            means,
            vec![StageCost {
                f: 2.0,
                i: 2.0,
                w: 0.5
            }]
        );
        let only_b = Timeline::from_spans(
            1,
            vec![
                span(0, 0.0, 1.0, Action::f(0, 0)),
                span(0, 1.0, 3.0, Action::b(0, 0)),
            ],
            &[],
        );
        assert_eq!(
            StageCost::means(1, [&only_b]).unwrap(),
            vec![StageCost {
                f: 1.0,
                i: 2.0,
                w: 0.0
            }]
        );
        // A stage with no forward has no means.
        assert_eq!(StageCost::means(2, [&only_b]), None);
    }
}
