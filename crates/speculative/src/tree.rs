//! Token trees: several drafted branches verified in one target batch.

use siliceo_core::TokenId;

/// A tree of drafted tokens. Node `i` has a token and a parent (`None` for the
/// children of the context's last token). Nodes are stored parents first, so
/// a node's index is larger than its parent's; the target runs every node in
/// one batch, each attending to its own ancestors only (one sequence id per
/// branch over the shared prefix).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftTree {
    tokens: Vec<TokenId>,
    parents: Vec<Option<usize>>,
}

impl DraftTree {
    /// An empty tree.
    pub fn new() -> Self {
        DraftTree::default()
    }

    /// Adds `token` under `parent` (`None`: under the context) and returns its index.
    ///
    /// # Panics
    /// When `parent` is not an existing node.
    pub fn push(&mut self, parent: Option<usize>, token: TokenId) -> usize {
        if let Some(p) = parent {
            assert!(p < self.tokens.len(), "parent {p} does not exist");
        }
        self.tokens.push(token);
        self.parents.push(parent);
        self.tokens.len() - 1
    }

    /// A tree with the `width` best tokens at the first level, each followed by
    /// a chain: `branches[b]` are the tokens of branch `b` (its first token at
    /// the first level).
    pub fn from_branches(branches: &[Vec<TokenId>]) -> Self {
        let mut t = DraftTree::new();
        for b in branches {
            let mut parent = None;
            for &tok in b {
                // Share a node with an earlier branch that starts the same way.
                let existing = (0..t.len()).find(|&i| t.parents[i] == parent && t.tokens[i] == tok);
                parent = Some(existing.unwrap_or_else(|| t.push(parent, tok)));
            }
        }
        t
    }

    /// Nodes.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the tree has no node.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Token of node `i`.
    pub fn token(&self, i: usize) -> TokenId {
        self.tokens[i]
    }

    /// Parent of node `i`.
    pub fn parent(&self, i: usize) -> Option<usize> {
        self.parents[i]
    }

    /// Depth of node `i` (1 for the first level): its position offset past
    /// the context is `depth - 1`.
    pub fn depth(&self, i: usize) -> usize {
        let mut d = 1;
        let mut n = i;
        while let Some(p) = self.parents[n] {
            d += 1;
            n = p;
        }
        d
    }

    /// The nodes from the first level down to `i`.
    pub fn path_to(&self, i: usize) -> Vec<usize> {
        let mut path = vec![i];
        while let Some(p) = self.parents[*path.last().expect("non-empty")] {
            path.push(p);
        }
        path.reverse();
        path
    }

    fn child(&self, parent: Option<usize>, token: TokenId) -> Option<usize> {
        (0..self.len()).find(|&i| self.parents[i] == parent && self.tokens[i] == token)
    }
}

/// Greedy verification of a tree. `root_argmax` is the target's argmax after
/// the context; `node_argmax[i]` its argmax after the context plus the path to
/// node `i`. Returns the accepted nodes (a path from the first level) and the
/// token after them; generation advances by `path.len() + 1` tokens, exactly
/// as greedy decoding of the target alone would.
///
/// # Panics
/// When `node_argmax` does not have one entry per node.
pub fn verify_tree_greedy(
    tree: &DraftTree,
    root_argmax: TokenId,
    node_argmax: &[TokenId],
) -> (Vec<usize>, TokenId) {
    assert_eq!(
        node_argmax.len(),
        tree.len(),
        "one target prediction per node"
    );
    let mut path = Vec::new();
    let mut want = root_argmax;
    let mut at = None;
    while let Some(n) = tree.child(at, want) {
        path.push(n);
        want = node_argmax[n];
        at = Some(n);
    }
    (path, want)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(x: u32) -> TokenId {
        TokenId(x)
    }

    #[test]
    fn branches_share_common_starts_and_verification_follows_the_target() {
        // Two first-level candidates (10, 20), each with a chain.
        let tree = DraftTree::from_branches(&[
            vec![t(10), t(11), t(12)],
            vec![t(20), t(21)],
            vec![t(10), t(13)],
        ]);
        assert_eq!(
            tree.len(),
            6,
            "the branches starting with 10 share their first node"
        );
        assert_eq!(tree.depth(2), 3);
        assert_eq!(tree.path_to(2), vec![0, 1, 2]);
        // The target picks 20, then 21, then 99: the second branch, plus 99.
        let mut argmax = vec![t(0); tree.len()];
        let n20 = tree.child(None, t(20)).unwrap();
        let n21 = tree.child(Some(n20), t(21)).unwrap();
        argmax[n20] = t(21);
        argmax[n21] = t(99);
        assert_eq!(
            verify_tree_greedy(&tree, t(20), &argmax),
            (vec![n20, n21], t(99))
        );
        // The target picks 10 then 13: the third branch's second node.
        let n10 = tree.child(None, t(10)).unwrap();
        let n13 = tree.child(Some(n10), t(13)).unwrap();
        argmax[n10] = t(13);
        argmax[n13] = t(7);
        assert_eq!(
            verify_tree_greedy(&tree, t(10), &argmax),
            (vec![n10, n13], t(7))
        );
        // No first-level node matches: nothing accepted, the target's token.
        assert_eq!(verify_tree_greedy(&tree, t(5), &argmax), (vec![], t(5)));
    }
}
