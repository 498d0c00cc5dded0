//! The writer's side of the Othello classifier: the bipartite graph whose edges are the keys.
//!
//! A key's class bit is `A[ia] xor B[ib]`. As long as the graph is a forest, any single edge's
//! bit can be set by flipping every node on one side of it, and flipping a whole component never
//! changes the bit of any edge inside it. So the writer keeps the real forest (adjacency lists),
//! refuses an edge that would close a cycle (the table's keyed fallback takes that key), and
//! uses a union-find as a fast "certainly not connected" filter. Deletions cannot split
//! union-find sets, so the sets over-approximate components; a tree walk confirms before a key is
//! refused, and the sets are rebuilt once enough deletions have made them stale.
//!
//! Layout: one 16-byte record per node holds up to three neighbours and the union-find link (or,
//! at a root, the set size), so visiting a node costs one cache line; the ~1% of nodes with more
//! than three neighbours keep the rest in a side map. Edges need no identity of their own: the
//! graph has no parallel edges (a second key on the same two cells closes a cycle and is
//! refused), so an edge is its pair of endpoints, recomputable from the key.

use std::collections::HashMap;

use super::mem::{HugeBuf, Plain};
use super::prefetch;
use crate::patch::FLIP_B;

pub const NIL: u32 = u32::MAX;
const ROOT: u32 = 1 << 31;
const INLINE: usize = 3;

#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct Node {
    nbr: [u32; INLINE],
    /// Union-find: the parent node, or `ROOT | set size` at a root.
    up: u32,
}

// SAFETY: four u32, no padding.
unsafe impl Plain for Node {}

const FRESH: Node = Node { nbr: [NIL; INLINE], up: ROOT | 1 };

#[derive(Clone, Debug)]
pub struct Forest {
    ma: u32,
    nodes: HugeBuf<Node>,
    overflow: HashMap<u32, Vec<u32>>,
    live: u64,
    stale: u64,
    queue: Vec<(u32, u32)>,
    queue_b: Vec<(u32, u32)>,
}

/// Result of asking whether an edge may join the forest.
pub enum Join {
    /// Both ends already connected: adding the edge would close a cycle.
    Cycle,
    /// Separate components; adding it is safe.
    Free,
}

impl Forest {
    pub fn new(ma: u32, mb: u32) -> Self {
        Forest { ma, nodes: HugeBuf::filled(ma as usize + mb as usize, FRESH), overflow: HashMap::new(), live: 0, stale: 0, queue: Vec::new(), queue_b: Vec::new() }
    }

    /// Graph node of A cell `ia` / B cell `ib`.
    #[inline]
    pub fn nodes(&self, ia: u32, ib: u32) -> (u32, u32) {
        (ia, self.ma + ib)
    }

    /// The patch encoding of a node's Othello cell.
    #[inline]
    pub fn cell(&self, node: u32) -> u32 {
        if node < self.ma {
            node
        } else {
            (node - self.ma) | FLIP_B
        }
    }

    fn find(&mut self, mut x: u32) -> u32 {
        loop {
            let p = self.nodes[x as usize].up;
            if p & ROOT != 0 {
                return x;
            }
            let gp = self.nodes[p as usize].up;
            if gp & ROOT != 0 {
                return p;
            }
            // Path halving.
            self.nodes[x as usize].up = gp;
            x = gp;
        }
    }

    fn set_size(&self, root: u32) -> u32 {
        self.nodes[root as usize].up & !ROOT
    }

    fn union(&mut self, x: u32, y: u32) {
        let (rx, ry) = (self.find(x), self.find(y));
        if rx == ry {
            return;
        }
        let (sx, sy) = (self.set_size(rx), self.set_size(ry));
        let (big, small) = if sx >= sy { (rx, ry) } else { (ry, rx) };
        self.nodes[small as usize].up = big;
        self.nodes[big as usize].up = ROOT | (sx + sy).min(ROOT - 1);
    }

    /// Neighbours of `x` into `out` (inline ones, then any overflow).
    #[inline]
    fn for_each_nbr(&self, x: u32, mut f: impl FnMut(u32)) {
        let n = &self.nodes[x as usize];
        for &y in &n.nbr {
            if y == NIL {
                return;
            }
            f(y);
        }
        if let Some(more) = self.overflow.get(&x) {
            for &y in more {
                f(y);
            }
        }
    }

