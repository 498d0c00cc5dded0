//! One worker's KV pool: the VRAM its running sequences and its prefix cache share, as an
//! engine's block pool is shared (vLLM admits a request only when its blocks can be allocated,
//! and evicts cached blocks no sequence uses to make room).
//!
//! A sequence holds its prompt's full blocks, named by their chain hashes, and a reservation
//! for the rest of its context (its last partial block and, where it decodes, its answer). A
//! block that several sequences hold is counted once; the cache keeps the pool less the
//! reservations ([`KvPool::cache_blocks`]).
//!
//! **Why counting is lazy.** The exact union only matters when the pool might be full: while
//! the sum of every held sequence's blocks (an upper bound of the union) leaves room, any
//! prompt that fits under that bound fits. So the exact count is built from the held chains
//! the first time the bound passes the pool, kept while it stays above three quarters of it,
//! and dropped below: the decisions are those of the exact count, always.
//!
//! **Why a trie of runs.** The bound counts a prefix shared by many sequences once per
//! sequence, so it passes the pool long before the union does (paper-64x8 with Mixed: the
//! exact count was on for most of a run that never waited for room), and a count per held
//! block cost two table writes for every block of every prompt: a third of the engine's own
//! time for SGLang's router (its simulated req/s 1.45x lower than before the pool, measured
//! side by side). Block ids are chained hashes, so a block id names its whole prefix: the held
//! chains form a tree, and a tree of runs (a node per stretch of blocks no two held chains
//! part in) holds the same count with a handful of nodes a chain, each found by one map
//! lookup and a binary search (two chains that agree at a position agree before it).

use rustc_hash::FxHashMap;

use crate::block_cache::{BlockCache, Event, VRAM};
use crate::error::{CoreError, Result};
use crate::slots::put;

/// The parent of the trie's top runs.
const ROOT: u32 = u32::MAX;

/// One stretch of blocks of the held chains' tree, and how many held chains pass through it.
#[derive(Debug, Default)]
struct Run {
    blocks: Vec<u64>,
    count: u32,
}

/// The distinct blocks of the held chains, as a tree of runs.
#[derive(Debug, Default)]
struct RunTrie {
    runs: Vec<Run>,
    free: Vec<u32>,
    /// (parent run or ROOT, first block of a child run) -> the child.
    edges: FxHashMap<(u32, u64), u32>,
    /// Distinct blocks held: the live runs' lengths.
    blocks: u64,
}

