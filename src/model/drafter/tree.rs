//! [`DraftTree`]: a tree of draft tokens for speculative decoding (SpecInfer, EAGLE-2), the
//! generalisation of a [`DraftChain`](super::DraftChain), and [`Drafter::propose_tree`],
//! which drafts one.
//!
//! The root is the last verified token (not a node); node `i` follows its parent node, or
//! the root when it has none. Nodes are stored parents first, and the children of one
//! node are distinct tokens, so the target verifies the whole tree in one pass (row 0 the
//! root, row `i + 1` node `i`, each row attending to its ancestors only) and lossless
//! acceptance ([`crate::rl::tree`]) can walk it without drawing a token twice.
//!
//! # The shape ([`TreeShape`]): EAGLE-2's dynamic tree
//! The drafter grows the tree depth by depth. Each candidate node scores the drafter's
//! probability of its whole path (the product of `q` along it). At each depth the `width`
//! best-scoring nodes are expanded: their pairs (the parent's predicted hidden state and
//! the node's token) go through the drafter's block as one batch of rows, each attending
//! to the context window plus its ancestors, and each gets its `branch` most likely
//! tokens as children. After `depth` levels the `nodes` best-scoring candidates form the
//! tree. Why this rather than a fixed shape ("4,2,2,1"): where the drafter is sure, the
//! budget goes deep; where it hesitates, it goes wide, and the score is an estimate of
//! each node's chance of acceptance (EAGLE-2 shows the drafter's confidence is well
//! calibrated). A child never scores above its parent, so the best `nodes` always include
//! every selected node's parent.
//!
//! One change to EAGLE-2: the greedy chain (each node its parent's top token, down to
//! `depth`) is always expanded and kept, the score ranking the rest of the budget. Scores
//! alone gave a shallow, wide tree whose acceptance length fell below the chain's
//! (docs/benchmarks.md, "Draft trees keep the greedy chain"): the drafter's `q` is trained
//! towards the target's softened distribution, so its probabilities undersell how often its
//! top token is the target's, which is what greedy verification accepts. With the chain
//! inside, a tree accepts at least what the chain of its depth does. The cost is the
//! chain's: one block step per depth, with `width` rows instead of one, which
//! [`rowmul`](crate::model::infer::rowmul) streams at nearly the cost of one row; and the
//! target verifies `nodes + 1` rows at once.
//!
//! Candidates are the top tokens of the drafter's logits, not draws, so they are a
//! deterministic function of the context: the tree's sampling acceptance needs no `q`.

use super::propose::{Mat, Products};
use super::{DraftContext, Drafter, Result};
use crate::model::ModelError;
use crate::tensor::Backend;

/// The shape of the drafter's trees (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeShape {
    /// Levels below the root.
    pub depth: usize,
    /// Children per expanded node (the drafter's top tokens).
    pub branch: usize,
    /// Nodes expanded per level.
    pub width: usize,
    /// Nodes the tree keeps (the target verifies `nodes + 1` rows).
    pub nodes: usize,
}

impl Default for TreeShape {
    /// 12 nodes, 13 verification rows: one pass of the AVX-512 row product (up to 14 rows).
    fn default() -> Self {
        TreeShape {
            depth: 6,
            branch: 3,
            width: 3,
            nodes: 12,
        }
    }
}

impl TreeShape {
    /// Why the shape is unusable (the field and the reason), or `None`.
    pub fn check(&self) -> Option<(&'static str, String)> {
        let fields = [
            ("depth", self.depth),
            ("branch", self.branch),
            ("width", self.width),
            ("nodes", self.nodes),
        ];
        if let Some((f, _)) = fields.iter().find(|(_, v)| *v == 0) {
            return Some((f, "must be at least 1".into()));
        }
        if self.nodes > MAX_TREE_NODES {
            return Some((
                "nodes",
                format!(
                    "{} exceeds {MAX_TREE_NODES} (rows the target verifies at once)",
                    self.nodes
                ),
            ));
        }
        None
    }
}

/// Most nodes a tree may hold: beyond 31 verification rows the target's row product gives
/// way to the GEMM and a tree costs as much as decoding.
pub const MAX_TREE_NODES: usize = 31;