    /// Walk the tree of `start`, never stepping to `from` first (the side of edge
    /// (start, from) that holds `start`), into `self.queue`. Returns true if `target` was
    /// reached. The graph is a forest, so remembering each node's parent is enough to never
    /// revisit one.
    fn walk(&mut self, start: u32, from: u32, target: u32) -> bool {
        let mut q = std::mem::take(&mut self.queue);
        q.clear();
        q.push((start, from));
        let mut i = 0;
        let mut found = start == target;
        while i < q.len() {
            let (x, parent) = q[i];
            i += 1;
            self.for_each_nbr(x, |y| {
                if y != parent {
                    found |= y == target;
                    prefetch(&self.nodes, y as usize);
                    q.push((y, x));
                }
            });
        }
        self.queue = q;
        found
    }

    /// Warm the node records an insert of edge (u, v) will touch, so their misses overlap.
    #[inline]
    pub fn prefetch_nodes(&self, u: u32, v: u32) {
        prefetch(&self.nodes, u as usize);
        prefetch(&self.nodes, v as usize);
    }

    /// May an edge (u, v) be added without closing a cycle?
    pub fn check_join(&mut self, u: u32, v: u32) -> Join {
        if self.find(u) != self.find(v) {
            return Join::Free;
        }
        if self.walk(u, NIL, v) {
            Join::Cycle
        } else {
            Join::Free
        }
    }

    /// Cells to flip so that a new edge (u, v) between two components changes its bit: the
    /// smaller of the two components, flipped whole.
    pub fn join_flips(&mut self, u: u32, v: u32, out: &mut Vec<u32>) {
        self.walk_smaller(u, NIL, v, NIL, out);
    }

    /// Cells to flip so that existing edge (u, v) (and no other edge) changes its bit: the
    /// smaller side of the tree once the edge is cut.
    pub fn toggle_flips(&mut self, u: u32, v: u32, out: &mut Vec<u32>) {
        self.walk_smaller(u, v, v, u, out);
    }

    /// Queue the children of walk entry `i` (its neighbours except the one it came from).
    #[inline]
    fn expand(&self, q: &mut Vec<(u32, u32)>, i: usize) {
        let (x, parent) = q[i];
        self.for_each_nbr(x, |y| {
            if y != parent {
                prefetch(&self.nodes, y as usize);
                q.push((y, x));
            }
        });
    }

    /// Walk the trees of `a` (not stepping to `from_a` first) and of `b` in lockstep, one node
    /// each in turn, and emit the cells of whichever finishes first: flipping either side is
    /// correct, and this costs at most twice the smaller side instead of the larger one.
    fn walk_smaller(&mut self, a: u32, from_a: u32, b: u32, from_b: u32, out: &mut Vec<u32>) {
        let mut qa = std::mem::take(&mut self.queue);
        let mut qb = std::mem::take(&mut self.queue_b);
        qa.clear();
        qb.clear();
        qa.push((a, from_a));
        qb.push((b, from_b));
        let (mut ia, mut ib) = (0, 0);
        let done = loop {
            if ia == qa.len() {
                break 0;
            }
            self.expand(&mut qa, ia);
            ia += 1;
            if ib == qb.len() {
                break 1;
            }
            self.expand(&mut qb, ib);
            ib += 1;
        };
        let side = if done == 0 { &qa } else { &qb };
        out.extend(side.iter().map(|&(x, _)| self.cell(x)));
        self.queue = qa;
        self.queue_b = qb;
    }

    fn push_nbr(&mut self, x: u32, y: u32) {
        let n = &mut self.nodes[x as usize];
        for slot in n.nbr.iter_mut() {
            if *slot == NIL {
                *slot = y;
                return;
            }
        }
        self.overflow.entry(x).or_default().push(y);
    }

    fn drop_nbr(&mut self, x: u32, y: u32) {
        if let Some(more) = self.overflow.get_mut(&x) {
            if let Some(i) = more.iter().position(|&z| z == y) {
                more.swap_remove(i);
                if more.is_empty() {
                    self.overflow.remove(&x);
                }
                return;
            }
        }
        let refill = self.overflow.get_mut(&x).and_then(|m| m.pop());
        if self.overflow.get(&x).is_some_and(|m| m.is_empty()) {
            self.overflow.remove(&x);
        }
        let n = &mut self.nodes[x as usize];
        let Some(i) = n.nbr.iter().position(|&z| z == y) else { return };
        let last = n.nbr.iter().rposition(|&z| z != NIL).unwrap_or(i);
        n.nbr[i] = n.nbr[last];
        n.nbr[last] = NIL;
        if let Some(r) = refill {
            n.nbr[INLINE - 1] = r;
        }
    }