/// How many leading blocks `run` and `chain` share, given that their first blocks agree
/// (chained ids: agreeing at a position means agreeing at every earlier one).
fn common(run: &[u64], chain: &[u64]) -> usize {
    let (mut lo, mut hi) = (1, run.len().min(chain.len()));
    while lo < hi {
        let mid = (lo + hi + 1) / 2;
        if run[mid - 1] == chain[mid - 1] {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

impl RunTrie {
    /// How many leading blocks of `chain` some held chain holds.
    fn held_prefix(&self, chain: &[u64]) -> usize {
        let (mut at, mut pos) = (ROOT, 0);
        while pos < chain.len() {
            let Some(&n) = self.edges.get(&(at, chain[pos])) else { break };
            let run = &self.runs[n as usize].blocks;
            let m = common(run, &chain[pos..]);
            pos += m;
            if m < run.len() {
                break;
            }
            at = n;
        }
        pos
    }

    fn alloc(&mut self, run: Run) -> u32 {
        put(&mut self.runs, &mut self.free, run)
    }

    /// Split run `n` after its first `m` blocks: a new run takes the head (and `n`'s place
    /// under its parent), `n` keeps the rest under it (so `n`'s children stay where they are).
    /// Returns the head.
    fn split(&mut self, parent: u32, n: u32, m: usize) -> u32 {
        let r = &mut self.runs[n as usize];
        let head: Vec<u64> = r.blocks.drain(..m).collect();
        let (count, rest) = (r.count, r.blocks[0]);
        let first = head[0];
        let h = self.alloc(Run { blocks: head, count });
        self.edges.insert((parent, first), h);
        self.edges.insert((h, rest), n);
        h
    }

    /// Hold one more chain.
    fn add(&mut self, chain: &[u64]) {
        let (mut at, mut pos) = (ROOT, 0);
        while pos < chain.len() {
            let Some(&n) = self.edges.get(&(at, chain[pos])) else {
                let n = self.alloc(Run { blocks: chain[pos..].to_vec(), count: 1 });
                self.edges.insert((at, chain[pos]), n);
                self.blocks += (chain.len() - pos) as u64;
                return;
            };
            let len = self.runs[n as usize].blocks.len();
            let m = common(&self.runs[n as usize].blocks, &chain[pos..]);
            let n = if m < len { self.split(at, n, m) } else { n };
            self.runs[n as usize].count += 1;
            pos += m;
            at = n;
        }
    }

    /// Let go of a held chain (its runs are whole: runs split wherever a held chain ends or
    /// parts). A run no chain passes any more is dropped; so are the runs under it, which the
    /// same walk reaches, since no other chain passes them either.
    fn remove(&mut self, chain: &[u64]) -> Result<()> {
        let lost = || CoreError::InvalidArgument("KV pool: a held chain is not in the count".into());
        let (mut at, mut pos) = (ROOT, 0);
        while pos < chain.len() {
            let n = *self.edges.get(&(at, chain[pos])).ok_or_else(lost)?;
            let r = &mut self.runs[n as usize];
            let len = r.blocks.len();
            if r.count == 0 || chain.len() - pos < len || r.blocks[len - 1] != chain[pos + len - 1] {
                return Err(lost());
            }
            r.count -= 1;
            if r.count == 0 {
                self.blocks -= len as u64;
                self.edges.remove(&(at, chain[pos]));
                r.blocks = Vec::new();
                self.free.push(n);
            }
            pos += len;
            at = n;
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
pub struct KvPool {
    pool: u64,
    /// Held sequences by handle: their chains and reservations (None: a free handle).
    seqs: Vec<Option<(Vec<u64>, u64)>>,
    free: Vec<u32>,
    live: usize,
    /// Every held chain's blocks plus every reservation: at least what is held.
    bound: u64,
    reserved: u64,
    /// The held chains' distinct blocks, while `exact`.
    exact: bool,
    trie: RunTrie,
}

impl KvPool {
    /// A pool of `blocks` blocks.
    pub fn new(blocks: u64) -> Self {
        KvPool { pool: blocks, ..KvPool::default() }
    }

    /// Blocks a sequence reserves beyond its prompt's full blocks: the prompt's last partial
    /// block and the KV of `sequences` answers of `answer` tokens each, every token but an
    /// answer's last (no step computes its KV). The simulator's engine and the emulated
    /// workers both reserve by this.
    pub fn extra_blocks(prompt_len: u64, answer: u64, sequences: u64, block_size: u64) -> u64 {
        (prompt_len % block_size + sequences * answer.saturating_sub(1)).div_ceil(block_size)
    }

    /// Blocks reserved beyond the held prompts' full blocks.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// What the prefix cache keeps: the pool less the reservations, at least one block.
    pub fn cache_blocks(&self) -> usize {
        self.pool.saturating_sub(self.reserved).max(1) as usize
    }

    /// Sequences held now.
    pub fn held(&self) -> usize {
        self.live
    }

    /// Whether a sequence of `blocks` full prompt blocks and `extra` reserved ones certainly
    /// fits (nothing is held, or it fits even if none of its blocks were shared); `None`: ask
    /// [`Self::fits`] with its chain.
    pub fn surely_fits(&self, blocks: u64, extra: u64) -> Option<bool> {
        (self.live == 0 || self.bound + blocks + extra <= self.pool).then_some(true)
    }

    /// Whether a sequence of chain `chain` and `extra` reserved blocks fits beside the held
    /// ones, its blocks that they hold already counted once; true when nothing is held (a
    /// sequence larger than the pool runs alone).
    pub fn fits(&mut self, chain: &[u64], extra: u64) -> bool {
        if self.surely_fits(chain.len() as u64, extra).is_some() {
            return true;
        }
        self.count_exactly();
        let fresh = (chain.len() - self.trie.held_prefix(chain)) as u64;
        self.trie.blocks + self.reserved + fresh + extra <= self.pool
    }

    /// Hold `chain` and reserve `extra` blocks; the handle [`Self::release`] takes.
    pub fn hold(&mut self, chain: Vec<u64>, extra: u64) -> u32 {
        self.bound += chain.len() as u64 + extra;
        self.reserved += extra;
        self.live += 1;
        if self.exact {
            self.trie.add(&chain);
        }
        let h = put(&mut self.seqs, &mut self.free, Some((chain, extra)));
        if !self.exact && self.bound > self.pool {
            self.count_exactly();
        }
        h
    }

    /// Let go of the sequence `h` holds.
    pub fn release(&mut self, h: u32) -> Result<()> {
        let Some((chain, extra)) = self.seqs.get_mut(h as usize).and_then(Option::take) else {
            return Err(CoreError::InvalidArgument(format!("KV pool: handle {h} holds nothing")));
        };
        self.bound -= chain.len() as u64 + extra;
        self.reserved -= extra;
        self.live -= 1;
        self.free.push(h);
        if self.exact {
            self.trie.remove(&chain)?;
            if self.bound * 4 <= self.pool * 3 {
                self.exact = false;
                self.trie = RunTrie::default();
            }
        }
        Ok(())
    }

    /// Let go of `h` and give `cache` its room back at once. Only grows the cache: a
    /// reservation made since the last prefill landed takes its room when its own prefill
    /// lands ([`Self::fit_cache`]), with that prompt's events. The simulator's engine and the
    /// emulated workers both release by this.
    pub fn release_into(&mut self, h: u32, cache: &mut BlockCache, events: bool) -> Result<()> {
        self.release(h)?;
        let cap = self.cache_blocks();
        if cap > cache.capacity(VRAM) {
            let none = cache.set_vram_capacity(cap, events)?;
            debug_assert!(none.is_empty(), "growing demotes nothing");
        }
        Ok(())
    }

    /// `cache` keeps what the reservations leave of the pool (at least one block); what no
    /// longer fits is demoted (the events returned). Called as a prefill lands, so a hold's
    /// reservation takes its room then, in one batch of events with the prompt's own blocks:
    /// an engine evicts cached blocks only as it allocates (the prompt's during its prefill,
    /// the answer's as it decodes), so not before.
    pub fn fit_cache(&self, cache: &mut BlockCache, events: bool) -> Result<Vec<Event>> {
        let cap = self.cache_blocks();
        if cap == cache.capacity(VRAM) {
            return Ok(Vec::new());
        }
        cache.set_vram_capacity(cap, events)
    }

    /// Build the exact count from the held chains (once; kept while `exact`).
    fn count_exactly(&mut self) {
        if self.exact {
            return;
        }
        self.exact = true;
        for (chain, _) in self.seqs.iter().flatten() {
            self.trie.add(chain);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The exact count, recomputed from scratch: the distinct blocks of the held chains plus
    /// the reservations.
    fn used(held: &[(Vec<u64>, u64)]) -> u64 {
        let mut set = std::collections::HashSet::new();
        let mut extra = 0;
        for (c, e) in held {
            set.extend(c.iter().copied());
            extra += e;
        }
        set.len() as u64 + extra
    }

    #[test]
    fn shared_blocks_count_once_and_a_large_sequence_runs_alone() {
        let mut p = KvPool::new(10);
        assert!(p.fits(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 5)); // nothing held
        let a = p.hold(vec![1, 2, 3, 4], 2);
        assert!(p.fits(&[1, 2, 3, 4], 4)); // 4 + 2 + 0 new + 4 = 10
        assert!(!p.fits(&[1, 2, 3, 9], 4)); // one new block: 11
        let b = p.hold(vec![1, 2, 3, 4], 4);
        assert_eq!((p.reserved(), p.cache_blocks()), (6, 4));
        p.release(a).unwrap();
        assert!(p.release(a).is_err());
        p.release(b).unwrap();
        assert_eq!((p.held(), p.reserved(), p.cache_blocks()), (0, 0, 10));
    }

    #[test]
    fn the_cache_shrinks_as_a_prefill_lands_and_grows_back_at_a_release() {
        let mut c = BlockCache::new(1, 8, 8, false, 0).unwrap();
        let toks = [1u32, 2, 3, 4, 5, 6];
        let chain = c.chain(&toks, 0).unwrap();
        c.place_vram(&toks, &chain, 1.0, 0, true, true).unwrap();
        let mut p = KvPool::new(8);
        assert!(p.fit_cache(&mut c, true).unwrap().is_empty()); // nothing reserved: 8 blocks
        let a = p.hold(vec![100], 4);
        // A reservation takes its room only as its prefill lands: two cached blocks demoted.
        assert_eq!(c.capacity(VRAM), 8);
        let ev = p.fit_cache(&mut c, true).unwrap();
        assert_eq!((c.capacity(VRAM), c.lookup(&chain)), (4, (4, 2)));
        assert!(!ev.is_empty());
        // A later hold does not shrink the cache when another sequence is released.
        let b = p.hold(vec![200], 2);
        p.release_into(a, &mut c, true).unwrap();
        assert_eq!((c.capacity(VRAM), c.lookup(&chain)), (6, (4, 2)));
        p.release_into(b, &mut c, true).unwrap();
        assert_eq!(c.capacity(VRAM), 8);
        assert!(p.release_into(b, &mut c, true).is_err());
    }

    /// A chained id: a block's id names its whole prefix, as the engine's chain hashes do.
    fn chain_of(branches: &[u8]) -> Vec<u64> {
        let mut id = 0x9E37_79B9_7F4A_7C15u64;
        branches
            .iter()
            .map(|&b| {
                id = (id ^ u64::from(b)).wrapping_mul(0xBF58_476D_1CE4_E5B9).rotate_left(31);
                id
            })
            .collect()
    }

    proptest! {
        /// The trie of runs counts the held chains' distinct blocks and finds a chain's held
        /// prefix exactly, whatever chains (sharing prefixes of any length, ending inside
        /// others' runs, held twice) come and go.
        #[test]
        fn the_run_trie_is_the_distinct_count(ops in proptest::collection::vec((any::<bool>(), proptest::collection::vec(0u8..3, 0..12), any::<u8>()), 1..120)) {
            let mut t = RunTrie::default();
            let mut held: Vec<Vec<u64>> = Vec::new();
            for (add, branches, pick) in ops {
                if !add && !held.is_empty() {
                    let c = held.remove(pick as usize % held.len());
                    t.remove(&c).unwrap();
                } else {
                    let c = chain_of(&branches);
                    t.add(&c);
                    held.push(c);
                }
                let distinct: std::collections::HashSet<u64> = held.iter().flatten().copied().collect();
                prop_assert_eq!(t.blocks, distinct.len() as u64);
                // Every live run has one edge in and the live runs' lengths are the count.
                prop_assert_eq!(t.edges.len(), t.runs.len() - t.free.len());
                prop_assert_eq!(t.edges.values().map(|&n| t.runs[n as usize].blocks.len() as u64).sum::<u64>(), t.blocks);
                let probe = chain_of(&branches);
                let want = probe.iter().take_while(|b| distinct.contains(b)).count();
                prop_assert_eq!(t.held_prefix(&probe), want);
            }
            for c in held {
                t.remove(&c).unwrap();
            }
            prop_assert_eq!((t.blocks, t.edges.len()), (0, 0));
            prop_assert!(t.remove(&chain_of(&[1, 2])).is_err());
        }

        /// Whatever the order of holds and releases, `fits` answers as the exact count does.
        #[test]
        fn fits_is_the_exact_count(ops in proptest::collection::vec((0u8..3, 0u64..6, 1usize..6, 0u64..4), 1..80), pool in 4u64..30) {
            let mut p = KvPool::new(pool);
            let mut held: Vec<(u32, Vec<u64>, u64)> = Vec::new();
            for (op, stem, len, extra) in ops {
                // Chains share prefixes: stem picks one of six, len how far it goes.
                let chain: Vec<u64> = (0..len as u64).map(|i| if i < 2 { stem % 3 * 100 + i } else { stem * 1000 + i }).collect();
                if op == 2 && !held.is_empty() {
                    let (h, _, _) = held.remove(stem as usize % held.len());
                    p.release(h).unwrap();
                    continue;
                }
                let now: Vec<(Vec<u64>, u64)> = held.iter().map(|(_, c, e)| (c.clone(), *e)).collect();
                let mut with = now.clone();
                with.push((chain.clone(), extra));
                let want = now.is_empty() || used(&with) <= pool;
                prop_assert_eq!(p.fits(&chain, extra), want);
                if op == 0 || want {
                    let h = p.hold(chain.clone(), extra);
                    held.push((h, chain, extra));
                }
            }
        }
    }
}
