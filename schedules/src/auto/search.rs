//! The search over greedy knobs and over the order of W's, each candidate scored by the
//! simulator.
//!
//! 1. **Families.** The greedy scheduler under a grid of knob settings: warm-up depth
//!    `⌈k (p − r)⌉` per rank (1F1B's `k = 1`, ZB-H2's `k = 2`, up to memory only), W's held
//!    back `⌈j r v⌉` (ZB-H1's `j = 1`, ZB-H2's `j = 2`, none, or as many as memory allows),
//!    W into any gap or only gaps of at least T_W, F or I first, depth- or breadth-first.
//! 2. **Per-rank knobs.** Hill-climbing from the best family: one rank's depth or W's held
//!    back up or down by one, kept when the plan improves.
//! 3. **Moves.** Local search on the best plan's lists: one or two actions of a rank (half
//!    of them W's) moved a few places earlier or later (never against a dependency within
//!    the rank, never over the memory limit), kept when the plan improves. Moves are drawn
//!    from a fixed-seed generator, so the result is reproducible.
//!
//! The number of simulations is bounded by a budget that shrinks with the plan's size, so
//! p = 32, m = 256 stays within seconds.

use std::cmp::Ordering;

use super::Origin;
use super::greedy::{Knobs, schedule};
use crate::action::{Action, ActionKind};
use crate::memory::rank_peak_memory;
use crate::plan::Plan;
use crate::simulate::simulate;
use crate::timeline::{CostModel, Timeline};

/// Simulated actions the whole search may spend (families, hill-climbing and moves).
const ACTION_BUDGET: usize = 12_000_000;
/// Bounds on the number of plans scored, whatever the size.
const MIN_EVALS: usize = 60;
const MAX_EVALS: usize = 4_000;

/// A plan with its simulated timeline and peak memory.
#[derive(Clone, Debug)]
pub(crate) struct Scored {
    pub plan: Plan,
    pub timeline: Timeline,
    pub peak: f64,
}

impl Scored {
    /// Simulates `plan`; `None` if it cannot run.
    pub fn new(plan: Plan, cost: &CostModel) -> Option<Scored> {
        let timeline = simulate(&plan, cost).ok()?;
        let peak = timeline
            .ranks
            .iter()
            .map(|r| r.peak_memory)
            .fold(0.0, f64::max);
        Some(Scored {
            plan,
            timeline,
            peak,
        })
    }

    /// Better first: steady bubble ratio, then bubble ratio, then the sum of the ranks'
    /// spans (which moves before the worst rank's does, giving the search a slope), then
    /// peak memory.
    pub fn order(&self, other: &Scored) -> Ordering {
        let (a, b) = (&self.timeline, &other.timeline);
        let spans = |t: &Timeline| t.ranks.iter().map(|r| r.span).sum::<f64>();
        let cmp = |x: f64, y: f64| {
            if (x - y).abs() <= 1e-12 * x.abs().max(y.abs()).max(1.0) {
                Ordering::Equal
            } else {
                x.total_cmp(&y)
            }
        };
        cmp(a.steady_bubble_ratio, b.steady_bubble_ratio)
            .then(cmp(a.bubble_ratio, b.bubble_ratio))
            .then(cmp(spans(a), spans(b)))
            .then(cmp(self.peak, other.peak))
    }
}

/// What the search found.
pub(crate) struct Found {
    pub best: Option<(Scored, Origin)>,
    pub evaluated: usize,
}

/// Keeps the best plan and counts the budget.
struct Search<'a> {
    shape: &'a Plan,
    cost: &'a CostModel,
    limit: f64,
    evals: usize,
    budget: usize,
    best: Option<(Scored, Origin)>,
}

impl Search<'_> {
    fn spent(&self) -> bool {
        self.evals >= self.budget
    }

    /// Scores `plan`; keeps it if it beats the best. True when it did.
    fn offer(&mut self, plan: Plan, origin: Origin) -> bool {
        self.evals += 1;
        let Some(s) = Scored::new(plan, self.cost) else {
            return false;
        };
        if s.peak > self.limit {
            return false;
        }
        let wins = self.best.as_ref().is_none_or(|(b, _)| s.order(b).is_lt());
        if wins {
            self.best = Some((s, origin));
        }
        wins
    }

    /// Runs the greedy scheduler with `knobs` and offers its plan.
    fn try_knobs(&mut self, knobs: &Knobs, origin: Origin) -> bool {
        match schedule(self.shape, self.cost, self.limit, knobs) {
            Some(plan) => self.offer(plan, origin),
            None => {
                self.evals += 1;
                false
            }
        }
    }
}

/// Searches for the best plan of `shape`'s size under `cost` within `limit`.
pub(crate) fn search(shape: &Plan, cost: &CostModel, limit: f64) -> Found {
    let actions = 3 * shape.stages * shape.microbatches;
    let mut s = Search {
        shape,
        cost,
        limit,
        evals: 0,
        budget: (ACTION_BUDGET / actions.max(1)).clamp(MIN_EVALS, MAX_EVALS),
        best: None,
    };
    let best_knobs = families(&mut s);
    if let Some(knobs) = best_knobs {
        hill_climb(&mut s, knobs);
    }
    move_actions(&mut s);
    Found {
        evaluated: s.evals,
        best: s.best,
    }
}