    pub fn add_edge(&mut self, u: u32, v: u32) {
        self.push_nbr(u, v);
        self.push_nbr(v, u);
        self.union(u, v);
        self.live += 1;
    }

    pub fn remove_edge(&mut self, u: u32, v: u32) {
        self.drop_nbr(u, v);
        self.drop_nbr(v, u);
        self.live -= 1;
        self.stale += 1;
        // Stale links merge sets until every insert needs a confirming walk; re-deriving the sets
        // costs one pass, so do it once deletions have made a comparable number of links stale.
        if self.stale > self.live.max(1024) / 2 {
            self.rebuild_sets();
        }
    }

    /// Recompute union-find sets from the real forest so they stop over-approximating.
    fn rebuild_sets(&mut self) {
        for n in self.nodes.iter_mut() {
            n.up = ROOT | 1;
        }
        for x in 0..self.nodes.len() as u32 {
            let mut ys = [NIL; INLINE];
            ys.copy_from_slice(&self.nodes[x as usize].nbr);
            for y in ys {
                if y != NIL && y > x {
                    self.union(x, y);
                }
            }
            if let Some(more) = self.overflow.get(&x).cloned() {
                for y in more {
                    if y > x {
                        self.union(x, y);
                    }
                }
            }
        }
        self.stale = 0;
    }

    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.nodes.bytes()
            + 8 * (self.queue.capacity() + self.queue_b.capacity())
            + self.overflow.capacity() * (4 + std::mem::size_of::<Vec<u32>>() + 1)
            + self.overflow.values().map(|v| 4 * v.capacity()).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Against a brute-force connectivity oracle: joins are refused exactly when they close
        /// a cycle, and toggle flips change exactly the toggled edge's parity.
        #[test]
        fn forest_matches_oracle(ops in proptest::collection::vec((0u32..6, 0u32..6, any::<bool>()), 1..200)) {
            let (ma, mb) = (6u32, 6u32);
            let mut f = Forest::new(ma, mb);
            let mut edges: Vec<(u32, u32)> = Vec::new();
            let mut bits = vec![0u8; 12];
            let connected = |edges: &[(u32, u32)], a: u32, b: u32| {
                let mut seen = vec![false; 12];
                let mut st = vec![a];
                seen[a as usize] = true;
                while let Some(x) = st.pop() {
                    for &(p, q) in edges {
                        for (s, t) in [(p, q), (q, p)] {
                            if s == x && !seen[t as usize] { seen[t as usize] = true; st.push(t); }
                        }
                    }
                }
                seen[b as usize]
            };
            for (ia, ib, add) in ops {
                let (u, v) = f.nodes(ia, ib);
                if add || edges.is_empty() {
                    let cyc = connected(&edges, u, v);
                    match f.check_join(u, v) {
                        Join::Cycle => prop_assert!(cyc),
                        Join::Free => {
                            prop_assert!(!cyc);
                            let mut fl = Vec::new();
                            f.join_flips(u, v, &mut fl);
                            let before: Vec<u8> = edges.iter().map(|&(p, q)| bits[p as usize] ^ bits[q as usize]).collect();
                            for c in fl { let n = if c & FLIP_B != 0 { (c & !FLIP_B) + ma } else { c }; bits[n as usize] ^= 1; }
                            let after: Vec<u8> = edges.iter().map(|&(p, q)| bits[p as usize] ^ bits[q as usize]).collect();
                            prop_assert_eq!(before, after);
                            f.add_edge(u, v);
                            edges.push((u, v));
                        }
                    }
                } else {
                    let i = (ia as usize * 7 + ib as usize) % edges.len();
                    let (p, q) = edges[i];
                    let mut fl = Vec::new();
                    f.toggle_flips(p, q, &mut fl);
                    let before: Vec<u8> = edges.iter().map(|&(a, b)| bits[a as usize] ^ bits[b as usize]).collect();
                    for c in fl { let n = if c & FLIP_B != 0 { (c & !FLIP_B) + ma } else { c }; bits[n as usize] ^= 1; }
                    let after: Vec<u8> = edges.iter().map(|&(a, b)| bits[a as usize] ^ bits[b as usize]).collect();
                    for j in 0..edges.len() {
                        prop_assert_eq!(before[j] != after[j], j == i);
                    }
                    if ib % 2 == 0 {
                        f.remove_edge(p, q);
                        edges.swap_remove(i);
                    }
                }
            }
        }
    }
}
