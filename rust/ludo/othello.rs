//! The writer's side of the Othello classifier: the bipartite graph whose edges are the keys.
//!
//! A key's class bit is `A[ia] xor B[ib]`. As long as the graph is a forest, any single edge's
//! bit can be set by flipping every node on one side of it, and flipping a whole component never
//! changes the bit of any edge inside it. So the writer keeps the real forest (adjacency lists)
//! and refuses an edge that would close a cycle (the table's keyed fallback takes that key).
//!
//! Whether a new edge (u, v) closes a cycle is decided by walking the trees of u and of v in
//! lockstep, one node each in turn: a walk that reaches the other end means one component (a
//! cycle); the first walk to finish has enumerated the smaller component, which is also the set
//! of cells to flip if the new edge's bit is wrong. That costs at most twice the smaller
//! component, and the graph is sparse (about 0.8 edges per node at 95 % load: most components
//! have a handful of nodes, and an end is isolated in about two inserts of three). A union-find
//! filter used to answer "certainly not connected" first; it cost a 4-byte link per node and
//! chains of dependent cache misses per insert, and the walk was needed anyway for the flips.
//!
//! Layout: one 4-byte word per node holds its only neighbour, or points into a flat array of
//! neighbour records of exactly its degree (4 bytes a neighbour, up to [`MAX_REC`]; beyond that a
//! side map that no realistic load reaches). Degrees are about Poisson with mean 0.71 (A side)
//! and 0.95 (B side) at 95 % load, so of the nodes with a record seven in ten have exactly two
//! neighbours and one in five three: exact sizes instead of room for four in every record (and a
//! map for the fifth on) save about 3.6 bytes a table entry. Edges need no identity of their
//! own: the graph has no parallel edges (a second key on the same two cells closes a cycle and is
//! refused), so an edge is its pair of endpoints, recomputable from the key.

use std::collections::HashMap;

use super::mem::HugeBuf;
use super::prefetch;
use crate::patch::FLIP_B;

pub const NIL: u32 = u32::MAX;
/// A node word with this bit set (and not NIL) is `SPILL | offset` of its record in `lists`.
/// In `lists` it tags a record's size: the first `degree - 2` words of a record carry it
/// (neighbour ids are below it), so a pair is two untagged words.
const SPILL: u32 = 1 << 31;
/// Largest node count: node ids must stay below [`SPILL`].
pub const MAX_NODES: u64 = SPILL as u64 - 1;
/// Neighbours in the largest record; a node with more keeps the rest in the overflow map.
const MAX_REC: usize = 16;

#[derive(Clone, Debug)]
pub struct Forest {
    ma: u32,
    /// One word per node: NIL (no neighbour), the id of its only neighbour, or `SPILL | o`
    /// (two or more neighbours, in the record at word offset `o` of `lists`).
    nodes: HugeBuf<u32>,
    /// Neighbour records, back to back: `[a, b]`, `[a | SPILL, b, c]`,
    /// `[a | SPILL, b | SPILL, c, d]` and so on. (A record may straddle two cache lines; for the
    /// small ones that is rare, and the second line is the adjacent one.)
    lists: Vec<u32>,
    /// Offsets of the records no node uses, by size (`free[d - 2]` for `d` neighbours).
    free: [Vec<u32>; MAX_REC - 1],
    /// Neighbours beyond a full record's [`MAX_REC`], by node (a degree no load the tables are
    /// sized for reaches; the tests reach it on purpose).
    overflow: HashMap<u32, Vec<u32>>,
    live: u64,
    stats: WalkStats,
    queue: Vec<(u32, u32)>,
    queue_b: Vec<(u32, u32)>,
    /// The cells of the smaller component found by the last [`Forest::check_join`] that
    /// answered [`Join::Free`]: what [`Forest::join_flips`] hands out.
    join_side: Vec<u32>,
}

