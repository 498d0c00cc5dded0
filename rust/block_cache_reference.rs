//! Test-only: the block-per-record model that `block_cache.rs` replaced, kept as the
//! specification the radix-of-runs cache is checked against (the differential proptest in
//! `block_cache.rs`). Every block is a record in a hash table and every victim a heap entry;
//! slow, and obviously the policy the module notes describe.
#![allow(dead_code)]

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use crate::block_table::BlockTable;

use super::{BlockInfo, Event, Stats, DRAM, VRAM};
use crate::error::{CoreError, Result};

const MOVING: u8 = 0;
const COMPACT_SLACK: usize = 64;
/// How many blocks ahead a chain walk prefetches its table slots: enough misses in flight to
/// cover memory latency, few enough that the lines are still there when the walk arrives.
const AHEAD: usize = 8;

/// 56 bytes: a fleet-sized simulation holds ten million of these (128 workers' full caches),
/// so the parent is a value and a flag rather than an `Option`, and the tokens, which only the
/// stored events need, live in a side table that caches nobody reads events of leave empty.
#[derive(Clone, Copy, Debug, Default)]
struct Node {
    parent: u64,
    last: f64,
    stamp: u64,
    born: u64, // insertion order, for listing blocks as the Python dict did
    uses: u32,
    position: u32,
    nv: u32,   // children in VRAM
    nc: u32,   // children cached (either tier)
    salt: u32, // a prompt-start block's cache salt (0: none)
    tier: u8,
    has_parent: bool,
}

impl Node {
    #[inline]
    fn parent(&self) -> Option<u64> {
        if self.has_parent {
            Some(self.parent)
        } else {
            None
        }
    }
}

/// A victim-heap entry, ordered as the tuple `(uses, last, stamp, hash)`.
#[derive(Clone, Copy, Debug)]
struct Entry {
    uses: u64,
    last: f64,
    stamp: u64,
    h: u64,
}

crate::ord_from_cmp!(Entry);
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> Ordering {
        self.uses.cmp(&o.uses).then(self.last.total_cmp(&o.last)).then(self.stamp.cmp(&o.stamp)).then(self.h.cmp(&o.h))
    }
}

/// Blocks a call must not evict: none, a set, or those it stamped (a live heap entry carries its
/// block's current stamp, so `stamp > s` picks out the blocks this call touched).
#[derive(Clone, Copy)]
enum Pin<'a> {
    Nothing,
    Set(&'a HashSet<u64>),
    StampedAfter(u64),
}

#[derive(Default)]
struct Changes {
    cpu_stored: Vec<u64>,  // demoted into DRAM
    gpu_removed: Vec<u64>, // demoted or dropped from VRAM
    cpu_removed: Vec<u64>, // evicted from DRAM
}

/// See the module notes. Capacities are in blocks.
pub struct BlockCache {
    block_size: usize,
    cap: [usize; 3],
    used: [usize; 3],
    lfu: bool,
    nodes: BlockTable<Node>,
    heaps: [BinaryHeap<Reverse<Entry>>; 3],
    stamp: u64,
    born: u64,
    name_seed: u64,
    keep_tokens: bool,
    /// Live entries of each heap at its last compaction.
    heap_floor: [usize; 3],
    /// Blocks removed since the token map was last rebuilt.
    removed: usize,
    /// Each block's tokens, when the cache keeps them (for the stored events).
    toks: HashMap<u64, Box<[u32]>>,
    pub stats: Stats,
}

fn broken() -> CoreError {
    CoreError::InvalidArgument("no evictable leaf in a full tier: the cache invariants are broken".into())
}

