//! The emulated engine's prefix cache: block-granular, two tiers (VRAM and host DRAM), LRU or
//! LFU, netting each call's changes into the KV events a vLLM worker would publish.
//!
//! `kvcompass/engine/cache.py` documents the model (blocks named by a chained hash, contiguity,
//! prefix-closed VRAM, leaf-only eviction per tier, event order). The victim of a tier is its
//! least-valued leaf block, compared as `(uses if LFU else 0, last use, stamp)`, where a block's
//! stamp is renewed each time a call stores or touches it (unique, so no tie is left).
//!
//! **Why a radix tree of runs, not a table of blocks.** A prompt is a few hundred blocks, and
//! the simulator stores, looks up and promotes every one of them on every worker it reaches;
//! with a hash-table record per block, a baseline scheme's run was mostly waiting on the table's
//! cache misses. But the blocks of one prompt are touched together: a *run* here is a maximal
//! chain of blocks with one history (stored, then touched, by the same calls), so its blocks
//! share `uses` and `last`, their stamps are consecutive, and only its first block can have a
//! parent outside it and only its last can have children. One record per run holds the blocks'
//! names (8 bytes each) and, when the cache publishes events, their tokens. A call splits the
//! run where its prompt stops touching it, so the invariant holds after every call.
//!
//! With that invariant the per-block policy is computed exactly at run granularity: a run has
//! at most one VRAM leaf (its last VRAM block, when the block after it is in DRAM or no child
//! run has VRAM blocks) and one DRAM leaf (its last block, when in DRAM and childless); after
//! that leaf goes, the run's next block is a leaf whose key is smaller than every other
//! candidate (same `uses` and `last`, an earlier stamp), so the run stays the victim without a
//! heap operation (the `top` slot) until it is used up or the call has what it needs. The
//! differential test against a brute-force oracle (`block_cache_oracle.rs`, test-only: every
//! victim found by scanning every block) checks that events, statistics and lookups are the
//! same, call for call.
//!
//! Blocks are identified by their chain hash; a chain is computed here from the prompt's tokens
//! with [`crate::chunk_hash::block_chain`] (so a call hashes once, without the GIL).

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use rustc_hash::FxHashSet as HashSet;

use crate::block_table::BlockTable;

use crate::chunk_hash::block_chain;
use crate::error::{CoreError, Result};
use crate::token_ids::mix64;

/// Bytes held by this thread's chain memo (a few prompts' tokens and chains).
pub fn memo_bytes() -> usize {
    BASE_MEMO.with(|m| m.borrow().iter().map(|(_, _, t, c)| t.capacity() * 4 + c.capacity() * 8).sum())
}

/// A block's tier: VRAM and DRAM.
pub const VRAM: u8 = 1;
pub const DRAM: u8 = 2;
const COMPACT_SLACK: usize = 64;
const NIL: u32 = u32::MAX;

/// A run of blocks with one history (see the module notes). Block `j` of the run has stamp
/// `stamp + j`, insertion number `born + j` and position `pos + j` in its prompt.
#[derive(Clone, Debug, Default)]
struct Run {
    /// The blocks' names, parent first; empty for a free record.
    ids: Vec<u64>,
    /// Their tokens, `block_size` each (only in a cache that publishes events, and not when
    /// `src` says where to find them again).
    toks: Vec<u32>,
    /// The request whose prompt holds the blocks' tokens at positions `pos..`, in the cache's
    /// [`TokenSource`] (a simulated fleet: the tokens were 64 of a block's ~80 bytes).
    src: Option<u32>,
    last: f64,
    stamp: u64,
    born: u64,
    /// The run holding this run's first block's parent ([`NIL`]: a prompt start).
    parent: u32,
    uses: u32,
    pos: u32,
    /// Leading blocks in VRAM (the rest are in DRAM: VRAM is prefix-closed).
    vram: u32,
    /// Child runs with VRAM blocks, and child runs.
    nv: u32,
    nc: u32,
    /// A prompt-start run's cache salt (0: none).
    salt: u32,
}

impl Run {
    #[inline]
    fn len(&self) -> u32 {
        self.ids.len() as u32
    }
}

/// Where a cache that publishes events finds a request's tokens again, so its blocks need not
/// carry them: the simulator's engine, which expands a prompt from its block ids on demand.
pub trait TokenSource: Send + Sync {
    /// The whole prompt of request `src`.
    fn tokens(&self, src: u32) -> Vec<u32>;

    /// Tokens `first * block_size .. (first + n) * block_size` of request `src`'s prompt (whole
    /// blocks inside it). A demotion's event needs a few blocks of a prompt: a source that can
    /// make them alone (the simulator's, from their ids) need not make the whole prompt.
    fn block_tokens(&self, src: u32, first: usize, n: usize, block_size: usize) -> Vec<u32> {
        self.tokens(src)[first * block_size..(first + n) * block_size].to_vec()
    }
}

/// A victim-heap entry: a run's leaf in one tier, ordered as `(uses, last, stamp)`; the stamp
/// names the block, and an entry whose block has since been touched, moved or dropped is stale.
#[derive(Clone, Copy, Debug)]
struct Entry {
    uses: u64,
    last: f64,
    stamp: u64,
    run: u32,
}

crate::ord_from_cmp!(Entry);
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> Ordering {
        self.uses.cmp(&o.uses).then(self.last.total_cmp(&o.last)).then(self.stamp.cmp(&o.stamp)).then(self.run.cmp(&o.run))
    }
}

/// One event of a call, in publication order. `medium` is [`VRAM`] (vLLM's "GPU") or [`DRAM`]
/// ("CPU").
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A contiguous run of blocks entered `medium`: their hashes, the run's parent, the run's
    /// tokens, and the cache salt of its first block when the run starts a prompt (else 0).
    Stored { medium: u8, hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, salt: u32 },
    /// Blocks left `medium`.
    Removed { medium: u8, hashes: Vec<u64> },
}

/// Counters since construction (`clear` does not reset them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub admits: u64,
    pub copies: u64,
    pub clears: u64,
    pub prompt_tokens: u64,
    pub vram_hit_tokens: u64,
    pub dram_hit_tokens: u64,
    pub stored_blocks: u64,
    pub promoted_blocks: u64,
    pub demoted_blocks: u64,
    pub evicted_blocks: u64,
    pub truncated_blocks: u64,
}

/// One cached block, for inspection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockInfo {
    pub hash: u64,
    pub parent: Option<u64>,
    pub position: u32,
    pub tier: u8,
    pub uses: u64,
    pub last: f64,
}

/// Leaves a call must not take: none, those of the given runs, or those it stamped (a live
/// entry carries its block's current stamp, so `stamp > s` picks out the blocks this call
/// touched).
#[derive(Clone, Copy)]
enum Pin<'a> {
    Nothing,
    Runs(&'a [u32]),
    StampedAfter(u64),
}

