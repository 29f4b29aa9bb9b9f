//! [`DraftTree`]: a tree of draft tokens for speculative decoding (SpecInfer, EAGLE-2), the
//! generalisation of a [`DraftChain`](super::DraftChain).
//!
//! The root is the last verified token (not a node); node `i` follows its parent node, or
//! the root when it has none. Nodes are stored parents first, and the children of one
//! node are distinct tokens, so the target verifies the whole tree in one pass (row 0 the
//! root, row `i + 1` node `i`, each row attending to its ancestors only) and lossless
//! acceptance ([`crate::rl::tree`]) can walk it without drawing a token twice.

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