/// A block output a node's children are made from, and the key/value cache it attended
/// with (the context's, then its ancestors').
type Expanded = (Vec<f32>, (Vec<f32>, Vec<f32>));

/// A candidate node while the tree grows.
struct Candidate {
    parent: Option<usize>,
    token: u32,
    /// `ln` of the drafter's probability of the path down to this node.
    score: f64,
    /// The block output the node's pair is made from (its parent's, or the context's).
    from: usize,
    /// On the greedy chain (every node its parent's top token): always expanded and kept.
    spine: bool,
}

/// Ranks candidates: the greedy chain first, then by path score, ties to the earlier.
fn rank(c: &[Candidate], a: usize, b: usize) -> std::cmp::Ordering {
    (c[b].spine.cmp(&c[a].spine))
        .then(c[b].score.total_cmp(&c[a].score))
        .then(a.cmp(&b))
}

impl<B: Backend> Drafter<B> {
    /// Drafts a tree of at most `shape.nodes` nodes for each context (see the module docs).
    /// Candidates are the top tokens of `softmax(logits / temperature)` (temperature 0
    /// scores paths with temperature 1); the result does not depend on any draw.
    pub fn propose_tree(
        &mut self,
        contexts: &[DraftContext<'_>],
        shape: &TreeShape,
        temperature: f32,
    ) -> Result<Vec<DraftTree>> {
        if let Some((field, reason)) = shape.check() {
            return Err(ModelError::DrafterConfig { field, reason });
        }
        self.with_products("tree proposal", temperature, |drafter, products| {
            drafter.grow_trees(products, contexts, shape, temperature)
        })
    }

    fn grow_trees(
        &self,
        products: &mut Products<'_>,
        contexts: &[DraftContext<'_>],
        shape: &TreeShape,
        temperature: f32,
    ) -> Result<Vec<DraftTree>> {
        let (d, v) = (self.target.d_model, self.target.vocab);
        let t = if temperature > 0.0 { temperature } else { 1.0 };
        let groups = self.context_groups(contexts, "tree proposal")?;
        let mut trees = vec![DraftTree::default(); contexts.len()];
        for (&n, members) in &groups {
            let mut caches = vec![(Vec::new(), Vec::new()); members.len()];
            let (mut tokens, mut hidden) = (Vec::new(), Vec::new());
            for &(i, from) in members {
                tokens.extend_from_slice(&contexts[i].tokens[from..]);
                hidden.extend_from_slice(&contexts[i].hidden[from * d..]);
            }
            let last = self.block_step(products, &tokens, &hidden, n, &mut caches, true)?;
            // Per member: its candidates, and per block output (0: the context's) the
            // output rows and the cache they attend with.
            let mut cands: Vec<Vec<Candidate>> = (0..members.len()).map(|_| Vec::new()).collect();
            let mut outs: Vec<Vec<Expanded>> = caches
                .into_iter()
                .enumerate()
                .map(|(m, c)| vec![(last[m * d..(m + 1) * d].to_vec(), c)])
                .collect();
            let logits = self.product(products, Mat::Head, &last, members.len())?;
            for (m, c) in cands.iter_mut().enumerate() {
                children(
                    &logits[m * v..(m + 1) * v],
                    t,
                    shape.branch,
                    None,
                    0.0,
                    0,
                    c,
                );
            }
            // The candidates of the level below the root (then of each next level).
            let mut level: Vec<Vec<usize>> = cands.iter().map(|c| (0..c.len()).collect()).collect();
            for _ in 1..shape.depth {
                // The `width` best of each member's newest level, expanded as one batch.
                let mut rows: Vec<(usize, usize)> = Vec::new();
                for (m, lv) in level.iter_mut().enumerate() {
                    lv.sort_by(|&a, &b| rank(&cands[m], a, b));
                    lv.truncate(shape.width);
                    lv.sort_unstable();
                    rows.extend(lv.iter().map(|&c| (m, c)));
                }
                if rows.is_empty() {
                    break;
                }
                let mut toks = Vec::with_capacity(rows.len());
                let mut hid = Vec::with_capacity(rows.len() * d);
                let mut row_caches = Vec::with_capacity(rows.len());
                for &(m, c) in &rows {
                    let cand = &cands[m][c];
                    toks.push(cand.token);
                    let (h, cache) = &outs[m][cand.from];
                    hid.extend_from_slice(h);
                    row_caches.push(cache.clone());
                }
                let out = self.block_step(products, &toks, &hid, 1, &mut row_caches, false)?;
                let logits = self.product(products, Mat::Head, &out, rows.len())?;
                for lv in level.iter_mut() {
                    lv.clear();
                }
                for (r, (&(m, c), cache)) in rows.iter().zip(row_caches).enumerate() {
                    outs[m].push((out[r * d..(r + 1) * d].to_vec(), cache));
                    let from = outs[m].len() - 1;
                    let before = cands[m].len();
                    let score = cands[m][c].score;
                    children(
                        &logits[r * v..(r + 1) * v],
                        t,
                        shape.branch,
                        Some(c),
                        score,
                        from,
                        &mut cands[m],
                    );
                    level[m].extend(before..cands[m].len());
                }
            }
            for (m, &(i, _)) in members.iter().enumerate() {
                trees[i] = best_nodes(&cands[m], shape.nodes);
            }
        }
        Ok(trees)
    }
}

/// Appends the `branch` most likely tokens of `softmax(z / t)` as children of `parent`
/// (ties to the lower token, as greedy decoding's argmax), scored `score + ln q`.
fn children(
    z: &[f32],
    t: f32,
    branch: usize,
    parent: Option<usize>,
    score: f64,
    from: usize,
    out: &mut Vec<Candidate>,
) {
    let t = f64::from(t);
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse: f64 = z
        .iter()
        .map(|&x| (f64::from(x - max) / t).exp())
        .sum::<f64>()
        .ln();
    let mut top: Vec<usize> = Vec::with_capacity(branch + 1);
    // A token outside the draft vocabulary (−∞) is no candidate.
    for (i, &x) in z.iter().enumerate().filter(|(_, x)| x.is_finite()) {
        // Insertion into a short sorted list: `branch` is a handful.
        let at = top.partition_point(|&j| z[j] >= x);
        if at < branch {
            top.insert(at, i);
            top.truncate(branch);
        }
    }
    let spine = parent.is_none_or(|p| out[p].spine);
    let first = out.len();
    out.extend(top.into_iter().map(|i| Candidate {
        parent,
        token: i as u32,
        score: score + f64::from(z[i] - max) / t - lse,
        from,
        spine: false,
    }));
    if spine && first < out.len() {
        out[first].spine = true;
    }
}

/// The `nodes` best candidates ([`rank`]) as a tree, in candidate order (parents first:
/// a spine node's parent is on the spine, any other child scores at most its parent and
/// comes after it, so ties keep the parent).
fn best_nodes(cands: &[Candidate], nodes: usize) -> DraftTree {
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by(|&a, &b| rank(cands, a, b));
    order.truncate(nodes);
    order.sort_unstable();
    let mut index = vec![usize::MAX; cands.len()];
    let mut tree = DraftTree::default();
    for &c in &order {
        let parent = match cands[c].parent {
            None => None,
            // A parent always ranks above its children; should rounding ever break that,
            // the orphan is dropped rather than attached elsewhere.
            Some(p) if index[p] == usize::MAX => continue,
            Some(p) => Some(index[p]),
        };
        index[c] = tree.len();
        tree.parents.push(parent);
        tree.tokens.push(cands[c].token);
    }
    tree
}

/// Draft tokens as a tree hanging from the last verified token.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DraftTree {
    /// Node `i`'s parent node (`< i`), `None` for a child of the root.
    pub parents: Vec<Option<usize>>,
    /// Node `i`'s token.
    pub tokens: Vec<u32>,
}

impl DraftTree {
    /// The chain `tokens` as a tree (each node the only child of the one before).
    pub fn chain(tokens: &[u32]) -> Self {
        DraftTree {
            parents: (0..tokens.len()).map(|i| i.checked_sub(1)).collect(),
            tokens: tokens.to_vec(),
        }
    }