/// One call's moves, for its events (kept only when the call publishes them).
#[derive(Default)]
struct Changes {
    on: bool,
    cpu_stored: Vec<(u64, u32, u32)>, // demoted into DRAM: (name, run, index in run)
    gpu_removed: Vec<u64>,            // demoted or dropped from VRAM
    cpu_removed: Vec<u64>,            // evicted from DRAM
}

/// See the module notes. Capacities are in blocks.
pub struct BlockCache {
    block_size: usize,
    cap: [usize; 3],
    used: [usize; 3],
    lfu: bool,
    runs: Vec<Run>,
    free: Vec<u32>,
    /// A run's first block name -> the run (a name stands for its whole prefix, so this finds
    /// the next run of a walk).
    heads: BlockTable<u32>,
    heaps: [BinaryHeap<Reverse<Entry>>; 3],
    /// Per tier, one entry held beside the heap (part of it for every purpose): the run being
    /// used up, whose next leaf is always the least, so taking it needs no heap operation.
    top: [Option<Entry>; 3],
    stamp: u64,
    born: u64,
    blocks: usize,
    name_seed: u64,
    keep_tokens: bool,
    /// Events without tokens are allowed ([`Self::set_token_free_events`]).
    token_free_events: bool,
    /// Where source-backed runs' tokens are (see [`Run::src`]), and the current call's request.
    source: Option<std::sync::Arc<dyn TokenSource>>,
    call_src: Option<u32>,
    /// Live entries of each heap at its last compaction.
    heap_floor: [usize; 3],
    pub stats: Stats,
}

/// How many prompts' chains [`base_chain`] remembers (per thread).
const MEMO: usize = 4;

