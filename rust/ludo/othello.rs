//! The writer's side of the Othello classifier: the bipartite graph whose edges are the keys.
//!
//! A key's class bit is `A[ia] xor B[ib]`. As long as the graph is a forest, any single edge's
//! bit can be set by flipping every node on one side of it, and flipping a whole component never
//! changes the bit of any edge inside it. So the writer keeps the real forest (adjacency lists),
//! refuses an edge that would close a cycle (the table's keyed fallback takes that key), and
//! uses a union-find as a fast "certainly not connected" filter. Deletions cannot split
//! union-find sets, so the sets over-approximate components; a BFS confirms before a key is
//! refused, and the sets are rebuilt once enough deletions have made them stale.

use crate::patch::FLIP_B;

pub const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Edge {
    a: u32,
    b: u32,
    next_a: u32,
    next_b: u32,
}

#[derive(Clone, Debug)]
pub struct Forest {
    ma: u32,
    head: Vec<u32>,
    edges: Vec<Edge>,
    free: Vec<u32>,
    parent: Vec<u32>,
    size: Vec<u32>,
    mark: Vec<u32>,
    stamp: u32,
    live: u64,
    stale: u64,
    queue: Vec<u32>,
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
        let n = ma as usize + mb as usize;
        Forest {
            ma,
            head: vec![NIL; n],
            edges: Vec::new(),
            free: Vec::new(),
            parent: (0..n as u32).collect(),
            size: vec![1; n],
            mark: vec![0; n],
            stamp: 0,
            live: 0,
            stale: 0,
            queue: Vec::new(),
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
        if node < self.ma {
            node
        } else {
            (node - self.ma) | FLIP_B
        }
    }

    fn find(&mut self, mut x: u32) -> u32 {
        while self.parent[x as usize] != x {
            let p = self.parent[x as usize];
            self.parent[x as usize] = self.parent[p as usize];
            x = p;
        }
        x
    }

    fn union(&mut self, x: u32, y: u32) {
        let (rx, ry) = (self.find(x), self.find(y));
        if rx == ry {
            return;
        }
        let (big, small) = if self.size[rx as usize] >= self.size[ry as usize] { (rx, ry) } else { (ry, rx) };
        self.parent[small as usize] = big;
        self.size[big as usize] += self.size[small as usize];
    }

    fn next_stamp(&mut self) -> u32 {
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.mark.fill(0);
            self.stamp = 1;
        }
        self.stamp
    }

    /// BFS the real component of `start`, not crossing edge `skip`, into `self.queue`.
    /// Returns true if `target` was reached.
    fn bfs(&mut self, start: u32, skip: u32, target: u32) -> bool {
        let st = self.next_stamp();
        self.queue.clear();
        self.queue.push(start);
        self.mark[start as usize] = st;
        let mut i = 0;
        let mut found = start == target;
        while i < self.queue.len() {
            let x = self.queue[i];
            i += 1;
            let mut e = self.head[x as usize];
            while e != NIL {
                let ed = self.edges[e as usize];
                let (other, next) = if ed.a == x { (ed.b, ed.next_a) } else { (ed.a, ed.next_b) };
                if e != skip && self.mark[other as usize] != st {
                    self.mark[other as usize] = st;
                    if other == target {
                        found = true;
                    }
                    self.queue.push(other);
                }
                e = next;
            }
        }
        found
    }

    /// May an edge (u, v) be added without closing a cycle?
    pub fn check_join(&mut self, u: u32, v: u32) -> Join {
        if self.find(u) != self.find(v) {
            return Join::Free;
        }
        if self.bfs(u, NIL, v) {
            Join::Cycle
        } else {
            Join::Free
        }
    }

    /// Cells to flip so that a new edge (u, v) between two components changes its bit: the
    /// smaller (by union-find estimate) of the two components, flipped whole.
    pub fn join_flips(&mut self, u: u32, v: u32, out: &mut Vec<u32>) {
        let (ru, rv) = (self.find(u), self.find(v));
        let start = if self.size[ru as usize] <= self.size[rv as usize] { u } else { v };
        self.bfs(start, NIL, NIL);
        for i in 0..self.queue.len() {
            out.push(self.cell(self.queue[i]));
        }
    }

    /// Cells to flip so that existing edge `e` (and no other edge) changes its bit: one side of
    /// the tree once `e` is cut.
    pub fn toggle_flips(&mut self, e: u32, out: &mut Vec<u32>) {
        let ed = self.edges[e as usize];
        self.bfs(ed.a, e, NIL);
        for i in 0..self.queue.len() {
            out.push(self.cell(self.queue[i]));
        }
    }

    pub fn add_edge(&mut self, u: u32, v: u32) -> u32 {
        let ed = Edge { a: u, b: v, next_a: self.head[u as usize], next_b: self.head[v as usize] };
        let id = match self.free.pop() {
            Some(id) => {
                self.edges[id as usize] = ed;
                id
            }
            None => {
                self.edges.push(ed);
                (self.edges.len() - 1) as u32
            }
        };
        self.head[u as usize] = id;
        self.head[v as usize] = id;
        self.union(u, v);
        self.live += 1;
        id
    }

    fn unlink(&mut self, node: u32, e: u32) {
        let mut prev = NIL;
        let mut cur = self.head[node as usize];
        while cur != NIL {
            let ed = self.edges[cur as usize];
            let next = if ed.a == node { ed.next_a } else { ed.next_b };
            if cur == e {
                if prev == NIL {
                    self.head[node as usize] = next;
                } else {
                    let p = &mut self.edges[prev as usize];
                    if p.a == node {
                        p.next_a = next;
                    } else {
                        p.next_b = next;
                    }
                }
                return;
            }
            prev = cur;
            cur = next;
        }
    }

    pub fn remove_edge(&mut self, e: u32) {
        let ed = self.edges[e as usize];
        self.unlink(ed.a, e);
        self.unlink(ed.b, e);
        self.free.push(e);
        self.live -= 1;
        self.stale += 1;
        if self.stale > self.live.max(1024) {
            self.rebuild_sets();
        }
    }

    /// Recompute union-find sets from the real forest so they stop over-approximating.
    fn rebuild_sets(&mut self) {
        for (i, p) in self.parent.iter_mut().enumerate() {
            *p = i as u32;
        }
        self.size.fill(1);
        let mut free = std::mem::take(&mut self.free);
        free.sort_unstable();
        let mut fi = 0;
        for e in 0..self.edges.len() as u32 {
            if fi < free.len() && free[fi] == e {
                fi += 1;
                continue;
            }
            let ed = self.edges[e as usize];
            self.union(ed.a, ed.b);
        }
        self.free = free;
        self.stale = 0;
    }

    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + 4 * (self.head.capacity() + self.free.capacity() + self.parent.capacity() + self.size.capacity() + self.mark.capacity() + self.queue.capacity())
            + std::mem::size_of::<Edge>() * self.edges.capacity()
    }
}