    /// Number of nodes (the root not counted).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Depth of each node: 1 for the root's children.
    pub fn depths(&self) -> Vec<usize> {
        let mut depth = Vec::with_capacity(self.len());
        for p in &self.parents {
            let d = p.map_or(1, |p| depth[p] + 1);
            depth.push(d);
        }
        depth
    }

    /// The children of `node` (`None`: the root's), in node order.
    pub fn children(&self, node: Option<usize>) -> impl Iterator<Item = usize> + '_ {
        (0..self.len()).filter(move |&i| self.parents[i] == node)
    }

    /// The verification rows' parents: row 0 is the root (its own parent, by convention),
    /// row `i + 1` node `i`, attached to its parent's row.
    pub fn row_parents(&self) -> Vec<usize> {
        std::iter::once(0)
            .chain(self.parents.iter().map(|p| p.map_or(0, |p| p + 1)))
            .collect()
    }

    /// The first `n` nodes (parents come first, so they still form a tree) whose depth is
    /// at most `max_depth`: what fits the positions a sequence has left.
    pub fn pruned(&self, n: usize, max_depth: usize) -> DraftTree {
        let depth = self.depths();
        let mut keep = vec![usize::MAX; self.len()];
        let mut out = DraftTree::default();
        for i in 0..self.len() {
            if out.len() == n {
                break;
            }
            let parent = match self.parents[i] {
                None => None,
                Some(p) if keep[p] != usize::MAX => Some(keep[p]),
                Some(_) => continue,
            };
            if depth[i] > max_depth {
                continue;
            }
            keep[i] = out.len();
            out.parents.push(parent);
            out.tokens.push(self.tokens[i]);
        }
        out
    }