/// Step 1: the knob families; the knobs of the best plan.
fn families(s: &mut Search<'_>) -> Option<Knobs> {
    let p = s.shape.num_ranks();
    let v = s.shape.stages_per_rank().max(1);
    let per_rank = |f: &dyn Fn(usize) -> f64| -> Vec<usize> {
        (0..p)
            .map(|r| {
                let x = f(r);
                if x.is_finite() {
                    x.ceil().max(0.0) as usize
                } else {
                    usize::MAX
                }
            })
            .collect()
    };
    let mut best: Option<Knobs> = None;
    for k in [1.0, 1.5, 2.0, 3.0, f64::INFINITY] {
        for j in [0.0, 1.0, 2.0, f64::INFINITY] {
            for gap in [0.0, 1.0] {
                for f_first in [false, true] {
                    for deep_first in if v > 1 {
                        &[true, false][..]
                    } else {
                        &[true][..]
                    } {
                        let knobs = Knobs {
                            depth: per_rank(&|r| (k * (p - r) as f64).max(1.0)),
                            keep: per_rank(&|r| j * (r * v) as f64),
                            gap,
                            f_first,
                            deep_first: *deep_first,
                        };
                        if s.try_knobs(&knobs, Origin::Greedy) {
                            best = Some(knobs);
                        }
                    }
                }
            }
        }
    }
    best
}

/// Step 2: one rank's depth or W's held back up or down by one, while that helps.
fn hill_climb(s: &mut Search<'_>, mut knobs: Knobs) {
    let p = s.shape.num_ranks();
    let bump = |x: usize, up: bool| match (x, up) {
        (usize::MAX, _) => None,
        (0, false) => None,
        (x, true) => Some(x + 1),
        (x, false) => Some(x - 1),
    };
    let mut improved = true;
    while improved && !s.spent() {
        improved = false;
        for r in 0..p {
            for which in [0, 1] {
                for up in [true, false] {
                    if s.spent() {
                        return;
                    }
                    let mut k = knobs.clone();
                    let slot = if which == 0 {
                        &mut k.depth[r]
                    } else {
                        &mut k.keep[r]
                    };
                    let Some(x) = bump(*slot, up) else { continue };
                    if which == 0 && x == 0 {
                        continue;
                    }
                    *slot = x;
                    if s.try_knobs(&k, Origin::Search) {
                        knobs = k;
                        improved = true;
                    }
                }
            }
        }
    }
}

/// Step 3: moves on the best plan's lists, until the budget is spent: one or two actions
/// of one rank shifted a few places (half of them W's, the action the order is most free
/// in), kept when the plan improves. Two moves together can trade a W held back for a
/// forward let in later, which neither does alone within a memory limit.
fn move_actions(s: &mut Search<'_>) {
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let mut misses = 0usize;
    while !s.spent() && misses < 4 * s.budget.max(1) {
        let Some((best, _)) = &s.best else { return };
        let plan = &best.plan;
        let r = rng.below(plan.num_ranks());
        let mut list = plan.ranks[r].clone();
        for _ in 0..1 + rng.below(2) {
            let from = if rng.below(2) == 0 {
                let ws: Vec<usize> = (0..list.len())
                    .filter(|&i| matches!(list[i], Some(a) if a.kind == ActionKind::W))
                    .collect();
                match ws.len() {
                    0 => continue,
                    n => ws[rng.below(n)],
                }
            } else {
                rng.below(list.len())
            };
            let step = [1usize, 2, 3, 5, 8][rng.below(5)];
            let to = if rng.below(2) == 0 {
                from.saturating_sub(step)
            } else {
                (from + step).min(list.len() - 1)
            };
            let a = list.remove(from);
            list.insert(to, a);
        }
        if list == plan.ranks[r]
            || !in_rank_order(plan, r, &list)
            || rank_peak_memory(&list, s.cost) > s.limit
        {
            misses += 1;
            continue;
        }
        let mut candidate = plan.clone();
        candidate.ranks[r] = list;
        if !s.offer(candidate, Origin::Search) {
            misses += 1;
        }
    }
}

/// Whether rank `r`'s `list` keeps the dependencies that lie within the rank (F after the
/// previous stage's F, I after its own F and after the next stage's I, W after its I: the
/// simulator would report a broken one as a deadlock, after simulating everything), and
/// runs each stage's F's, I's and W's in micro-batch order, as the greedy scheduler does: a
/// stage then accumulates its weight gradients in the reference trainer's order, so a
/// pipelined run stays bitwise the reference.
fn in_rank_order(plan: &Plan, r: usize, list: &[Option<Action>]) -> bool {
    let (stages, m) = (plan.stages, plan.microbatches);
    let at = |s: u32, mb: u32| mb as usize * stages + s as usize;
    let mut f_done = vec![false; stages * m];
    let mut i_done = vec![false; stages * m];
    // Per stage: the next micro-batch of F, I and W.
    let mut next = vec![[0u32; 3]; stages];
    let local = |s: u32| (s as usize) < stages && plan.rank_of(s) == r;
    list.iter().flatten().all(|a| {
        let (s, mb) = (a.stage, a.microbatch);
        let (ok, slot) = match a.kind {
            ActionKind::F => (s == 0 || !local(s - 1) || f_done[at(s - 1, mb)], 0),
            ActionKind::I => (
                f_done[at(s, mb)] && (!local(s + 1) || i_done[at(s + 1, mb)]),
                1,
            ),
            ActionKind::W => (i_done[at(s, mb)], 2),
            _ => return true,
        };
        let in_turn = next[s as usize][slot] == mb;
        next[s as usize][slot] += 1;
        match a.kind {
            ActionKind::F => f_done[at(s, mb)] = true,
            ActionKind::I => i_done[at(s, mb)] = true,
            _ => {}
        }
        ok && in_turn
    })
}

/// A small fixed-seed generator (xorshift64): reproducible moves without a dependency.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
}