impl BlockCache {
    /// `vram_blocks >= 1`; `dram_blocks` may be 0 (no offloading). `name_seed` varies how this
    /// cache names blocks (see [`Self::chain`]).
    pub fn new(block_size: usize, vram_blocks: usize, dram_blocks: usize, lfu: bool, name_seed: u64) -> Result<Self> {
        if block_size == 0 {
            return Err(CoreError::InvalidArgument("block_size must be >= 1".into()));
        }
        if vram_blocks == 0 {
            return Err(CoreError::InvalidArgument("VRAM must hold at least one block".into()));
        }
        Ok(BlockCache {
            block_size,
            cap: [0, vram_blocks, dram_blocks],
            used: [0; 3],
            lfu,
            nodes: BlockTable::new(),
            heaps: [BinaryHeap::new(), BinaryHeap::new(), BinaryHeap::new()],
            stamp: 0,
            born: 0,
            name_seed,
            keep_tokens: true,
            heap_floor: [0; 3],
            removed: 0,
            toks: HashMap::default(),
            stats: Stats::default(),
        })
    }

    /// Whether blocks keep their tokens (default). Only the stored events carry tokens: a
    /// cache nobody reads events of may drop them (a quarter of a block's bytes and an
    /// allocation per block); asking such a cache for events is then an error.
    pub fn set_keep_tokens(&mut self, keep: bool) -> Result<()> {
        if !self.nodes.is_empty() && keep != self.keep_tokens {
            return Err(CoreError::InvalidArgument("keep_tokens can change only while the cache is empty".into()));
        }
        self.keep_tokens = keep;
        Ok(())
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn capacity(&self, tier: u8) -> usize {
        self.cap[tier as usize]
    }
    /// Blocks cached in `tier` now.
    pub fn used(&self, tier: u8) -> usize {
        self.used[tier as usize]
    }
    pub fn len(&self) -> usize {
        self.nodes.len()
    }
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
    /// The tier of a block (0 when it is not cached).
    pub fn tier_of(&self, h: u64) -> u8 {
        self.nodes.get(&h).map_or(0, |x| x.tier)
    }
    /// Slots of the block table and of each victim heap's allocation (memory accounting).
    pub fn capacities(&self) -> (usize, usize, usize) {
        (self.nodes.capacity(), self.heaps[VRAM as usize].capacity(), self.heaps[DRAM as usize].capacity())
    }

    /// Entries in the victim heap of `tier` (live or stale), for the bound the tests check.
    pub fn heap_len(&self, tier: u8) -> usize {
        self.heaps[tier as usize].len()
    }
    /// Bytes this cache holds on the heap (tables at their capacity, block tokens, victim heaps):
    /// what a Python heap profiler cannot see. The chain memo is shared (see [`memo_bytes`]).
    pub fn memory_bytes(&self) -> usize {
        let nodes = self.nodes.capacity() * BlockTable::<Node>::SLOT_BYTES + self.toks.capacity() * (std::mem::size_of::<(u64, Box<[u32]>)>() + 1) + self.toks.len() * self.block_size * 4;
        let heaps: usize = self.heaps.iter().map(|h| h.capacity() * std::mem::size_of::<Entry>()).sum();
        std::mem::size_of::<Self>() + nodes + heaps
    }

    /// Every cached block, in the order they were stored.
    pub fn blocks(&self) -> Vec<BlockInfo> {
        let mut v: Vec<(u64, BlockInfo)> = self
            .nodes
            .iter()
            .map(|(h, x)| (x.born, BlockInfo { hash: h, parent: x.parent(), position: x.position, tier: x.tier, uses: x.uses as u64, last: x.last }))
            .collect();
        v.sort_unstable_by_key(|e| e.0);
        v.into_iter().map(|e| e.1).collect()
    }

    /// `(cached, vram)`: how many leading blocks of a chain of `n` blocks (block `i` named
    /// `name(i)`) are cached, and how many of those are in VRAM. Both are binary searches, not
    /// walks: a cached block's parent is cached (contiguity) and a VRAM block's parent is in
    /// VRAM (prefix-closed VRAM), and a name stands for its whole prefix, so "block i is
    /// cached" (and "is in VRAM") holds for a leading run of the chain and then never again.
    /// A long prompt's lookup touches ~2 log2(n) hash-table slots instead of n, and every
    /// slot is a cache miss in a fleet-sized table.
    fn prefix(&self, n: usize, name: impl Fn(usize) -> u64) -> (usize, usize) {
        let tier = |i: usize| self.nodes.get(&name(i)).map_or(0, |x| x.tier);
        let (mut lo, mut hi) = (0usize, n);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if tier(mid) != 0 {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let k = lo;
        let (mut lo, mut hi) = (0usize, k);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if tier(mid) == VRAM {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        (k, lo)
    }

    /// `(vram_blocks, dram_blocks)` of the longest cached prefix of `chain`.
    pub fn lookup(&self, chain: &[u64]) -> (usize, usize) {
        let (k, v) = self.prefix(chain.len(), |i| chain[i]);
        (v, k - v)
    }

    /// Every full block of the prompt (up to VRAM capacity) ends in VRAM: an admit after a
    /// prefill (`request`) or a same-region copy. `events`: whether to build them.
    pub fn place_vram(&mut self, tokens: &[u32], chain: &[u64], now: f64, salt: u32, request: bool, events: bool) -> Result<Vec<Event>> {
        self.place_vram_len(tokens, tokens.len(), chain, now, salt, request, events)
    }

    /// [`Self::place_vram`] of a prompt of `prompt_len` tokens; `tokens` may be empty when this
    /// cache keeps no tokens (a driver that never asks it for events need not hold a prompt's
    /// tokens while it waits).
    #[allow(clippy::too_many_arguments)]
    pub fn place_vram_len(&mut self, tokens: &[u32], prompt_len: usize, chain: &[u64], now: f64, salt: u32, request: bool, events: bool) -> Result<Vec<Event>> {
        if self.keep_tokens && tokens.len() != prompt_len {
            return Err(CoreError::InvalidArgument("a cache that keeps tokens needs the prompt's tokens".into()));
        }
        self.check_events(events)?;
        let bs = self.block_size;
        let n = chain.len();
        let (k, v) = self.prefix(n, |i| chain[i]);
        if request {
            self.stats.admits += 1;
            self.stats.prompt_tokens += prompt_len as u64;
            self.stats.vram_hit_tokens += (v * bs) as u64;
            self.stats.dram_hit_tokens += ((k - v) * bs) as u64;
        } else {
            self.stats.copies += 1;
        }
        let n_cap = n.min(self.cap[VRAM as usize]);
        self.stats.truncated_blocks += (n - n_cap) as u64;
        if n_cap == 0 {
            return Ok(Vec::new());
        }
        let ids = &chain[..n_cap];
        let kept = k.min(n_cap);
        let touched_after = self.stamp;
        // One use of the chain, parent first; touched blocks carry stamps no heap entry has, so
        // they are no victims below; the chain's last block is re-entered at the end.
        for (i, h) in ids[..kept].iter().enumerate() {
            if let Some(a) = ids[..kept].get(i + AHEAD) {
                self.nodes.prefetch(*a);
            }
            self.stamp += 1;
            let x = self.nodes.get_mut(h).expect("cached prefix");
            x.uses += 1;
            x.last = now;
            x.stamp = self.stamp;
        }
        let lifted: Vec<u64> = if v < kept { ids[v..kept].to_vec() } else { Vec::new() };
        for h in &lifted {
            self.nodes.get_mut(h).expect("cached prefix").tier = MOVING;
        }
        self.used[DRAM as usize] -= lifted.len();
        let mut ch = Changes::default();
        // The chain's VRAM head must not be demoted to make room for its own tail: those are
        // exactly the VRAM blocks stamped by this call (the lifted ones are in no tier yet).
        self.make_vram_room(n_cap as i64 - v as i64, &mut ch, Pin::StampedAfter(touched_after))?;
        for h in &lifted {
            let x = self.nodes.get_mut(h).expect("lifted block");
            x.tier = VRAM;
            if let Some(p) = x.parent() {
                self.nodes.get_mut(&p).expect("parent of a cached block").nv += 1;
            }
        }
        self.used[VRAM as usize] += lifted.len();
        self.stats.promoted_blocks += lifted.len() as u64;
        self.store_run(ids, kept, n_cap, tokens, now, salt);
        let last = ids[n_cap - 1];
        if self.nodes[&last].nv == 0 {
            self.push(VRAM, last);
        }
        if !events {
            return Ok(Vec::new());
        }
        let mut out = self.net(&ch);
        if n_cap > v {
            out.push(self.stored_event(&ids[v..n_cap], VRAM));
        }
        if !lifted.is_empty() {
            out.push(Event::Removed { medium: DRAM, hashes: lifted });
        }
        Ok(out)
    }

    /// A cross-region copy lands in DRAM: the blocks missing past the cached prefix are stored
    /// there (DRAM leaves evicted for room); nothing cached moves.
    pub fn place_dram(&mut self, tokens: &[u32], chain: &[u64], now: f64, salt: u32, events: bool) -> Result<Vec<Event>> {
        self.check_events(events)?;
        let n = chain.len();
        self.stats.copies += 1;
        let mut parent: Option<u64> = None;
        let mut chain_dram: Vec<u64> = Vec::new();
        let mut k = 0usize;
        for (i, &h) in chain.iter().enumerate() {
            if let Some(a) = chain.get(i + AHEAD) {
                self.nodes.prefetch(*a);
            }
            match self.nodes.get(&h) {
                None => break,
                Some(x) => {
                    if x.tier == DRAM {
                        chain_dram.push(h);
                    }
                }
            }
            parent = Some(h);
            k += 1;
        }
        let m = (n - k).min(self.cap[DRAM as usize] - chain_dram.len());
        self.stats.truncated_blocks += (n - k - m) as u64;
        if m == 0 {
            return Ok(Vec::new());
        }
        let mut ch = Changes::default();
        let pinned: HashSet<u64> = chain_dram.iter().copied().collect();
        let mut held: Vec<u64> = Vec::new();
        while self.used[DRAM as usize] + m > self.cap[DRAM as usize] {
            let h = self.pop(DRAM, Pin::Set(&pinned), &mut held)?;
            self.remove(h, &mut ch);
        }
        for h in held {
            self.push(DRAM, h);
        }
        let ids: Vec<u64> = chain[k..k + m].to_vec();
        for (i, &h) in ids.iter().enumerate() {
            self.store(h, parent, tokens, k + i, DRAM, now, salt);
            parent = Some(h);
        }
        self.push(DRAM, *ids.last().expect("m > 0"));
        if !events {
            return Ok(Vec::new());
        }
        let mut out = self.net(&ch);
        out.push(self.stored_event(&ids, DRAM));
        Ok(out)
    }

    /// Drop everything (the caller publishes `AllBlocksCleared`).
    pub fn clear(&mut self) {
        self.nodes.clear();
        self.toks.clear();
        for h in self.heaps.iter_mut() {
            h.clear();
        }
        self.used = [0; 3];
        self.stats.clears += 1;
    }

    /// Demote (or, without DRAM, drop) VRAM leaves other than `pinned` until `needed` more
    /// blocks fit.
    fn make_vram_room(&mut self, needed: i64, ch: &mut Changes, pinned: Pin<'_>) -> Result<()> {
        let (v, d) = (VRAM as usize, DRAM as usize);
        let mut held: Vec<u64> = Vec::new();
        while self.used[v] as i64 + needed > self.cap[v] as i64 {
            let h = self.pop(VRAM, pinned, &mut held)?;
            ch.gpu_removed.push(h);
            if self.cap[d] == 0 {
                self.remove(h, ch);
                continue;
            }
            if self.used[d] >= self.cap[d] {
                let mut none = Vec::new();
                let victim = self.pop(DRAM, Pin::Nothing, &mut none)?;
                self.remove(victim, ch);
            }
            let x = self.nodes.get_mut(&h).expect("victim");
            x.tier = DRAM;
            let (parent, nc) = (x.parent(), x.nc);
            self.used[v] -= 1;
            self.used[d] += 1;
            self.stats.demoted_blocks += 1;
            ch.cpu_stored.push(h);
            if let Some(p) = parent {
                let px = self.nodes.get_mut(&p).expect("parent of a cached block");
                px.nv -= 1;
                // The parent is often the next victim, and then its parent the next miss.
                let pp = px.has_parent.then_some(px.parent);
                if px.nv == 0 && px.tier == VRAM {
                    self.push(VRAM, p);
                }
                if let Some(pp) = pp {
                    self.nodes.prefetch(pp);
                }
            }
            if nc == 0 {
                self.push(DRAM, h);
            }
        }
        for h in held {
            self.push(VRAM, h);
        }
        Ok(())
    }

    fn check_events(&self, events: bool) -> Result<()> {
        if events && !self.keep_tokens {
            return Err(CoreError::InvalidArgument("this cache keeps no tokens, so it cannot publish events".into()));
        }
        Ok(())
    }

    fn new_node(&mut self, parent: Option<u64>, i: usize, tier: u8, now: f64, salt: u32) -> Node {
        self.stamp += 1;
        self.born += 1;
        Node {
            parent: parent.unwrap_or(0),
            has_parent: parent.is_some(),
            position: i as u32,
            tier,
            uses: 1,
            last: now,
            stamp: self.stamp,
            nv: 0,
            nc: 0,
            salt: if parent.is_none() { salt } else { 0 },
            born: self.born,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn store(&mut self, h: u64, parent: Option<u64>, tokens: &[u32], i: usize, tier: u8, now: f64, salt: u32) {
        let x = self.new_node(parent, i, tier, now, salt);
        self.nodes.insert(h, x);
        if self.keep_tokens {
            let bs = self.block_size;
            self.toks.insert(h, tokens[i * bs..(i + 1) * bs].into());
        }
        self.used[tier as usize] += 1;
        self.stats.stored_blocks += 1;
        if let Some(p) = parent {
            let px = self.nodes.get_mut(&p).expect("parent of a stored block");
            px.nc += 1;
            if tier == VRAM {
                px.nv += 1;
            }
        }
    }

    /// Store blocks `lo..hi` of a chain into VRAM, each the child of the one before.
    fn store_run(&mut self, ids: &[u64], lo: usize, hi: usize, tokens: &[u32], now: f64, salt: u32) {
        let mut prev = if lo > 0 { Some(ids[lo - 1]) } else { None };
        for (i, &h) in ids.iter().enumerate().take(hi).skip(lo) {
            if let Some(a) = ids[..hi].get(i + AHEAD) {
                self.nodes.prefetch(*a);
            }
            self.store(h, prev, tokens, i, VRAM, now, salt);
            prev = Some(h);
        }
    }

    /// Drop leaf `h` (a DRAM leaf, or a VRAM leaf when there is no DRAM).
    fn remove(&mut self, h: u64, ch: &mut Changes) {
        let x = self.nodes.remove(&h).expect("victim");
        self.removed += 1;
        if self.keep_tokens && self.removed > self.toks.capacity() / 4 {
            // A full cache evicts as much as it stores; every removal can leave a tombstone in
            // the token map, and when tombstones use up its slack hashbrown doubles it, so a
            // full 82k-block cache ended in a map sized for 229k. Rebuilding it afresh before
            // that keeps it sized for what it holds (O(n) per n/4 removals). The block table
            // needs none of this: it shifts entries back on removal and keeps no tombstones.
            self.toks = std::mem::take(&mut self.toks).into_iter().collect();
            self.removed = 0;
        }
        self.used[x.tier as usize] -= 1;
        self.stats.evicted_blocks += 1;
        if x.tier == DRAM {
            ch.cpu_removed.push(h);
        }
        self.toks.remove(&h);
        let Some(p) = x.parent() else { return };
        let px = self.nodes.get_mut(&p).expect("parent of a cached block");
        px.nc -= 1;
        if x.tier == VRAM {
            px.nv -= 1;
            if px.nv == 0 && px.tier == VRAM {
                self.push(VRAM, p);
            }
        } else if px.nc == 0 && px.tier == DRAM {
            self.push(DRAM, p);
        }
    }

    fn push(&mut self, tier: u8, h: u64) {
        let x = &self.nodes[&h];
        let e = Entry { uses: if self.lfu { x.uses as u64 } else { 0 }, last: x.last, stamp: x.stamp, h };
        let t = tier as usize;
        self.heaps[t].push(Reverse(e));
        // Compact when stale entries could outnumber the live ones: against the live count at
        // the last compaction (leaves, usually a small share of a tier's blocks, since most
        // blocks are inside chains), not the tier's size, which let a full cache carry two
        // stale entries per block. Each compaction at least halves the heap: O(1) amortised.
        if self.heaps[t].len() > 2 * self.used[t].min(self.heap_floor[t]) + COMPACT_SLACK {
            let old = std::mem::take(&mut self.heaps[t]);
            let mut live: Vec<Entry> = old.into_iter().map(|r| r.0).filter(|e| self.live(tier, e)).collect();
            live.sort_unstable();
            live.dedup();
            self.heap_floor[t] = live.len();
            self.heaps[t] = live.into_iter().map(Reverse).collect();
        }
    }

    fn live(&self, tier: u8, e: &Entry) -> bool {
        match self.nodes.get(&e.h) {
            Some(x) if x.tier == tier && x.stamp == e.stamp => {
                if tier == VRAM {
                    x.nv == 0
                } else {
                    x.nc == 0
                }
            }
            _ => false,
        }
    }

    /// The policy's least-valued leaf of `tier`, skipping `pinned` (collected in `held` for
    /// the caller to push back).
    fn pop(&mut self, tier: u8, pinned: Pin<'_>, held: &mut Vec<u64>) -> Result<u64> {
        let t = tier as usize;
        while let Some(Reverse(e)) = self.heaps[t].pop() {
            // The next candidate's slot, while this one is checked (a victim's parent is
            // usually the next, and already at hand; an unrelated leaf is a miss).
            if let Some(Reverse(n)) = self.heaps[t].peek() {
                self.nodes.prefetch(n.h);
            }
            if !self.live(tier, &e) {
                continue;
            }
            let pin = match pinned {
                Pin::Nothing => false,
                Pin::Set(p) => p.contains(&e.h),
                Pin::StampedAfter(s) => e.stamp > s,
            };
            if pin {
                held.push(e.h);
                continue;
            }
            return Ok(e.h);
        }
        Err(broken())
    }

    /// One call's changes as events: the CPU stores of demotions (in parent-to-child runs), the
    /// GPU removals, the CPU removals of evictions (a block demoted and evicted in one call
    /// shows only as removed from the GPU).
    fn net(&self, ch: &Changes) -> Vec<Event> {
        let mut out = Vec::new();
        let evicted: HashSet<u64> = ch.cpu_removed.iter().copied().collect();
        let demoted: HashSet<u64> = ch.cpu_stored.iter().copied().collect();
        let mut stored: Vec<u64> = ch.cpu_stored.iter().copied().filter(|h| !evicted.contains(h)).collect();
        if !stored.is_empty() {
            stored.sort_by_key(|h| self.nodes[h].position); // stable, as Python's sort
            for run in self.runs(&stored) {
                out.push(self.stored_event(&run, DRAM));
            }
        }
        if !ch.gpu_removed.is_empty() {
            out.push(Event::Removed { medium: VRAM, hashes: ch.gpu_removed.clone() });
        }
        let gone: Vec<u64> = ch.cpu_removed.iter().copied().filter(|h| !demoted.contains(h)).collect();
        if !gone.is_empty() {
            out.push(Event::Removed { medium: DRAM, hashes: gone });
        }
        out
    }

    /// Group blocks (parents before children) into parent-to-child chains.
    fn runs(&self, ids: &[u64]) -> Vec<Vec<u64>> {
        let mut runs: Vec<Vec<u64>> = Vec::new();
        let mut tails: HashMap<u64, usize> = HashMap::default();
        for &h in ids {
            let r = self.nodes[&h].parent().and_then(|p| tails.remove(&p));
            let r = r.unwrap_or_else(|| {
                runs.push(Vec::new());
                runs.len() - 1
            });
            runs[r].push(h);
            tails.insert(h, r);
        }
        runs
    }

    fn stored_event(&self, run: &[u64], medium: u8) -> Event {
        let mut tokens = Vec::with_capacity(run.len() * self.block_size);
        for h in run {
            tokens.extend_from_slice(self.toks.get(h).map_or(&[][..], |t| &t[..]));
        }
        let first = &self.nodes[&run[0]];
        Event::Stored { medium, hashes: run.to_vec(), parent: first.parent(), tokens, salt: if first.parent().is_none() { first.salt } else { 0 } }
    }
}