    /// Why the tree is malformed (a parent after its child, siblings with one token, a
    /// token outside `vocab`), or `None`.
    pub fn check(&self, vocab: usize) -> Option<String> {
        if self.parents.len() != self.tokens.len() {
            return Some(format!(
                "{} parents for {} tokens",
                self.parents.len(),
                self.tokens.len()
            ));
        }
        for (i, (&p, &t)) in self.parents.iter().zip(&self.tokens).enumerate() {
            if p.is_some_and(|p| p >= i) {
                return Some(format!("node {i} comes before its parent {p:?}"));
            }
            if t as usize >= vocab {
                return Some(format!(
                    "node {i}: token {t} is outside the vocabulary {vocab}"
                ));
            }
            if (0..i).any(|j| self.parents[j] == p && self.tokens[j] == t) {
                return Some(format!("node {i} repeats a sibling's token {t}"));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_queries_and_pruning() {
        // root ─ 0 ─ 2 ─ 4
        //      └ 1 ─ 3
        let t = DraftTree {
            parents: vec![None, None, Some(0), Some(1), Some(2)],
            tokens: vec![5, 6, 7, 8, 9],
        };
        assert_eq!(t.check(10), None);
        assert_eq!(t.depths(), vec![1, 1, 2, 2, 3]);
        assert_eq!(t.children(None).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(t.children(Some(0)).collect::<Vec<_>>(), vec![2]);
        assert_eq!(t.row_parents(), vec![0, 0, 0, 1, 2, 3]);
        let p = t.pruned(10, 2);
        assert_eq!(p.tokens, vec![5, 6, 7, 8]);
        let p = t.pruned(3, 9);
        assert_eq!(p.parents, vec![None, None, Some(0)]);
        assert_eq!(DraftTree::chain(&[3, 4]).parents, vec![None, Some(0)]);
        assert!(t.check(9).unwrap().contains("vocabulary"));
        let twins = DraftTree {
            parents: vec![None, None],
            tokens: vec![1, 1],
        };
        assert!(twins.check(4).unwrap().contains("sibling"));
        let late = DraftTree {
            parents: vec![Some(1), None],
            tokens: vec![1, 2],
        };
        assert!(late.check(4).unwrap().contains("before its parent"));
    }
}

#[cfg(test)]
#[path = "tree_tests.rs"]
mod proposal_tests;