thread_local! {
    // The chains of the last prompts hashed on this thread, most recent first, with the block
    // size, salt seed and tokens they were computed from (compared in full, so a hit is exact).
    // An engine looks a prompt up on arrival, when it is queued and when its prefill starts,
    // then admits it, and a scheme with exact global state looks it up on every worker: one
    // hash chain per prompt serves them all, since the caches differ only in how they name
    // its blocks ([`BlockCache::chain`]).
    static BASE_MEMO: std::cell::RefCell<Vec<(usize, u64, Vec<u32>, Vec<u64>)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The seed-free chain of `tokens` under a cache salt's seed (0: none), remembered.
fn base_chain(tokens: &[u32], block_size: usize, salt_seed: u64) -> Result<Vec<u64>> {
    BASE_MEMO.with(|m| {
        let mut m = m.borrow_mut();
        if let Some(i) = m.iter().position(|(b, s, t, _)| *b == block_size && *s == salt_seed && t.as_slice() == tokens) {
            let hit = m.remove(i);
            let chain = hit.3.clone();
            m.insert(0, hit);
            return Ok(chain);
        }
        let chain = block_chain(salt_seed, tokens, block_size)?;
        m.truncate(MEMO - 1);
        m.insert(0, (block_size, salt_seed, tokens.to_vec(), chain.clone()));
        Ok(chain)
    })
}

fn broken() -> CoreError {
    CoreError::InvalidArgument("no evictable leaf in a full tier: the cache invariants are broken".into())
}

/// Full blocks of a prompt of `tokens` tokens an engine may take from its prefix cache. vLLM's
/// scheduler caps a hit at `tokens - 1` (`max_cache_hit_length` in its `kv_cache_manager.py`):
/// the last token is computed again for the logits of the first output token, and the hit is in
/// whole blocks, so a prompt of whole blocks that is all cached recomputes its last block.
pub fn reusable_blocks(tokens: usize, block_size: usize) -> usize {
    tokens.saturating_sub(1) / block_size.max(1)
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
        if vram_blocks.max(dram_blocks) >= u32::MAX as usize {
            return Err(CoreError::InvalidArgument("a tier holds fewer than 2^32 - 1 blocks".into()));
        }
        Ok(BlockCache {
            block_size,
            cap: [0, vram_blocks, dram_blocks],
            used: [0; 3],
            lfu,
            runs: Vec::new(),
            free: Vec::new(),
            heads: BlockTable::new(),
            heaps: [BinaryHeap::new(), BinaryHeap::new(), BinaryHeap::new()],
            top: [None; 3],
            stamp: 0,
            born: 0,
            blocks: 0,
            name_seed,
            keep_tokens: true,
            token_free_events: false,
            source: None,
            call_src: None,
            heap_floor: [0; 3],
            stats: Stats::default(),
        })
    }

    /// Whether blocks keep their tokens (default). Only the stored events carry tokens: a
    /// cache nobody reads events of may drop them (most of a block's bytes); asking such a
    /// cache for events is then an error.
    pub fn set_keep_tokens(&mut self, keep: bool) -> Result<()> {
        if !self.can_keep_tokens(keep) {
            return Err(CoreError::InvalidArgument("keep_tokens can change only while the cache is empty".into()));
        }
        self.keep_tokens = keep;
        Ok(())
    }

    /// Whether [`Self::set_keep_tokens`]`(keep)` would succeed: the cache is empty, or keeps
    /// tokens already as asked.
    pub fn can_keep_tokens(&self, keep: bool) -> bool {
        self.blocks == 0 || keep == self.keep_tokens
    }

    /// Events whose stored blocks carry no tokens (on), from a cache that keeps none, for a
    /// reader that names blocks by their hashes only: the simulator's own Dynamo indexer and
    /// Central Directory, for which expanding every prompt's tokens to put them in events nobody
    /// reads was a fifth of a run. Off again, such a cache refuses to publish events (its blocks
    /// have no tokens to give). Changes only while the cache is empty.
    pub fn set_token_free_events(&mut self, on: bool) -> Result<()> {
        if on {
            self.set_keep_tokens(false)?;
        }
        self.token_free_events = on;
        Ok(())
    }

    /// Whether the blocks keep their tokens (so a call must be given the prompt's).
    pub fn keeps_tokens(&self) -> bool {
        self.keep_tokens
    }

    /// Where this cache may find a request's tokens again (None: every run keeps its own).
    /// Runs that found theirs in the previous source copy them first, so no run ever reads
    /// another workload's prompt.
    pub fn set_token_source(&mut self, source: Option<std::sync::Arc<dyn TokenSource>>) {
        if let Some(old) = self.source.take() {
            let bs = self.block_size;
            for r in self.runs.iter_mut() {
                if let Some(s) = r.src.take() {
                    let at = r.pos as usize * bs;
                    r.toks = old.tokens(s)[at..at + r.ids.len() * bs].to_vec();
                }
            }
        }
        self.source = source;
    }

    /// The request whose whole prompt the next calls store (None: tokens kept as given). With a
    /// token source installed, blocks stored from it keep a reference, not their tokens.
    pub fn set_call_source(&mut self, req: Option<u32>) {
        self.call_src = req;
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
        self.blocks
    }
    pub fn is_empty(&self) -> bool {
        self.blocks == 0
    }
    /// The tier of a block (0 when it is not cached). An inspection call: it scans every run.
    pub fn tier_of(&self, h: u64) -> u8 {
        for r in &self.runs {
            if let Some(j) = r.ids.iter().position(|&x| x == h) {
                return if (j as u32) < r.vram { VRAM } else { DRAM };
            }
        }
        0
    }
    /// `(run records, VRAM heap slots, DRAM heap slots)` (memory accounting).
    pub fn capacities(&self) -> (usize, usize, usize) {
        (self.runs.capacity(), self.heaps[VRAM as usize].capacity(), self.heaps[DRAM as usize].capacity())
    }

    /// Entries in the victim heap of `tier` (live or stale), for the bound the tests check.
    pub fn heap_len(&self, tier: u8) -> usize {
        self.heaps[tier as usize].len() + self.top[tier as usize].is_some() as usize
    }
    /// Bytes this cache holds on the heap (run records, block names and tokens, the head table,
    /// victim heaps): what a Python heap profiler cannot see. The chain memo is shared (see
    /// [`memo_bytes`]).
    pub fn memory_bytes(&self) -> usize {
        let runs = self.runs.capacity() * std::mem::size_of::<Run>() + self.runs.iter().map(|r| r.ids.capacity() * 8 + r.toks.capacity() * 4).sum::<usize>();
        let heads = self.heads.capacity() * BlockTable::<u32>::SLOT_BYTES + self.free.capacity() * 4;
        let heaps: usize = self.heaps.iter().map(|h| h.capacity() * std::mem::size_of::<Entry>()).sum();
        std::mem::size_of::<Self>() + runs + heads + heaps
    }

    /// Every cached block, in the order they were stored.
    pub fn blocks(&self) -> Vec<BlockInfo> {
        let mut v: Vec<(u64, BlockInfo)> = Vec::with_capacity(self.blocks);
        for r in self.runs.iter().filter(|r| !r.ids.is_empty()) {
            for (j, &h) in r.ids.iter().enumerate() {
                let tier = if (j as u32) < r.vram { VRAM } else { DRAM };
                let info = BlockInfo { hash: h, parent: self.parent_of(r, j), position: r.pos + j as u32, tier, uses: r.uses as u64, last: r.last };
                v.push((r.born + j as u64, info));
            }
        }
        v.sort_unstable_by_key(|e| e.0);
        v.into_iter().map(|e| e.1).collect()
    }

    /// The names of the full blocks of `tokens` (a prompt with cache salt seed `salt_seed`, 0 for
    /// none): the XXH3 chain of the tokens (so a name stands for its whole prefix), mapped
    /// through `mix64(h ^ name_seed)`, a bijection, so caches with different seeds name the same
    /// block differently (as vLLM processes do) from one hash of the prompt; `name_seed` 0 keeps
    /// the chain itself.
    pub fn chain(&self, tokens: &[u32], salt_seed: u64) -> Result<Vec<u64>> {
        let mut chain = base_chain(tokens, self.block_size, salt_seed)?;
        if self.name_seed != 0 {
            let s = self.name_seed;
            chain.iter_mut().for_each(|h| *h = mix64(*h ^ s));
        }
        Ok(chain)
    }

    /// This cache's name for block `h` of a seed-free chain ([`block_chain`]).
    #[inline]
    pub fn name(&self, h: u64) -> u64 {
        if self.name_seed != 0 {
            mix64(h ^ self.name_seed)
        } else {
            h
        }
    }

    /// This cache's names for the seed-free chain `base`.
    pub fn named(&self, base: &[u64]) -> Vec<u64> {
        base.iter().map(|&h| self.name(h)).collect()
    }

    /// [`Self::lookup`] of the seed-free chain `base`, named on the way (no allocation): a
    /// driver that keeps a prompt's chain hashes it once for every cache.
    pub fn lookup_base(&self, base: &[u64]) -> (usize, usize) {
        let (k, v) = self.walk(base.len(), |i| self.name(base[i]), None);
        (v, k - v)
    }

    /// `(vram_blocks, dram_blocks)` a prompt of `tokens` tokens whose full blocks are `chain`
    /// (named by this cache, or seed-free with `base`) takes from this cache when it is
    /// scheduled: the longest cached prefix of at most [`reusable_blocks`] blocks.
    pub fn prompt_hit(&self, chain: &[u64], tokens: usize, base: bool) -> (usize, usize) {
        let head = &chain[..chain.len().min(reusable_blocks(tokens, self.block_size()))];
        if base {
            self.lookup_base(head)
        } else {
            self.lookup(head)
        }
    }

    /// `(vram_blocks, dram_blocks)` of the longest cached prefix of `chain`.
    pub fn lookup(&self, chain: &[u64]) -> (usize, usize) {
        let (k, v) = self.walk(chain.len(), |i| chain[i], None);
        (v, k - v)
    }

    /// `(cached, vram)`: how many leading blocks of a chain of `n` blocks (block `i` named
    /// `name(i)`) are cached, and how many of those are in VRAM; `path` gets the runs the
    /// cached prefix passes through, with how many of each run's blocks it covers. A run is
    /// found by its first block's name and then by comparing its last name in reach (or
    /// bisecting), so a prompt costs one table probe per run, not per block.
    fn walk(&self, n: usize, name: impl Fn(usize) -> u64, mut path: Option<&mut Vec<(u32, u32)>>) -> (usize, usize) {
        let mut pos = 0usize;
        let mut vram: Option<usize> = None;
        if n == 0 {
            return (0, 0);
        }
        let mut cur = self.heads.get(&name(0)).copied();
        while let Some(ri) = cur {
            let r = &self.runs[ri as usize];
            let lim = (r.ids.len()).min(n - pos);
            // The first name matched through the head table. A name stands for its whole prefix,
            // so "block j matches" holds for a leading run of the run's blocks: check the last
            // one first (a prompt usually covers a run whole), else bisect; a few names computed
            // instead of one per block (each a hash when the cache renames blocks).
            let m = if r.ids[lim - 1] == name(pos + lim - 1) {
                lim
            } else {
                let (mut lo, mut hi) = (1usize, lim - 1);
                while lo < hi {
                    let mid = lo + (hi - lo) / 2;
                    if r.ids[mid] == name(pos + mid) {
                        lo = mid + 1;
                    } else {
                        hi = mid;
                    }
                }
                lo
            };
            if vram.is_none() && (r.vram as usize) < m {
                vram = Some(pos + r.vram as usize);
            }
            if let Some(p) = path.as_deref_mut() {
                p.push((ri, m as u32));
            }
            pos += m;
            if m < r.ids.len() || pos == n {
                break;
            }
            cur = self.heads.get(&name(pos)).copied();
        }
        (pos, vram.unwrap_or(pos))
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
        if self.keep_tokens && tokens.len() < chain.len() * self.block_size {
            return Err(CoreError::InvalidArgument("the chain has more blocks than the tokens fill".into()));
        }
        self.check_events(events)?;
        let bs = self.block_size;
        let n = chain.len();
        let mut path: Vec<(u32, u32)> = Vec::new();
        let (k, v) = self.walk(n, |i| chain[i], Some(&mut path));
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
        let kept = k.min(n_cap);
        self.trim(&mut path, kept);
        // One use of the cached prefix: each run on it is touched whole (the trim split the
        // last), parent first, with fresh stamps no heap entry has, so they are no victims
        // below; the chain's last block is entered at the end.
        let touched_after = self.stamp;
        let mut lifted = 0usize;
        for &(ri, _) in &path {
            let r = &mut self.runs[ri as usize];
            r.uses += 1;
            r.last = now;
            r.stamp = self.stamp + 1;
            self.stamp += r.len() as u64;
            lifted += (r.len() - r.vram) as usize;
        }
        // The DRAM part of the prefix comes up: out of DRAM now (it is nobody's DRAM victim),
        // into VRAM's count once room is made (it is pinned meanwhile: stamped by this call).
        let lifted_ids: Vec<u64> = if events && lifted > 0 { chain[v..kept].to_vec() } else { Vec::new() };
        for &(ri, _) in &path {
            let (was, len, parent) = {
                let r = &self.runs[ri as usize];
                (r.vram, r.len(), r.parent)
            };
            if was < len {
                self.runs[ri as usize].vram = len;
                if was == 0 && parent != NIL {
                    self.runs[parent as usize].nv += 1;
                }
            }
        }
        self.used[DRAM as usize] -= lifted;
        let mut ch = Changes { on: events, ..Changes::default() };
        self.make_vram_room(n_cap as i64 - v as i64, &mut ch, Pin::StampedAfter(touched_after))?;
        self.used[VRAM as usize] += lifted;
        self.stats.promoted_blocks += lifted as u64;
        let parent = path.last().map_or(NIL, |p| p.0);
        let last = if n_cap > kept { self.store(&chain[kept..n_cap], tokens, kept, parent, VRAM, now, salt) } else { parent };
        if self.runs[last as usize].nv == 0 {
            self.push(VRAM, last);
        }
        if !events {
            return Ok(Vec::new());
        }
        let mut out = self.net(&ch);
        if n_cap > v {
            let first = if v == 0 { path.first().map_or(last, |p| p.0) } else { NIL };
            let salt = if v == 0 { self.runs[first as usize].salt } else { 0 };
            let toks = if self.keep_tokens { tokens[v * bs..n_cap * bs].to_vec() } else { Vec::new() };
            out.push(Event::Stored { medium: VRAM, hashes: chain[v..n_cap].to_vec(), parent: if v > 0 { Some(chain[v - 1]) } else { None }, tokens: toks, salt });
        }
        if !lifted_ids.is_empty() {
            out.push(Event::Removed { medium: DRAM, hashes: lifted_ids });
        }
        Ok(out)
    }

    /// A cross-region copy lands in DRAM: the blocks missing past the cached prefix are stored
    /// there (DRAM leaves evicted for room); nothing cached moves.
    pub fn place_dram(&mut self, tokens: &[u32], chain: &[u64], now: f64, salt: u32, events: bool) -> Result<Vec<Event>> {
        self.check_events(events)?;
        if self.keep_tokens && tokens.len() < chain.len() * self.block_size {
            return Err(CoreError::InvalidArgument("the chain has more blocks than the tokens fill".into()));
        }
        let n = chain.len();
        self.stats.copies += 1;
        let mut path: Vec<(u32, u32)> = Vec::new();
        let (k, v) = self.walk(n, |i| chain[i], Some(&mut path));
        let m = (n - k).min(self.cap[DRAM as usize] - (k - v));
        self.stats.truncated_blocks += (n - k - m) as u64;
        if m == 0 {
            return Ok(Vec::new());
        }
        self.trim(&mut path, k);
        let mut ch = Changes { on: events, ..Changes::default() };
        // The prefix's own DRAM blocks stay: the copy hangs from them.
        let pinned: Vec<u32> = path.iter().map(|p| p.0).collect();
        let mut held: Vec<Entry> = Vec::new();
        while self.used[DRAM as usize] + m > self.cap[DRAM as usize] {
            let e = self.pop(DRAM, Pin::Runs(&pinned), &mut held)?;
            self.remove_last(e.run, &mut ch);
        }
        for e in held {
            self.heap_push(DRAM, e);
        }
        let parent = path.last().map_or(NIL, |p| p.0);
        let ri = self.store(&chain[k..k + m], tokens, k, parent, DRAM, now, salt);
        self.push(DRAM, ri);
        if !events {
            return Ok(Vec::new());
        }
        let mut out = self.net(&ch);
        let toks = if self.keep_tokens { tokens[k * self.block_size..(k + m) * self.block_size].to_vec() } else { Vec::new() };
        let salt = if k == 0 { self.runs[ri as usize].salt } else { 0 };
        out.push(Event::Stored { medium: DRAM, hashes: chain[k..k + m].to_vec(), parent: if k > 0 { Some(chain[k - 1]) } else { None }, tokens: toks, salt });
        Ok(out)
    }

    /// VRAM's capacity becomes `blocks` (>= 1): blocks past it are demoted as a full tier
    /// demotes for a prompt (the least-valued VRAM leaves, to DRAM, DRAM's own victims evicted;
    /// dropped when there is no DRAM), and the events say so. Why: in an engine the prefix cache
    /// and the running sequences share one KV pool, so the cache has what decoding leaves it
    /// (the simulator's worker sets it as sequences start and finish). Growing moves nothing.
    pub fn set_vram_capacity(&mut self, blocks: usize, events: bool) -> Result<Vec<Event>> {
        if blocks == 0 {
            return Err(CoreError::InvalidArgument(
                "VRAM must hold at least one block".into(),
            ));
        }
        if blocks >= u32::MAX as usize {
            return Err(CoreError::InvalidArgument(
                "a tier holds fewer than 2^32 - 1 blocks".into(),
            ));
        }
        self.check_events(events)?;
        self.cap[VRAM as usize] = blocks;
        if self.used[VRAM as usize] <= blocks {
            return Ok(Vec::new());
        }
        let mut ch = Changes {
            on: events,
            ..Changes::default()
        };
        self.make_vram_room(0, &mut ch, Pin::Nothing)?;
        Ok(if events { self.net(&ch) } else { Vec::new() })
    }

    /// Drop everything (the caller publishes `AllBlocksCleared`).
    pub fn clear(&mut self) {
        self.runs.clear();
        self.free.clear();
        self.heads.clear();
        for h in self.heaps.iter_mut() {
            h.clear();
        }
        self.top = [None; 3];
        self.used = [0; 3];
        self.blocks = 0;
        self.stats.clears += 1;
    }

    /// Cut `path` (runs with the blocks of each a walk covered) to its first `keep` blocks,
    /// splitting the run where it ends so every run left on it is covered whole.
    fn trim(&mut self, path: &mut Vec<(u32, u32)>, keep: usize) {
        let mut acc = 0usize;
        for i in 0..path.len() {
            let (ri, _) = path[i];
            let len = self.runs[ri as usize].len() as usize;
            if acc + len >= keep {
                path.truncate(i + 1);
                let cut = keep - acc;
                if cut == 0 {
                    path.pop();
                } else if cut < len {
                    path[i] = (self.split(ri, cut as u32), cut as u32);
                } else {
                    path[i].1 = len as u32;
                }
                return;
            }
            path[i].1 = len as u32;
            acc += len;
        }
    }

    /// Split run `ri` after its first `k` blocks: the head moves to a new record, the tail
    /// stays (its children, heap entries and DRAM leaf keep pointing at it). Returns the head.
    fn split(&mut self, ri: u32, k: u32) -> u32 {
        let bs = self.block_size;
        let hi = self.alloc();
        let (head, tail_first) = {
            let r = &mut self.runs[ri as usize];
            let ids: Vec<u64> = r.ids.drain(..k as usize).collect();
            let toks: Vec<u32> = if r.toks.is_empty() { Vec::new() } else { r.toks.drain(..k as usize * bs).collect() };
            let head = Run {
                ids,
                toks,
                src: r.src,
                last: r.last,
                stamp: r.stamp,
                born: r.born,
                parent: r.parent,
                uses: r.uses,
                pos: r.pos,
                vram: r.vram.min(k),
                nv: (r.vram > k) as u32,
                nc: 1,
                salt: r.salt,
            };
            r.stamp += k as u64;
            r.born += k as u64;
            r.pos += k;
            r.vram = r.vram.saturating_sub(k);
            r.parent = hi;
            r.salt = 0;
            (head, r.ids[0])
        };
        let head_first = head.ids[0];
        let leaf = head.vram > 0 && head.vram <= k && (head.vram < k || head.nv == 0);
        self.runs[hi as usize] = head;
        self.heads.insert(head_first, hi);
        self.heads.insert(tail_first, ri);
        if leaf {
            // The run's VRAM leaf was in the head: its entry named the record the tail kept.
            self.push(VRAM, hi);
        }
        hi
    }

    fn alloc(&mut self) -> u32 {
        if let Some(i) = self.free.pop() {
            i
        } else {
            self.runs.push(Run::default());
            (self.runs.len() - 1) as u32
        }
    }

    /// Store the blocks `ids` (chain positions `at..`) as one new run in `tier`, the child of
    /// run `parent`'s last block (or a prompt start). Returns the run.
    #[allow(clippy::too_many_arguments)]
    fn store(&mut self, ids: &[u64], tokens: &[u32], at: usize, parent: u32, tier: u8, now: f64, salt: u32) -> u32 {
        let bs = self.block_size;
        let n = ids.len();
        let ri = self.alloc();
        let src = if self.keep_tokens && self.source.is_some() { self.call_src } else { None };
        let toks = if self.keep_tokens && src.is_none() { tokens[at * bs..(at + n) * bs].to_vec() } else { Vec::new() };
        self.runs[ri as usize] = Run {
            ids: ids.to_vec(),
            toks,
            src,
            last: now,
            stamp: self.stamp + 1,
            born: self.born + 1,
            parent,
            uses: 1,
            pos: at as u32,
            vram: if tier == VRAM { n as u32 } else { 0 },
            nv: 0,
            nc: 0,
            salt: if parent == NIL { salt } else { 0 },
        };
        self.stamp += n as u64;
        self.born += n as u64;
        self.heads.insert(ids[0], ri);
        if parent != NIL {
            let p = &mut self.runs[parent as usize];
            p.nc += 1;
            if tier == VRAM {
                p.nv += 1;
            }
        }
        self.used[tier as usize] += n;
        self.blocks += n;
        self.stats.stored_blocks += n as u64;
        ri
    }

    /// Demote (or, without DRAM, drop) VRAM leaves other than `pinned` until `needed` more
    /// blocks fit.
    fn make_vram_room(&mut self, needed: i64, ch: &mut Changes, pinned: Pin<'_>) -> Result<()> {
        let (v, d) = (VRAM as usize, DRAM as usize);
        let mut held: Vec<Entry> = Vec::new();
        while self.used[v] as i64 + needed > self.cap[v] as i64 {
            let e = self.pop(VRAM, pinned, &mut held)?;
            let ri = e.run;
            if self.cap[d] == 0 {
                let h = *self.runs[ri as usize].ids.last().expect("a victim run has blocks");
                if ch.on {
                    ch.gpu_removed.push(h);
                }
                self.remove_last(ri, ch);
                continue;
            }
            let j = self.runs[ri as usize].vram - 1;
            let h = self.runs[ri as usize].ids[j as usize];
            if ch.on {
                ch.gpu_removed.push(h);
            }
            if self.used[d] >= self.cap[d] {
                let mut none = Vec::new();
                let victim = self.pop(DRAM, Pin::Nothing, &mut none)?;
                self.remove_last(victim.run, ch);
            }
            let (vram, len, nc, parent) = {
                let r = &mut self.runs[ri as usize];
                r.vram -= 1;
                (r.vram, r.len(), r.nc, r.parent)
            };
            self.used[v] -= 1;
            self.used[d] += 1;
            self.stats.demoted_blocks += 1;
            if ch.on {
                ch.cpu_stored.push((h, ri, j));
            }
            if vram > 0 {
                self.follow(VRAM, ri);
            } else if parent != NIL {
                let p = &mut self.runs[parent as usize];
                p.nv -= 1;
                if p.nv == 0 && p.vram == p.len() {
                    self.push(VRAM, parent);
                }
            }
            if j + 1 == len && nc == 0 {
                self.push(DRAM, ri);
            }
        }
        for e in held {
            self.heap_push(VRAM, e);
        }
        Ok(())
    }

    /// Drop run `ri`'s last block (a DRAM leaf, or a VRAM leaf when there is no DRAM).
    fn remove_last(&mut self, ri: u32, ch: &mut Changes) {
        let bs = self.block_size;
        let (h, j, tier, parent) = {
            let r = &mut self.runs[ri as usize];
            let j = r.len() - 1;
            let h = r.ids.pop().expect("a victim run has blocks");
            if !r.toks.is_empty() {
                r.toks.truncate(j as usize * bs);
            }
            let tier = if j < r.vram {
                r.vram -= 1;
                VRAM
            } else {
                DRAM
            };
            (h, j, tier, r.parent)
        };
        self.used[tier as usize] -= 1;
        self.blocks -= 1;
        self.stats.evicted_blocks += 1;
        if tier == DRAM && ch.on {
            ch.cpu_removed.push(h);
        }
        if j > 0 {
            let r = &self.runs[ri as usize];
            if tier == VRAM {
                self.follow(VRAM, ri);
            } else if r.vram < r.len() {
                self.follow(DRAM, ri);
            }
            return;
        }
        // The run is gone.
        self.heads.remove(&h);
        self.runs[ri as usize] = Run::default();
        self.free.push(ri);
        if parent == NIL {
            return;
        }
        let p = &mut self.runs[parent as usize];
        p.nc -= 1;
        if tier == VRAM {
            p.nv -= 1;
            if p.nv == 0 && p.vram == p.len() {
                self.push(VRAM, parent);
            }
        } else if p.nc == 0 && p.vram < p.len() {
            self.push(DRAM, parent);
        }
    }

    fn check_events(&self, events: bool) -> Result<()> {
        if events && !self.keep_tokens && !self.token_free_events {
            return Err(CoreError::InvalidArgument("this cache keeps no tokens, so it cannot publish events".into()));
        }
        Ok(())
    }

    /// Run `ri`'s leaf candidate in `tier` (its last VRAM block, or its last block).
    fn entry(&self, tier: u8, ri: u32) -> Entry {
        let r = &self.runs[ri as usize];
        let j = if tier == VRAM { r.vram - 1 } else { r.len() - 1 };
        Entry { uses: if self.lfu { r.uses as u64 } else { 0 }, last: r.last, stamp: r.stamp + j as u64, run: ri }
    }

    fn push(&mut self, tier: u8, ri: u32) {
        let e = self.entry(tier, ri);
        self.heap_push(tier, e);
    }

    /// Run `ri` just gave up its leaf in `tier` and its next block is the new leaf: smaller
    /// than every other candidate, so it goes to the `top` slot, not through the heap.
    fn follow(&mut self, tier: u8, ri: u32) {
        let e = self.entry(tier, ri);
        if let Some(old) = self.top[tier as usize].replace(e) {
            self.heap_push(tier, old);
        }
    }

    fn heap_push(&mut self, tier: u8, e: Entry) {
        let t = tier as usize;
        self.heaps[t].push(Reverse(e));
        // Compact when stale entries could outnumber the live ones: against the live count at
        // the last compaction (leaf runs, a small share of a tier's blocks), not the tier's
        // size. Each compaction at least halves the heap: O(1) amortised.
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
        let r = &self.runs[e.run as usize];
        let len = r.len();
        if len == 0 {
            return false;
        }
        if tier == VRAM {
            r.vram > 0 && r.stamp + (r.vram - 1) as u64 == e.stamp && (r.vram < len || r.nv == 0)
        } else {
            r.vram < len && r.stamp + (len - 1) as u64 == e.stamp && r.nc == 0
        }
    }

    /// The policy's least-valued leaf of `tier`, skipping `pinned` (collected in `held` for
    /// the caller to push back).
    fn pop(&mut self, tier: u8, pinned: Pin<'_>, held: &mut Vec<Entry>) -> Result<Entry> {
        let t = tier as usize;
        loop {
            let e = match (self.top[t], self.heaps[t].peek()) {
                (Some(a), Some(Reverse(b))) if a < *b => {
                    self.top[t] = None;
                    a
                }
                (_, Some(_)) => self.heaps[t].pop().expect("peeked").0,
                (Some(a), None) => {
                    self.top[t] = None;
                    a
                }
                (None, None) => return Err(broken()),
            };
            if !self.live(tier, &e) {
                continue;
            }
            let pin = match pinned {
                Pin::Nothing => false,
                Pin::Runs(p) => p.contains(&e.run),
                Pin::StampedAfter(s) => e.stamp > s,
            };
            if pin {
                held.push(e);
                continue;
            }
            return Ok(e);
        }
    }

    /// Append the tokens of a stretch `(source, first block, blocks)` of a source-backed run.
    fn source_blocks(&self, span: Option<(u32, usize, usize)>, out: &mut Vec<u32>) {
        if let Some((s, first, n)) = span {
            let source = self.source.as_ref().expect("a source-backed run's cache has a source");
            out.extend_from_slice(&source.block_tokens(s, first, n, self.block_size));
        }
    }

    /// The parent name of block `j` of run `r`.
    fn parent_of(&self, r: &Run, j: usize) -> Option<u64> {
        if j > 0 {
            Some(r.ids[j - 1])
        } else if r.parent != NIL {
            self.runs[r.parent as usize].ids.last().copied()
        } else {
            None
        }
    }

    /// One call's changes as events: the CPU stores of demotions (in parent-to-child runs), the
    /// GPU removals, the CPU removals of evictions (a block demoted and evicted in one call
    /// shows only as removed from the GPU).
    fn net(&self, ch: &Changes) -> Vec<Event> {
        let mut out = Vec::new();
        let evicted: HashSet<u64> = ch.cpu_removed.iter().copied().collect();
        let demoted: HashSet<u64> = ch.cpu_stored.iter().map(|x| x.0).collect();
        let mut stored: Vec<(u64, u32, u32)> = ch.cpu_stored.iter().copied().filter(|x| !evicted.contains(&x.0)).collect();
        if !stored.is_empty() {
            stored.sort_by_key(|&(_, ri, j)| self.runs[ri as usize].pos + j); // stable, as Python's sort
            // Parent-to-child chains, in the order their first blocks come.
            let mut chains: Vec<Vec<(u64, u32, u32)>> = Vec::new();
            let mut tails: rustc_hash::FxHashMap<u64, usize> = Default::default();
            for x in stored {
                let r = &self.runs[x.1 as usize];
                let c = self.parent_of(r, x.2 as usize).and_then(|p| tails.remove(&p)).unwrap_or_else(|| {
                    chains.push(Vec::new());
                    chains.len() - 1
                });
                chains[c].push(x);
                tails.insert(x.0, c);
            }
            let bs = self.block_size;
            for c in chains {
                let mut tokens = Vec::with_capacity(c.len() * bs);
                // Source-backed blocks are asked for a stretch at a time: (source, first block, n).
                let mut span: Option<(u32, usize, usize)> = None;
                for &(_, ri, j) in &c {
                    let r = &self.runs[ri as usize];
                    if let Some(s) = r.src {
                        let at = (r.pos + j) as usize;
                        match &mut span {
                            Some((s0, first, n)) if *s0 == s && *first + *n == at => *n += 1,
                            _ => {
                                self.source_blocks(span.take(), &mut tokens);
                                span = Some((s, at, 1));
                            }
                        }
                    } else {
                        self.source_blocks(span.take(), &mut tokens);
                        if !r.toks.is_empty() {
                            tokens.extend_from_slice(&r.toks[j as usize * bs..(j as usize + 1) * bs]);
                        }
                    }
                }
                self.source_blocks(span, &mut tokens);
                let (_, ri, j) = c[0];
                let r = &self.runs[ri as usize];
                let parent = self.parent_of(r, j as usize);
                let salt = if parent.is_none() { r.salt } else { 0 };
                out.push(Event::Stored { medium: DRAM, hashes: c.iter().map(|x| x.0).collect(), parent, tokens, salt });
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
}

#[cfg(test)]
#[path = "block_cache_oracle.rs"]
mod oracle;

#[cfg(test)]
mod tests {
    use super::*;

    fn admit(c: &mut BlockCache, tokens: &[u32], now: f64) -> Vec<Event> {
        let chain = c.chain(tokens, 0).unwrap();
        c.place_vram(tokens, &chain, now, 0, true, true).unwrap()
    }

    struct Fixed(Vec<Vec<u32>>);
    impl TokenSource for Fixed {
        fn tokens(&self, src: u32) -> Vec<u32> {
            self.0[src as usize].clone()
        }
    }

    /// A cache that finds its prompts' tokens in a source publishes exactly the events (tokens
    /// included) of one that keeps them: demotions re-read the tokens of runs stored, split
    /// and truncated by other calls. A source-backed run whose positions were off by a block
    /// would publish another block's tokens here.
    #[test]
    fn a_token_source_publishes_the_tokens_a_kept_copy_would() {
        let mut rng = crate::sim::rng::Pcg64::seeded(7);
        let stems: Vec<Vec<u32>> = (0..4).map(|_| (0..24).map(|_| rng.next_u64() as u32).collect()).collect();
        let prompts: Vec<Vec<u32>> = (0..40)
            .map(|i| {
                let mut p = stems[i % 4][..(4 * (1 + i % 6)).min(24)].to_vec();
                p.extend((0..(4 * (i % 5))).map(|_| rng.next_u64() as u32));
                p
            })
            .filter(|p| !p.is_empty())
            .collect();
        for lfu in [false, true] {
            let mut kept = BlockCache::new(4, 6, 10, lfu, 3).unwrap();
            let mut sourced = BlockCache::new(4, 6, 10, lfu, 3).unwrap();
            sourced.set_token_source(Some(std::sync::Arc::new(Fixed(prompts.clone()))));
            let mut demoted = 0;
            for step in 0..400 {
                let i = (rng.next_u64() % prompts.len() as u64) as u32;
                let p = &prompts[i as usize];
                let chain = kept.chain(p, 0).unwrap();
                let a = kept.place_vram_len(p, p.len(), &chain, step as f64, 0, true, true).unwrap();
                sourced.set_call_source(Some(i));
                let b = sourced.place_vram_len(p, p.len(), &chain, step as f64, 0, true, true).unwrap();
                sourced.set_call_source(None);
                assert_eq!(a, b, "step {step}");
                demoted += a.iter().filter(|e| matches!(e, Event::Stored { medium: DRAM, .. })).count();
            }
            assert!(demoted > 50, "the sequence demotes ({demoted} DRAM stores)");
            assert!(sourced.memory_bytes() < kept.memory_bytes());
            // Another workload's source: the runs copy their tokens from the old one first, and
            // the two caches still publish the same events.
            sourced.set_token_source(Some(std::sync::Arc::new(Fixed(vec![vec![0; 4]; prompts.len()]))));
            for step in 400..500 {
                let p = &prompts[(rng.next_u64() % prompts.len() as u64) as usize];
                let chain = kept.chain(p, 0).unwrap();
                let a = kept.place_vram_len(p, p.len(), &chain, step as f64, 0, true, true).unwrap();
                let b = sourced.place_vram_len(p, p.len(), &chain, step as f64, 0, true, true).unwrap();
                assert_eq!(a, b, "step {step}");
            }
        }
    }

    /// Token-free events are the kept cache's events with the stored tokens left out, call for
    /// call (the same blocks demoted and evicted); the mode changes only while the cache is
    /// empty, and once off again the cache refuses to publish.
    #[test]
    fn token_free_events_are_the_events_without_their_tokens() {
        let mut rng = crate::sim::rng::Pcg64::seeded(11);
        let prompts: Vec<Vec<u32>> = (0..30).map(|i| (0..(4 * (1 + i % 6))).map(|j| if j < 8 { (i % 3) as u32 } else { rng.next_u64() as u32 }).collect()).collect();
        let mut kept = BlockCache::new(4, 6, 10, false, 3).unwrap();
        let mut free = BlockCache::new(4, 6, 10, false, 3).unwrap();
        free.set_token_free_events(true).unwrap();
        assert!(!free.keeps_tokens());
        let strip = |evs: Vec<Event>| -> Vec<Event> {
            evs.into_iter()
                .map(|e| match e {
                    Event::Stored { medium, hashes, parent, salt, .. } => Event::Stored { medium, hashes, parent, tokens: Vec::new(), salt },
                    e => e,
                })
                .collect()
        };
        let mut removed = 0;
        for step in 0..300 {
            let p = &prompts[(rng.next_u64() % prompts.len() as u64) as usize];
            let chain = kept.chain(p, 0).unwrap();
            let a = kept.place_vram_len(p, p.len(), &chain, step as f64, 0, true, true).unwrap();
            let b = free.place_vram_len(&[], p.len(), &chain, step as f64, 0, true, true).unwrap();
            removed += a.iter().filter(|e| matches!(e, Event::Removed { .. })).count();
            assert_eq!(strip(a), b, "step {step}");
        }
        assert!(removed > 20, "the sequence evicts ({removed} removals)");
        assert!(free.set_token_free_events(false).is_ok());
        let chain = free.chain(&prompts[0], 0).unwrap();
        assert!(free.place_vram_len(&[], prompts[0].len(), &chain, 1e3, 0, true, true).is_err());
        assert!(kept.set_token_free_events(true).is_err(), "a cache with blocks keeps its tokens");
    }

    #[test]
    fn admit_then_lookup_and_demotion_to_dram() {
        let mut c = BlockCache::new(2, 2, 4, false, 0).unwrap();
        let a = [1, 2, 3, 4];
        let ev = admit(&mut c, &a, 1.0);
        assert_eq!(ev.len(), 1);
        let ca = c.chain(&a, 0).unwrap();
        assert_eq!(c.lookup(&ca), (2, 0));
        // Another prompt: VRAM holds 2 blocks, so a's chain moves to DRAM, leaf first.
        let ev = admit(&mut c, &[8, 8, 9, 9], 2.0);
        assert_eq!(c.lookup(&ca), (0, 2));
        assert!(matches!(&ev[0], Event::Stored { medium: DRAM, hashes, .. } if hashes == &ca));
        assert!(matches!(&ev[1], Event::Removed { medium: VRAM, hashes } if hashes.len() == 2));
        assert_eq!(c.stats.demoted_blocks, 2);
        // a again: promoted from DRAM, which publishes a GPU store and a CPU removal.
        let ev = admit(&mut c, &a, 3.0);
        assert_eq!(c.lookup(&ca), (2, 0));
        assert!(matches!(ev.last(), Some(Event::Removed { medium: DRAM, hashes }) if hashes == &ca));
        assert_eq!(c.stats.promoted_blocks, 2);
    }

    #[test]
    fn without_dram_victims_are_dropped() {
        let mut c = BlockCache::new(1, 1, 0, false, 0).unwrap();
        admit(&mut c, &[1], 1.0);
        let ev = admit(&mut c, &[2], 2.0);
        assert_eq!(c.len(), 1);
        assert_eq!(c.stats.evicted_blocks, 1);
        assert!(matches!(&ev[0], Event::Removed { medium: VRAM, .. }));
    }

    #[test]
    fn heaps_stay_bounded() {
        let mut c = BlockCache::new(1, 8, 8, true, 0).unwrap();
        for t in 0..3000u32 {
            admit(&mut c, &[t % 11, t % 5], t as f64);
        }
        assert!(c.heap_len(VRAM) <= 2 * 8 + COMPACT_SLACK + 1 && c.heap_len(DRAM) <= 2 * 8 + COMPACT_SLACK + 1);
    }

    #[test]
    fn a_run_is_one_record_and_splits_where_a_prompt_stops() {
        let mut c = BlockCache::new(1, 64, 0, false, 0).unwrap();
        admit(&mut c, &[1, 2, 3, 4, 5, 6], 1.0);
        assert_eq!(c.runs.iter().filter(|r| !r.ids.is_empty()).count(), 1);
        admit(&mut c, &[1, 2, 3], 2.0); // touches half the run: it splits there
        assert_eq!(c.runs.iter().filter(|r| !r.ids.is_empty()).count(), 2);
        admit(&mut c, &[1, 2, 3, 9], 3.0); // a branch under the head
        assert_eq!(c.runs.iter().filter(|r| !r.ids.is_empty()).count(), 3);
        assert_eq!(c.len(), 7);
        let b = c.blocks();
        assert_eq!(b.iter().map(|x| x.position).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5, 3]);
        assert_eq!(b[3].parent, Some(b[2].hash));
        assert_eq!(b[6].parent, Some(b[2].hash));
        assert_eq!((b[0].uses, b[3].uses), (3, 1));
    }

    // The radix-of-runs cache against the brute-force oracle (`block_cache_oracle.rs`, the
    // policy by scanning every block; the block-per-record table it replaced agreed with both):
    // the same calls give the same events, statistics, lookups and block listings, for LRU and
    // LFU, with and without DRAM, across splits, promotions, demotions, evictions and truncation.
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Admit(u8, u8, bool),
        Dram(u8, u8),
        Cap(u8),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => (0u8..12, 1u8..14, any::<bool>()).prop_map(|(p, l, r)| Op::Admit(p, l, r)),
            3 => (0u8..12, 1u8..14).prop_map(|(p, l)| Op::Dram(p, l)),
            2 => (1u8..12).prop_map(Op::Cap),
            1 => Just(Op::Clear),
        ]
    }

    /// Prompt `p` of `l` blocks: prompts share prefixes (p / 4 picks one of three stems, p % 4
    /// where they fork), so chains branch, nest and end mid-run.
    fn prompt(p: u8, l: u8, bs: usize) -> Vec<u32> {
        let stem = (p / 4) as u32;
        let fork = 2 + (p % 4) as usize;
        (0..l as usize * bs).map(|i| if i / bs < fork { stem * 1000 + (i / bs) as u32 } else { p as u32 * 100_000 + i as u32 }).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn same_as_the_block_model(ops in proptest::collection::vec(op(), 1..120), vram in 1usize..12, dram in 0usize..16, lfu in any::<bool>(), seed in 0u64..3, bs in 1usize..3) {
            let mut a = BlockCache::new(bs, vram, dram, lfu, seed).unwrap();
            let mut b = oracle::Oracle::new(bs, vram, dram, lfu);
            for (t, o) in ops.iter().enumerate() {
                let now = (t / 3) as f64; // ties in `last` happen
                match *o {
                    Op::Admit(p, l, req) => {
                        let tok = prompt(p, l, bs);
                        let ch = a.chain(&tok, 0).unwrap();
                        let ea = a.place_vram(&tok, &ch, now, p as u32, req, true).unwrap();
                        let eb = b.place_vram(&tok, &ch, now, p as u32, req);
                        prop_assert_eq!(ea, eb, "admit {:?} at {}", o, t);
                    }
                    Op::Dram(p, l) => {
                        let tok = prompt(p, l, bs);
                        let ch = a.chain(&tok, 0).unwrap();
                        let ea = a.place_dram(&tok, &ch, now, p as u32, true).unwrap();
                        let eb = b.place_dram(&tok, &ch, now, p as u32);
                        prop_assert_eq!(ea, eb, "dram {:?} at {}", o, t);
                    }
                    Op::Cap(c) => {
                        let ea = a.set_vram_capacity(c as usize, true).unwrap();
                        let eb = b.set_vram_capacity(c as usize);
                        prop_assert_eq!(ea, eb, "cap {:?} at {}", o, t);
                    }
                    Op::Clear => {
                        a.clear();
                        b.clear();
                    }
                }
                prop_assert_eq!(a.stats, b.stats);
                prop_assert_eq!((a.len(), a.used(VRAM), a.used(DRAM)), (b.len(), b.used(VRAM), b.used(DRAM)));
                for p in 0..12u8 {
                    let ch = a.chain(&prompt(p, 13, bs), 0).unwrap();
                    prop_assert_eq!(a.lookup(&ch), b.lookup(&ch));
                }
            }
            prop_assert_eq!(a.blocks(), b.blocks());
            for x in b.blocks() {
                prop_assert_eq!(a.tier_of(x.hash), x.tier);
            }
        }
    }
}
