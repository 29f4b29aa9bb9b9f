//! Tree-shaped verification: [`TreeStep`], what a step of [`InferStage::forward_with`]
//! carries besides its spans when some of them hold a draft tree instead of a chain.
//!
//! A tree span's rows are the root (row 0, the sequence's last verified token, at
//! position `start`) and the tree's nodes, parents before children. Row `r` sits at
//! position `start + depth(r)` and attends to the cached prefix `0..start`, its ancestors
//! and itself, so its output is bitwise the one of decoding its path alone
//! ([`attend_rows`](super::attend::attend_rows)). Every row is appended to the cache; the
//! next step of the sequence carries a [`Compaction`] that keeps the accepted path (moved to
//! consecutive positions) and drops the other branches, before its own span rolls back
//! and appends as usual.
//!
//! [`InferStage::forward_with`]: super::InferStage::forward_with

/// The non-chain part of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TreeStep {
    /// Per span, in order (or empty: every span a chain): the parent row of each of the
    /// span's rows (row 0, the root, names itself), or `None` for a chain span.
    pub parents: Vec<Option<Vec<usize>>>,
    /// Applied to the caches before the spans run.
    pub compact: Vec<Compaction>,
}

/// Keep positions `0..start` of sequence `slot` and its rows `start + keep[j]` at
/// `start + j` (see [`KvCache::compact`](super::KvCache::compact)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compaction {
    pub slot: usize,
    pub start: usize,
    pub keep: Vec<usize>,
}

/// How the rows of one span see each other.
#[derive(Clone, Debug)]
pub(super) struct RowLayout {
    /// Position offset of each row from the span's start (its depth).
    pub depth: Vec<usize>,
    /// The span's rows each row attends to (its ancestors, then itself), increasing.
    pub sees: Vec<Vec<usize>>,
}

impl TreeStep {
    /// The tree of span `i`, if it has one.
    pub fn tree(&self, i: usize) -> Option<&[usize]> {
        self.parents.get(i).and_then(|p| p.as_deref())
    }

    /// Why the step does not fit `spans` (`lens[i]` rows each), or `None`.
    pub(super) fn check(&self, lens: &[usize]) -> Option<String> {
        if !self.parents.is_empty() && self.parents.len() != lens.len() {
            return Some(format!(
                "{} tree shapes for {} spans",
                self.parents.len(),
                lens.len()
            ));
        }
        for (i, &len) in lens.iter().enumerate() {
            let Some(p) = self.tree(i) else { continue };
            if p.len() != len {
                return Some(format!("span {i}: {} parents for {len} rows", p.len()));
            }
            if p.first().is_some_and(|&r| r != 0) {
                return Some(format!("span {i}: row 0 is the root, its parent is itself"));
            }
            if let Some(r) = (1..len).find(|&r| p[r] >= r) {
                return Some(format!(
                    "span {i}: row {r} comes before its parent {}",
                    p[r]
                ));
            }
        }
        None
    }
}

/// The layout of a span of `len` rows whose parents are `parents` (`None`: a chain).
pub(super) fn layout(parents: Option<&[usize]>, len: usize) -> RowLayout {
    let Some(p) = parents else {
        return RowLayout {
            depth: (0..len).collect(),
            sees: (0..len).map(|r| (0..=r).collect()).collect(),
        };
    };
    let mut depth = vec![0; len];
    let mut sees: Vec<Vec<usize>> = Vec::with_capacity(len);
    for r in 0..len {
        let mut s = if r == 0 {
            Vec::new()
        } else {
            depth[r] = depth[p[r]] + 1;
            sees[p[r]].clone()
        };
        s.push(r);
        sees.push(s);
    }
    RowLayout { depth, sees }
}

#[cfg(test)]
#[path = "tree_tests.rs"]
mod tests;