/// The patch encoding of node `node`'s Othello cell (A cells are the first `ma` nodes).
#[inline]
fn cell_of(ma: u32, node: u32) -> u32 {
    if node < ma {
        node
    } else {
        (node - ma) | FLIP_B
    }
}

/// How much walking the forest has done: what an insert's cycle check and a cuckoo move's
/// toggle cost beyond their fixed reads (each node visited is one record, often a cache miss).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WalkStats {
    /// Cycle checks of new edges ([`Forest::check_join`]) and the nodes they visited.
    pub joins: u64,
    pub join_nodes: u64,
    /// Toggles of existing edges ([`Forest::toggle_flips`]), the nodes visited and cells flipped.
    pub toggles: u64,
    pub toggle_nodes: u64,
    pub toggle_flips: u64,
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
        let n = ma as u64 + mb as u64;
        assert!(n <= MAX_NODES, "Othello forest of {n} nodes: Geometry keeps ma + mb <= {MAX_NODES}");
        Forest {
            ma,
            nodes: HugeBuf::filled(n as usize, NIL),
            // About 0.15 pairs, 0.04 triples and 0.01 quads a node once the table is full: 0.46
            // words a node.
            lists: Vec::with_capacity((n as usize).div_ceil(100) * 46),
            free: std::array::from_fn(|_| Vec::new()),
            overflow: HashMap::new(),
            live: 0,
            stats: WalkStats::default(),
            queue: Vec::new(),
            queue_b: Vec::new(),
            join_side: Vec::new(),
        }
    }

    /// Graph node of A cell `ia` / B cell `ib`.
    #[inline]
    pub fn nodes(&self, ia: u32, ib: u32) -> (u32, u32) {
        (ia, self.ma + ib)
    }

    /// The patch encoding of a node's Othello cell.
    #[inline]
    pub fn cell(&self, node: u32) -> u32 {
        cell_of(self.ma, node)
    }

    /// Call `f` on each neighbour of `x`.
    #[inline]
    fn for_each_nbr(&self, x: u32, mut f: impl FnMut(u32)) {
        let w = self.nodes[x as usize];
        if w == NIL {
            return;
        }
        if w & SPILL == 0 {
            f(w);
            return;
        }
        let mut o = (w & !SPILL) as usize;
        // Tagged words first, then the last two.
        loop {
            let y = self.lists[o];
            f(y & !SPILL);
            o += 1;
            if y & SPILL == 0 {
                break;
            }
        }
        f(self.lists[o]);
        if !self.overflow.is_empty() {
            if let Some(more) = self.overflow.get(&x) {
                for &y in more {
                    f(y);
                }
            }
        }
    }

    /// The neighbours in the record at offset `o`, untagged, and how many there are.
    #[inline]
    fn record(&self, o: usize) -> ([u32; MAX_REC], usize) {
        let mut r = [NIL; MAX_REC];
        let mut n = 0;
        loop {
            let y = self.lists[o + n];
            r[n] = y & !SPILL;
            n += 1;
            if y & SPILL == 0 {
                break;
            }
        }
        r[n] = self.lists[o + n];
        (r, n + 1)
    }

    /// Warm the node records an insert of edge (u, v) will touch, so their misses overlap.
    #[inline]
    pub fn prefetch_nodes(&self, u: u32, v: u32) {
        prefetch(&self.nodes, u as usize);
        prefetch(&self.nodes, v as usize);
    }

    /// Warm the neighbour lists of nodes `u` and `v` (those that have one), once their words are
    /// at hand: an edge change at both ends then waits for one miss, not two in a row.
    #[inline]
    pub fn prefetch_lists(&self, u: u32, v: u32) {
        for x in [u, v] {
            self.warm_list(x);
        }
    }

    /// May an edge (u, v) be added without closing a cycle? Walks both trees in lockstep (see
    /// the module docs); on [`Join::Free`] the smaller component's cells are kept for
    /// [`Self::join_flips`].
    pub fn check_join(&mut self, u: u32, v: u32) -> Join {
        let found = self.lockstep((u, NIL, v), (v, NIL, u));
        self.stats.joins += 1;
        self.stats.join_nodes += (self.queue.len() + self.queue_b.len()) as u64;
        match found {
            None => Join::Cycle,
            Some(side) => {
                let q = if side == 0 { &self.queue } else { &self.queue_b };
                let ma = self.ma;
                self.join_side.clear();
                self.join_side.extend(q.iter().map(|&(x, _)| cell_of(ma, x)));
                Join::Free
            }
        }
    }

    /// The cells [`Self::join_flips`] would hand out now (to warm them before they are needed).
    pub fn join_side(&self) -> &[u32] {
        &self.join_side
    }

    /// Cells to flip so that a new edge (u, v) between two components changes its bit: the
    /// smaller of the two components, flipped whole, as found by the [`Self::check_join`] of
    /// (u, v) just before (flips of other edges since then do not change the components).
    pub fn join_flips(&mut self, u: u32, v: u32, out: &mut Vec<u32>) {
        debug_assert!(self.join_side.iter().any(|&c| c == self.cell(u) || c == self.cell(v)), "join_flips without its check_join");
        out.extend_from_slice(&self.join_side);
    }

    /// Cells to flip so that existing edge (u, v) (and no other edge) changes its bit: the
    /// smaller side of the tree once the edge is cut.
    pub fn toggle_flips(&mut self, u: u32, v: u32, out: &mut Vec<u32>) {
        self.walk_smaller(u, v, v, u, out);
    }

    /// Request the neighbour list of walk entry `i`, if there is one and it has a list: the
    /// lockstep asks for the next entry's list of each side before expanding the current ones,
    /// so a walk's list reads overlap instead of each waiting on the one before. (The entry's
    /// node word was requested when it was queued.)
    #[inline]
    fn warm_entry(&self, q: &[(u32, u32)], i: usize) {
        if let Some(&(x, _)) = q.get(i) {
            self.warm_list(x);
        }
    }

    /// Request node `x`'s neighbour record, if it has one (its word must be at hand).
    #[inline]
    fn warm_list(&self, x: u32) {
        let w = self.nodes[x as usize];
        if w != NIL && w & SPILL != 0 {
            prefetch(&self.lists, (w & !SPILL) as usize);
        }
    }

    /// Queue the children of walk entry `i` (its neighbours except the one it came from), and
    /// say whether one of them is `target`.
    #[inline]
    fn expand_until(&self, q: &mut Vec<(u32, u32)>, i: usize, target: u32) -> bool {
        let (x, parent) = q[i];
        let mut hit = false;
        self.for_each_nbr(x, |y| {
            if y != parent {
                hit |= y == target;
                prefetch(&self.nodes, y as usize);
                q.push((y, x));
            }
        });
        hit
    }

    /// Walk the trees of `a` (not stepping to `from_a` first) and of `b` in lockstep, one node
    /// each in turn, and emit the cells of whichever finishes first: flipping either side is
    /// correct, and this costs at most twice the smaller side instead of the larger one.
    fn walk_smaller(&mut self, a: u32, from_a: u32, b: u32, from_b: u32, out: &mut Vec<u32>) {
        let side = self.lockstep((a, from_a, NIL), (b, from_b, NIL)).expect("no walk targets NIL");
        let q = if side == 0 { &self.queue } else { &self.queue_b };
        self.stats.toggles += 1;
        self.stats.toggle_nodes += (self.queue.len() + self.queue_b.len()) as u64;
        self.stats.toggle_flips += q.len() as u64;
        let ma = self.ma;
        out.extend(q.iter().map(|&(x, _)| cell_of(ma, x)));
    }

    /// Walk two trees in lockstep, each from `(start, the neighbour not to step to first,
    /// target)`, one node each in turn, into `self.queue` and `self.queue_b`: `Some(side)` once
    /// one side's walk is complete (checked right after each expansion, so an isolated start
    /// costs no read of the other), None as soon as either reaches its target.
    fn lockstep(&mut self, a: (u32, u32, u32), b: (u32, u32, u32)) -> Option<usize> {
        let mut qa = std::mem::take(&mut self.queue);
        let mut qb = std::mem::take(&mut self.queue_b);
        qa.clear();
        qb.clear();
        qa.push((a.0, a.1));
        qb.push((b.0, b.1));
        // A start with no neighbour but the one it may not step to is a whole side by itself,
        // and its node word (requested with the edge) says so: decide it without reading a
        // record, in the order the lockstep would (side a first). For b that is sound because
        // a's expansion cannot reach b's target then: a join's target is b's own start, which
        // has no neighbours; a toggle has none.
        let lone = |s: (u32, u32, u32)| {
            let w = self.nodes[s.0 as usize];
            w == NIL || (w & SPILL == 0 && w == s.1)
        };
        let side = if lone(a) {
            Some(0)
        } else if lone(b) && (a.2 == NIL || (a.2 == b.0 && self.nodes[b.0 as usize] == NIL)) {
            Some(1)
        } else {
            None
        };
        if side.is_some() {
            self.queue = qa;
            self.queue_b = qb;
            return side;
        }
        let (mut ia, mut ib) = (0, 0);
        let found = loop {
            self.warm_entry(&qb, ib);
            self.warm_entry(&qa, ia + 1);
            if self.expand_until(&mut qa, ia, a.2) {
                break None;
            }
            ia += 1;
            if ia == qa.len() {
                break Some(0);
            }
            if self.expand_until(&mut qb, ib, b.2) {
                break None;
            }
            ib += 1;
            if ib == qb.len() {
                break Some(1);
            }
        };
        self.queue = qa;
        self.queue_b = qb;
        found
    }

    /// A record for the neighbours `nbrs` (2..=[`MAX_REC`]), tagged: a freed one of that size,
    /// or a new one at the end.
    fn alloc(&mut self, nbrs: &[u32]) -> u32 {
        let n = nbrs.len();
        let o = match self.free[n - 2].pop() {
            Some(o) => o as usize,
            None => {
                if self.lists.len() + n > self.lists.capacity() {
                    // Grow by a sixteenth, not double: the records are a sixth of the writer's
                    // bytes, and what is reserved and unused counts as much as what is used.
                    self.lists.reserve_exact(self.lists.len() / 16 + 64);
                }
                self.lists.resize(self.lists.len() + n, NIL);
                self.lists.len() - n
            }
        };
        let rec = &mut self.lists[o..o + n];
        rec.copy_from_slice(nbrs);
        for y in &mut rec[..n - 2] {
            *y |= SPILL;
        }
        o as u32
    }

    fn release(&mut self, o: u32, n: usize) {
        self.lists[o as usize..o as usize + n].fill(NIL);
        self.free[n - 2].push(o);
    }

    /// Point node `x` at a new record holding `nbrs` (one neighbour: the node word itself).
    fn store(&mut self, x: u32, nbrs: &[u32]) {
        self.nodes[x as usize] = if nbrs.len() == 1 { nbrs[0] } else { SPILL | self.alloc(nbrs) };
    }

    fn push_nbr(&mut self, x: u32, y: u32) {
        let w = self.nodes[x as usize];
        if w == NIL {
            self.nodes[x as usize] = y;
            return;
        }
        if w & SPILL == 0 {
            self.store(x, &[w, y]);
            return;
        }
        let o = w & !SPILL;
        let (mut l, n) = self.record(o as usize);
        if n == MAX_REC {
            self.overflow.entry(x).or_default().push(y);
            return;
        }
        l[n] = y;
        self.release(o, n);
        self.store(x, &l[..n + 1]);
    }

    fn drop_nbr(&mut self, x: u32, y: u32) {
        let w = self.nodes[x as usize];
        if w == NIL {
            return;
        }
        if w & SPILL == 0 {
            if w == y {
                self.nodes[x as usize] = NIL;
            }
            return;
        }
        let o = w & !SPILL;
        let (mut l, n) = self.record(o as usize);
        let at = l[..n].iter().position(|&z| z == y);
        // Only a full record has more in the overflow map (pushes spill there only when it is
        // full, and a removal from it refills it from there).
        if n == MAX_REC {
            if let Some(more) = self.overflow.get_mut(&x) {
                let refill = match at {
                    None => {
                        if let Some(i) = more.iter().position(|&z| z == y) {
                            more.swap_remove(i);
                        }
                        None
                    }
                    Some(i) => more.pop().map(|r| (i, r)),
                };
                if more.is_empty() {
                    self.overflow.remove(&x);
                }
                if let Some((i, r)) = refill {
                    l[i] = r;
                    self.release(o, n);
                    self.store(x, &l[..n]);
                }
                return;
            }
        }
        let Some(i) = at else { return };
        l[i] = l[n - 1];
        self.release(o, n);
        self.store(x, &l[..n - 1]);
    }

    pub fn add_edge(&mut self, u: u32, v: u32) {
        self.push_nbr(u, v);
        self.push_nbr(v, u);
        self.live += 1;
    }

    pub fn remove_edge(&mut self, u: u32, v: u32) {
        self.drop_nbr(u, v);
        self.drop_nbr(v, u);
        self.live -= 1;
    }

    /// Bytes held, as (node words, neighbour lists with their free list and overflow map,
    /// walk scratch).
    pub fn memory_parts(&self) -> (usize, usize, usize) {
        let lists = 4 * self.lists.capacity()
            + 4 * self.free.iter().map(Vec::capacity).sum::<usize>()
            + self.overflow.capacity() * (4 + std::mem::size_of::<Vec<u32>>() + 1)
            + self.overflow.values().map(|v| 4 * v.capacity()).sum::<usize>();
        let scratch = std::mem::size_of::<Self>() + 8 * (self.queue.capacity() + self.queue_b.capacity()) + 4 * self.join_side.capacity();
        (self.nodes.bytes(), lists, scratch)
    }

    pub fn memory_bytes(&self) -> usize {
        let (a, b, c) = self.memory_parts();
        a + b + c
    }

    /// Walk counters since the forest was built (or as last set).
    pub fn walk_stats(&self) -> WalkStats {
        self.stats
    }

    /// Carry counters over from a forest this one replaces.
    pub fn set_walk_stats(&mut self, stats: WalkStats) {
        self.stats = stats;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn nbrs(f: &Forest, x: u32) -> Vec<u32> {
        let mut v = Vec::new();
        f.for_each_nbr(x, |y| v.push(y));
        v.sort_unstable();
        v
    }

    proptest! {
        /// A star grown and cut in any order passes through every record size (node word,
        /// records of 2 to MAX_REC, the overflow map) both ways and always lists exactly its live
        /// neighbours, and a fully cut forest leaves every record free for reuse.
        #[test]
        fn records_follow_degree(order in Just((0u32..20).collect::<Vec<u32>>()).prop_shuffle(), cut in Just((0u32..20).collect::<Vec<u32>>()).prop_shuffle()) {
            let mut f = Forest::new(1, 20);
            let mut live = Vec::new();
            for &b in &order {
                let (u, v) = f.nodes(0, b);
                f.add_edge(u, v);
                live.push(v);
                live.sort_unstable();
                prop_assert_eq!(nbrs(&f, u), live.clone());
                prop_assert_eq!(nbrs(&f, v), vec![u]);
            }
            for &b in &cut {
                let (u, v) = f.nodes(0, b);
                f.remove_edge(u, v);
                live.retain(|&z| z != v);
                prop_assert_eq!(nbrs(&f, u), live.clone());
                prop_assert!(nbrs(&f, v).is_empty());
            }
            prop_assert!(f.overflow.is_empty());
            let freed: usize = f.free.iter().enumerate().map(|(i, fl)| fl.len() * (i + 2)).sum();
            prop_assert_eq!(freed, f.lists.len());
        }

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
