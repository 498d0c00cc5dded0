//! The baselines the simulator compares KVCompass with, run inside the engine (they exist only
//! in the simulator; `kvcompass/sim/schemes.py` documents what each models and simplifies, and
//! builds the static parts: rings, finger tables, pools). Every choice is the one the Python
//! implementation made before them, draw for draw (the pinned runs check it): the keys that
//! place a prompt on a ring are the same 64-bit values (`_prefix_hashes`, `_h64` as BLAKE2b-64
//! of the Python `repr` of its arguments), ties are drawn from the run's PCG64 stream in the
//! same order, and routing histories evict in the same LRU order. Where a key only has to
//! name a prefix (routing histories), the engine's block chain of the prompt serves.

use crate::block_table::BlockTable;
use std::collections::VecDeque;

use super::super::lru_order::LruOrder;

use blake2::digest::{Update, VariableOutput};
use blake2::Blake2bVar;

use super::{origin_add, origin_share, origin_total, Choice, Engine};
use crate::error::{CoreError, Result};

const GOLD: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's finaliser (`schemes._mix`; no golden-ratio increment).
#[inline]
fn fin(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// BLAKE2b with an 8-byte digest of `s`, little-endian (`schemes._h64` of the object whose
/// `repr` is `s`).
fn h64(s: &str) -> u64 {
    let mut h = Blake2bVar::new(8).expect("8 is a valid BLAKE2b digest size");
    h.update(s.as_bytes());
    let mut out = [0u8; 8];
    h.finalize_variable(&mut out).expect("8-byte buffer");
    u64::from_le_bytes(out)
}

/// Python's `repr(bytes)`.
fn bytes_repr(b: &[u8]) -> String {
    let quote = if b.contains(&b'\'') && !b.contains(&b'"') { '"' } else { '\'' };
    let mut s = String::with_capacity(b.len() * 4 + 3);
    s.push('b');
    s.push(quote);
    for &c in b {
        match c {
            b'\\' => s.push_str("\\\\"),
            b'\t' => s.push_str("\\t"),
            b'\n' => s.push_str("\\n"),
            b'\r' => s.push_str("\\r"),
            c if c as char == quote => {
                s.push('\\');
                s.push(quote);
            }
            0x20..=0x7e => s.push(c as char),
            c => s.push_str(&format!("\\x{c:02x}")),
        }
    }
    s.push(quote);
    s
}

/// What content-keyed baselines need of the run's salts: `_h64("salt", salt)` and `repr(salt)`
/// per salt number (0: none).
#[derive(Clone, Debug, Default)]
pub struct Salts {
    pub h64: Vec<u64>,
    pub repr: Vec<String>,
}

/// The weights of a block's tokens in its term of a prefix's sum ([`prefix_sum`]).
pub(super) fn prefix_coef(block: usize) -> Vec<u64> {
    (1..=block as u64).map(|j| fin(j.wrapping_mul(GOLD))).collect()
}

/// Block `i`'s term (tokens `row`) of [`prefix_sum`]; terms add (wrapping), so a prefix's
/// sum is the sum of its blocks' terms and a driver may keep partial sums of shared runs.
#[inline]
pub(super) fn prefix_term(row: &[u32], i: u64, coef: &[u64]) -> u64 {
    let mut s = 0u64;
    for (t, c) in row.iter().zip(coef) {
        s = s.wrapping_add((*t as u64).wrapping_mul(*c));
    }
    fin(s.wrapping_add(i.wrapping_mul(GOLD)))
}

/// `schemes._prefix_hashes`' last value, the 64-bit hash of a prompt's whole-block prefix, from
/// the sum of its blocks' terms ([`prefix_sum`]). The baselines place a prompt by its level's key
/// only, so the per-block values in between are never needed.
fn prefix_finish(acc: u64, salt: Option<u64>) -> u64 {
    let v = fin(acc);
    match salt {
        Some(x) => fin(v ^ x),
        None => v,
    }
}

/// The sum of the terms of the whole blocks of `tokens` (None: no whole block); see
/// [`prefix_finish`].
pub(super) fn prefix_sum(tokens: &[u32], block: usize) -> Option<u64> {
    let n = tokens.len() / block;
    if n == 0 {
        return None;
    }
    let coef = prefix_coef(block);
    Some(tokens[..n * block].chunks_exact(block).enumerate().fold(0u64, |acc, (i, row)| acc.wrapping_add(prefix_term(row, i as u64, &coef))))
}

/// `schemes._level_key`: `(level index, key)` of the longest level that fits a prompt of `len`
/// tokens. `sum(n)` is [`prefix_sum`] of the prompt's first `n` tokens and `tokens()` the whole
/// prompt (read only for a prompt shorter than a block), so a driver need not expand a prompt
/// to key it.
fn level_key(levels: &[u64], len: u64, sum: impl FnOnce(usize) -> Option<u64>, tokens: impl FnOnce() -> Vec<u32>, salts: &Salts, salt: u32) -> (usize, u64) {
    let level = levels.iter().rposition(|&c| c <= len).unwrap_or(0);
    let n = if levels.is_empty() { len as usize } else { len.min(levels[level]) as usize };
    let salt_h = if salt == 0 { None } else { Some(salts.h64[salt as usize]) };
    let key = match sum(n) {
        Some(acc) => prefix_finish(acc, salt_h),
        None => {
            let bytes: Vec<u8> = tokens().iter().flat_map(|t| t.to_le_bytes()).collect();
            let salt_repr = if salt == 0 { "None" } else { salts.repr[salt as usize].as_str() };
            h64(&format!("('short', {salt_repr}, {})", bytes_repr(&bytes)))
        }
    };
    (level, h64(&format!("({level}, {key})")))
}

/// A region balancer's routing history (`schemes._History`): prefix -> workers it was sent to,
/// at most `capacity` prefixes, least recently inserted-or-touched evicted first.
///
/// Every routed prompt touches each of its few hundred block prefixes here, in tables far
/// larger than the CPU caches, so the map is a [`BlockTable`] whose slots are prefetched a few
/// blocks ahead of the walk, and a prefix's first [`HOLDERS_INLINE`] holders live in its slot
/// (one allocation per prefix was most of an insert's time); more move to a side list.
#[derive(Clone, Debug)]
pub struct History {
    map: BlockTable<HEntry>,
    /// Holder lists of prefixes with more than [`HOLDERS_INLINE`] holders, and the free ones.
    spills: Vec<Vec<u32>>,
    free: Vec<u32>,
    /// The recency order, built from the records' stamps when the history first overflows;
    /// until then a touch only stamps its record (`clock`), with nothing queued.
    order: Option<LruOrder>,
    clock: u64,
    capacity: usize,
}

const HOLDERS_INLINE: usize = 3;
/// `HEntry::n` of a prefix whose holders are in `History::spills`.
const SPILLED: u8 = u8::MAX;
/// How many blocks (or key operations) ahead a walk over a table larger than the caches
/// requests its slots, for every per-block structure of the baselines.
const AHEAD: usize = 8;

/// A prefix's record: 16 bytes, so a slot with its key is 24 (it was 40: a table of a million
/// prefixes is tens of megabytes, zeroed, rehashed and missed in proportion to its bytes).
#[derive(Clone, Copy, Debug, Default)]
struct HEntry {
    /// When it was last inserted or touched (its stamp in the history's order).
    clock: u64,
    /// The first holders in routing order (worker indices below `u16::MAX`; a larger one goes
    /// to the spill list), or, when spilled, the spill list's index in the first two.
    slots: [u16; HOLDERS_INLINE],
    /// Holders in `slots`, or [`SPILLED`].
    n: u8,
}

const _: () = assert!(std::mem::size_of::<HEntry>() == 16);

impl HEntry {
    fn spill(&self) -> usize {
        self.slots[0] as usize | (self.slots[1] as usize) << 16
    }

    fn set_spill(&mut self, j: u32) {
        self.slots = [j as u16, (j >> 16) as u16, 0];
        self.n = SPILLED;
    }
}

/// A prefix's holders as [`History`] hands them out: the inline ones copied out, or its spill
/// list; [`Holders::as_slice`] reads either in routing order.
#[derive(Clone, Copy, Debug)]
enum Holders<'a> {
    Inline([u32; HOLDERS_INLINE], u8),
    Spilled(&'a [u32]),
}

impl Holders<'_> {
    const NONE: Holders<'static> = Holders::Inline([0; HOLDERS_INLINE], 0);

    fn as_slice(&self) -> &[u32] {
        match self {
            Holders::Inline(a, n) => &a[..*n as usize],
            Holders::Spilled(s) => s,
        }
    }
}

impl History {
    pub fn new(capacity: usize) -> Self {
        History { map: BlockTable::new(), spills: Vec::new(), free: Vec::new(), order: None, clock: 0, capacity }
    }

    fn holders(&self, e: &HEntry) -> Holders<'_> {
        if e.n == SPILLED {
            Holders::Spilled(&self.spills[e.spill()])
        } else {
            let mut a = [0u32; HOLDERS_INLINE];
            a.iter_mut().zip(&e.slots[..e.n as usize]).for_each(|(x, &s)| *x = s as u32);
            Holders::Inline(a, e.n)
        }
    }

    /// `(blocks, holders)` of the longest routed prefix, walked from the root.
    fn matched(&self, hashes: &[u64]) -> (usize, Holders<'_>) {
        let mut best = Holders::NONE;
        let mut n = 0;
        for (i, h) in hashes.iter().enumerate() {
            if let Some(&a) = hashes.get(i + AHEAD) {
                self.map.prefetch(a);
            }
            match self.map.get(h) {
                Some(e) if e.n != 0 => {
                    best = self.holders(e);
                    n += 1;
                }
                _ => break,
            }
        }
        (n, best)
    }

    /// The holders of the routed prefix `h` (none if it is not in the history).
    fn holders_at(&self, h: &u64) -> Holders<'_> {
        self.map.get(h).map_or(Holders::NONE, |e| self.holders(e))
    }

    fn insert(&mut self, hashes: &[u64], worker: u32) {
        for &h in hashes.iter().take(AHEAD) {
            self.map.prefetch(h);
        }
        for (i, &h) in hashes.iter().enumerate() {
            if let Some(&a) = hashes.get(i + AHEAD) {
                self.map.prefetch(a);
            }
            let e = self.map.entry_or_default(h);
            if e.n == SPILLED {
                let list = &mut self.spills[e.spill()];
                if !list.contains(&worker) {
                    list.push(worker);
                }
            } else if !e.slots[..e.n as usize].iter().any(|&s| s as u32 == worker) {
                if (e.n as usize) < HOLDERS_INLINE && worker < u16::MAX as u32 {
                    e.slots[e.n as usize] = worker as u16;
                    e.n += 1;
                } else {
                    let mut list: Vec<u32> = e.slots[..e.n as usize].iter().map(|&s| s as u32).collect();
                    list.push(worker);
                    let j = crate::slots::put(&mut self.spills, &mut self.free, list);
                    e.set_spill(j);
                }
            }
            e.clock = match self.order.as_mut() {
                Some(order) => {
                    order.retire(e.clock);
                    order.push(h)
                }
                None => {
                    self.clock += 1;
                    self.clock
                }
            };
        }
        if self.map.len() > self.capacity && self.order.is_none() {
            self.order = Some(LruOrder::from_stamps(self.clock, self.map.iter().map(|(h, e)| (h, e.clock)).collect()));
        }
        while self.map.len() > self.capacity {
            let order = self.order.as_mut().expect("built above");
            let (h, _) = order.pop_oldest().expect("every entry is in the order");
            let e = self.map.remove(&h).expect("the order's live entries are the map's");
            if e.n == SPILLED {
                self.spills[e.spill()] = Vec::new();
                self.free.push(e.spill() as u32);
            }
        }
    }
}

/// Python's float floor division `a // b` (not `(a / b).floor()`, which differs when the
/// quotient rounds up to an integer).
pub(crate) fn py_floordiv(a: f64, b: f64) -> f64 {
    let m = a % b;
    let mut div = (a - m) / b;
    if m != 0.0 && ((b < 0.0) != (m < 0.0)) {
        div -= 1.0;
    }
    if div != 0.0 {
        let mut f = div.floor();
        if div - f > 0.5 {
            f += 1.0;
        }
        f
    } else {
        0.0f64.copysign(a / b)
    }
}

const fn mod_inverse(c: u64) -> u64 {
    let mut inv = c; // Newton's iteration doubles the correct low bits each step
    let mut i = 0;
    while i < 6 {
        inv = inv.wrapping_mul(2u64.wrapping_sub(c.wrapping_mul(inv)));
        i += 1;
    }
    inv
}

/// The inverse of [`crate::token_ids::mix64`] (a bijection): the seed-free chain value a
/// cache's block name stands for.
fn unmix64(mut y: u64) -> u64 {
    const C1: u64 = 0xBF58_476D_1CE4_E5B9;
    const C2: u64 = 0x94D0_49BB_1331_11EB;
    y ^= (y >> 31) ^ (y >> 62);
    y = y.wrapping_mul(mod_inverse(C2));
    y ^= (y >> 27) ^ (y >> 54);
    y = y.wrapping_mul(mod_inverse(C1));
    y ^= (y >> 30) ^ (y >> 60);
    y.wrapping_sub(GOLD)
}

/// A router's feed of the workers' KV events (`_KVTracker.apply`): each worker's blocks as its
/// events say, and the events turned into key operations `(key, medium or 0)`. A block is keyed
/// by the seed-free chain value its name stands for (worker-independent: equal keys exactly for
/// equal token prefixes and salt). Dynamo's routers and the Central Directory's coordinator
/// both read the fleet through one of these.
#[derive(Clone, Debug)]
pub struct KvFeed {
    seeds: Vec<u64>,
    tracker: Vec<BlockTable<u8>>,
}

impl KvFeed {
    /// `seeds`: every worker's cache name seed.
    pub fn new(seeds: Vec<u64>) -> Self {
        let n = seeds.len();
        KvFeed { seeds, tracker: (0..n).map(|_| BlockTable::new()).collect() }
    }

    fn key(&self, w: usize, name: u64) -> u64 {
        if self.seeds[w] != 0 {
            unmix64(name) ^ self.seeds[w]
        } else {
            name
        }
    }

    /// The name worker `w`'s cache gives the block `key` stands for ([`KvFeed::key`] undone).
    #[inline]
    fn name(&self, w: usize, key: u64) -> u64 {
        if self.seeds[w] != 0 {
            crate::token_ids::mix64(key ^ self.seeds[w])
        } else {
            key
        }
    }

    /// Leading blocks of `keys` (seed-free) that worker `w` holds as its events say, now: the
    /// feed's own record of the worker, read under the worker's names, is the exact view.
    fn overlap(&self, w: usize, keys: &[u64]) -> usize {
        let t = &self.tracker[w];
        leading(keys, |&k| t.contains_key(&self.name(w, k)))
    }

    /// Request the slot [`KvFeed::overlap`] reads first for `key`.
    #[inline]
    fn prefetch(&self, w: usize, key: u64) {
        self.tracker[w].prefetch(self.name(w, key));
    }

    /// Worker `w`'s events as key operations; a run whose parent left already is skipped
    /// (nothing reusable from the root), a removal counts only for the medium it names.
    pub fn ops(&mut self, w: u32, events: &[crate::block_cache::Event]) -> Vec<(u64, u8)> {
        use crate::block_cache::Event;
        let w = w as usize;
        let mut ops: Vec<(u64, u8)> = Vec::new();
        for e in events {
            match e {
                Event::Stored { medium, hashes, parent, .. } => {
                    if let Some(p) = parent {
                        if !self.tracker[w].contains_key(p) {
                            continue;
                        }
                    }
                    for (i, &h) in hashes.iter().enumerate() {
                        if let Some(&a) = hashes.get(i + AHEAD) {
                            self.tracker[w].prefetch(a);
                        }
                        self.tracker[w].insert(h, *medium);
                        ops.push((self.key(w, h), *medium));
                    }
                }
                Event::Removed { medium, hashes } => {
                    for &h in hashes {
                        if self.tracker[w].get(&h) == Some(medium) {
                            self.tracker[w].remove(&h);
                            ops.push((self.key(w, h), 0));
                        }
                    }
                }
            }
        }
        ops
    }
}

/// How many leading `keys` satisfy `held`, for a `held` that holds for a leading run of them and
/// then never again: a binary search, ~log2(n) probes instead of a walk of the prefix.
///
/// Every view a baseline keeps is such a set: it is a worker's cache (or a union of caches) as
/// of whole cache calls (a call's events are applied together), and a cache is prefix-closed
/// (a cached block's parent is cached, a VRAM block's parent is in VRAM) while a key stands for
/// its whole prefix. Walking every worker's view block by block was most of Dynamo's run.
fn leading(keys: &[u64], held: impl Fn(&u64) -> bool) -> usize {
    // Galloping from the front: most views hold none or a short head of a prompt (another
    // tenant's, another catalogue's), which this settles in one or a few probes where a plain
    // binary search always pays log2(n); a long overlap costs about twice log2 of its length.
    let mut lo = 0usize; // keys[..lo] are known held
    let mut step = 1usize;
    let mut hi = keys.len();
    while lo < hi {
        let probe = (lo + step - 1).min(hi - 1);
        if held(&keys[probe]) {
            lo = probe + 1;
            step *= 2;
        } else {
            hi = probe;
            break;
        }
    }
    let n = lo + keys[lo..hi].partition_point(&held);
    debug_assert_eq!(n, keys.iter().take_while(|k| held(k)).count(), "a view that is not prefix-closed");
    n
}

/// `(vram, dram)` leading blocks of `keys` in `view` (VRAM is prefix-closed: the VRAM run first).
fn tiered_overlap(keys: &[u64], view: &BlockTable<u8>) -> (usize, usize) {
    let k = leading(keys, |x| view.contains_key(x));
    let v = leading(&keys[..k], |x| view.get(x) == Some(&crate::block_cache::VRAM));
    (v, k - v)
}

/// What the Central Directory's coordinator knows (`schemes.CentralDirectory`): every worker's
/// KV state and queue as its reports reach the coordinator, one WAN way after they leave the
/// worker, plus every request the coordinator itself dispatched (it routes them all).
#[derive(Clone, Debug)]
pub struct CoordinatorState {
    pub workers: Vec<u32>,
    beta: Vec<f64>,
    pub coordinator: u16,
    wan_fraction: f64,
    lambda_max: f64,
    tau_ms: f64,
    gamma: f64,
    tie_ms: f64,
    feed: KvFeed,
    /// Per worker (all): key operations and queue reports on their way, oldest first.
    log: Vec<VecDeque<(f64, Vec<(u64, u8)>)>>,
    reports: Vec<VecDeque<(f64, f64)>>,
    /// Per worker: the coordinator's view, its latest queue report `(sent at, queued ms)`, and
    /// what it dispatched there since `(due at the worker, estimated ms)`.
    view: Vec<BlockTable<u8>>,
    report: Vec<(f64, f64)>,
    sent: Vec<VecDeque<(f64, f64)>>,
}

impl CoordinatorState {
    /// `workers`, `beta`: the routable workers and their prefill rates; `seeds`: every worker's
    /// cache name seed.
    #[allow(clippy::too_many_arguments)]
    pub fn new(workers: Vec<u32>, beta: Vec<f64>, seeds: Vec<u64>, coordinator: u16, wan_fraction: f64, lambda_max: f64, tau_ms: f64, gamma: f64, tie_ms: f64) -> Self {
        let n = seeds.len();
        CoordinatorState {
            workers,
            beta,
            coordinator,
            wan_fraction,
            lambda_max,
            tau_ms,
            gamma,
            tie_ms,
            feed: KvFeed::new(seeds),
            log: vec![VecDeque::new(); n],
            reports: vec![VecDeque::new(); n],
            view: (0..n).map(|_| BlockTable::new()).collect(),
            report: vec![(0.0, 0.0); n],
            sent: vec![VecDeque::new(); n],
        }
    }

    /// Worker `w`'s KV events, sent at `now`.
    pub fn on_events(&mut self, w: u32, events: &[crate::block_cache::Event], now: f64) {
        let ops = self.feed.ops(w, events);
        if !ops.is_empty() {
            self.log[w as usize].push_back((now, ops));
        }
    }

    /// Worker `w`'s queue, `queued_ms` at `now`.
    pub fn on_queue(&mut self, w: u32, queued_ms: f64, now: f64) {
        self.reports[w as usize].push_back((now, queued_ms));
    }

    /// Everything worker `w` sent at or before `cutoff` reaches the coordinator's view.
    fn catch_up(&mut self, w: usize, cutoff: f64) {
        while self.log[w].front().is_some_and(|e| e.0 <= cutoff) {
            let (_, ops) = self.log[w].pop_front().expect("checked");
            apply_ops(&mut self.view[w], &ops, None);
        }
        while self.reports[w].front().is_some_and(|e| e.0 <= cutoff) {
            self.report[w] = self.reports[w].pop_front().expect("checked");
        }
        let since = self.report[w].0;
        while self.sent[w].front().is_some_and(|e| e.0 <= since) {
            self.sent[w].pop_front();
        }
    }

    /// The coordinator's estimate of worker `w`'s queued prefill at `t`: its last report,
    /// drained since, plus what it dispatched there that the report cannot include.
    fn queue_at(&self, w: usize, t: f64) -> f64 {
        let (at, q) = self.report[w];
        (q - (t - at)).max(0.0) + self.sent[w].iter().map(|e| e.1).sum::<f64>()
    }
}

/// What Dynamo-style routers know (`schemes.Dynamo`): each worker's KV state from its events,
/// exact (the feed's record) and as of the last global broadcast (every `period_ms`), a
/// per-region prefix filter, and queues sampled per broadcast. A block is keyed by the seed-free chain value its name
/// stands for (worker-independent: equal keys exactly for equal token prefixes and salt).
#[derive(Clone, Debug)]
pub struct DynamoState {
    period_ms: f64,
    /// Indexed workers, topology order.
    workers: Vec<u32>,
    beta: Vec<f64>,
    feed: KvFeed,
    stale: Vec<BlockTable<u8>>,
    filter: Vec<BlockTable<u32>>,
    log: Vec<VecDeque<(f64, Vec<(u64, u8)>)>>,
    queue: Vec<f64>,
    /// Per worker, by origin region: the work routed there that has landed since `queue` was
    /// sampled. A router tracks the sequences it routed until it hears of them: without this,
    /// its own request vanished from its view between landing and the next sample (found in
    /// review; the Central Directory keeps what it sent the same way).
    landed: Vec<Vec<(u16, f64)>>,
    epoch: f64,
    /// Dynamo-global: the regions with workers, their mean beta and their workers.
    global: Option<(Vec<u16>, Vec<f64>, Vec<Vec<u32>>)>,
}

impl DynamoState {
    /// Work of `ms` from `origin` reached worker `w` (index in the engine's workers).
    pub fn note_landed(&mut self, w: u32, origin: u16, ms: f64) {
        if let Some(l) = self.landed.get_mut(w as usize) {
            origin_add(l, origin, ms);
        }
    }

    fn landed_from(&self, w: u32, origin: u16) -> f64 {
        self.landed.get(w as usize).map_or(0.0, |l| origin_share(l, origin))
    }

    /// `workers`: the indexed workers; `beta`, `seeds`: per worker (all); `regions` count.
    pub fn new(period_ms: f64, workers: Vec<u32>, beta: Vec<f64>, seeds: Vec<u64>, regions: usize, global: Option<(Vec<u16>, Vec<f64>, Vec<Vec<u32>>)>) -> Self {
        let n = beta.len();
        DynamoState {
            period_ms,
            workers,
            beta,
            feed: KvFeed::new(seeds),
            stale: (0..n).map(|_| BlockTable::new()).collect(),
            filter: (0..regions).map(|_| BlockTable::new()).collect(),
            log: vec![VecDeque::new(); n],
            queue: vec![0.0; n],
            landed: vec![Vec::new(); n],
            epoch: -1.0,
            global,
        }
    }

    /// A worker's KV events: the feed's record (the exact view) and key operations, logged for
    /// the next broadcast.
    pub fn on_events(&mut self, w: u32, events: &[crate::block_cache::Event], now: f64) {
        let ops = self.feed.ops(w, events);
        self.log[w as usize].push_back((now, ops));
    }

    /// Leading blocks of `chain` in worker `w`'s exact view.
    pub fn exact_blocks(&self, w: u32, chain: &[u64]) -> Result<usize> {
        if w as usize >= self.beta.len() {
            return Err(CoreError::InvalidArgument(format!("unknown worker index {w}")));
        }
        Ok(self.feed.overlap(w as usize, chain))
    }

    /// Leading blocks of `keys` in `view`.
    fn overlap<V: Copy + Default>(keys: &[u64], view: &BlockTable<V>) -> usize {
        leading(keys, |k| view.contains_key(k))
    }
}

/// Workers whose first probe [`bounded_scores`] requests ahead, in the order it scores them.
const PREFETCH_VIEWS: usize = 16;

/// Every worker's score that can be within `tie` of the best, the others infinite: `score(i)`
/// (at least `bound[i]`) is called in ascending order of `bound` (ties by index) until a bound
/// exceeds the best score so far plus `tie`; no later worker can come within `tie` of the best,
/// so a choice among the scores within `tie` of their minimum is the same as over every
/// worker's score. `warm(i)` is called first for the [`PREFETCH_VIEWS`] likeliest workers, for
/// the caller to request what their scores will read, so those misses overlap.
fn bounded_scores(bound: &[f64], tie: f64, warm: impl Fn(usize), mut score: impl FnMut(usize) -> f64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..bound.len()).collect();
    order.sort_by(|&a, &b| bound[a].total_cmp(&bound[b]));
    order.iter().take(PREFETCH_VIEWS).for_each(|&i| warm(i));
    let mut scores = vec![f64::INFINITY; bound.len()];
    let mut best = f64::INFINITY;
    for &i in &order {
        if bound[i] > best + tie {
            break;
        }
        scores[i] = score(i);
        debug_assert!(scores[i] >= bound[i], "a score below its bound");
        best = best.min(scores[i]);
    }
    scores
}

/// A run of key operations into a view (and its region's holder counts): the slots of the keys a
/// few operations ahead are requested while the current one is applied, so their misses overlap.
fn apply_ops(view: &mut BlockTable<u8>, ops: &[(u64, u8)], mut counts: Option<&mut BlockTable<u32>>) {
    for (i, &(k, medium)) in ops.iter().enumerate() {
        if let Some(&(a, _)) = ops.get(i + AHEAD) {
            view.prefetch(a);
            if let Some(c) = counts.as_deref() {
                c.prefetch(a);
            }
        }
        let had = view.contains_key(&k);
        if medium == 0 {
            view.remove(&k);
            if had {
                if let Some(c) = counts.as_deref_mut() {
                    if let Some(n) = c.get_mut(&k) {
                        *n -= 1;
                        if *n == 0 {
                            c.remove(&k);
                        }
                    }
                }
            }
        } else {
            view.insert(k, medium);
            if !had {
                if let Some(c) = counts.as_deref_mut() {
                    match c.get_mut(&k) {
                        Some(n) => *n += 1,
                        None => {
                            c.insert(k, 1);
                        }
                    }
                }
            }
        }
    }
}

/// SGLang's `cache_aware` router (`schemes.SGLangCacheAware` documents the policy and its
/// stated simplifications): per worker, the blocks of the prompts it was sent, least recently
/// used first, cut back to `max_blocks` every `interval_ms`.
#[derive(Clone, Debug)]
pub struct SGLangState {
    /// Every prefill worker, topology order.
    workers: Vec<u32>,
    trees: Vec<LruBlocks>,
    max_blocks: usize,
    interval_ms: f64,
    next_eviction_ms: f64,
    cache_threshold: f64,
    balance_abs: u32,
    balance_rel: f64,
}

impl SGLangState {
    pub fn new(workers: Vec<u32>, max_blocks: usize, interval_ms: f64, cache_threshold: f64, balance_abs: u32, balance_rel: f64) -> Self {
        let trees = workers.iter().map(|_| LruBlocks::default()).collect();
        SGLangState { workers, trees, max_blocks: max_blocks.max(1), interval_ms, next_eviction_ms: interval_ms, cache_threshold, balance_abs, balance_rel }
    }
}

/// A set of blocks in least-recently-used order (Python's dict with pop-and-reinsert): each
/// touch stamps the block with the next clock (its record is its stamp).
///
/// No order queue: a tree is cut back only every `interval_ms`, and cutting it to `max` blocks
/// drops exactly the blocks with the `len - max` smallest stamps (stamps are unique), which a
/// selection over the table finds. A queue entry per touch (a few hundred a request) and the
/// memory it took were about a third of SGLang's run; a cut is one pass over the trees that
/// overflow, once a simulated minute.
#[derive(Clone, Debug, Default)]
struct LruBlocks {
    map: BlockTable<u64>,
    clock: u64,
}

impl LruBlocks {
    #[inline]
    fn touch(&mut self, h: u64) {
        self.clock += 1;
        self.map.insert(h, self.clock);
    }
    /// Drop the least recently used blocks until at most `max` are left.
    fn cut(&mut self, max: usize) {
        let n = self.map.len();
        if n <= max {
            return;
        }
        let mut stamps: Vec<u64> = self.map.iter().map(|(_, &c)| c).collect();
        let (_, &mut last, _) = stamps.select_nth_unstable(n - max - 1);
        let doomed: Vec<u64> = self.map.iter().filter(|(_, &c)| c <= last).map(|(h, _)| h).collect();
        for h in doomed {
            self.map.remove(&h);
        }
    }
}

/// The static state of each baseline (built by `kvcompass.sim.schemes`).
#[derive(Clone, Debug)]
pub enum Baseline {
    ConsistentHash { levels: Vec<u64>, rings: Vec<(Vec<u64>, Vec<u32>)> },
    Chord { levels: Vec<u64>, ids: Vec<u64>, nodes: Vec<u32>, regions: Vec<u16>, fingers: Vec<Vec<u32>>, entry: Vec<Option<u32>> },
    CentralDirectory(Box<CoordinatorState>),
    PlanetServe { pools: Vec<Vec<u32>>, trees: Vec<History> },
    SkyWalker { pools: Vec<Vec<u32>>, trees: Vec<History>, remote: Vec<Vec<u16>>, region_of: Vec<u16> },
    Dynamo(Box<DynamoState>),
    SGLang(Box<SGLangState>),
}

fn between(x: u64, a: u64, b: u64) -> bool {
    if a < b {
        a < x && x < b
    } else if a != b {
        x > a || x < b
    } else {
        x != a
    }
}

impl Engine {
    fn rtt(&self, a: u16, b: u16) -> f64 {
        self.cfg.rtt[a as usize * self.regions + b as usize]
    }

    /// `schemes._least_loaded`: queued plus dispatched work (`origin`'s share, or all), ties drawn.
    pub(super) fn least_loaded(&mut self, pool: &[u32], origin: Option<u16>) -> u32 {
        let mut q = std::mem::take(&mut self.scratch);
        q.clear();
        let mut least = f64::INFINITY;
        for &w in pool {
            let x = &self.workers[w as usize];
            let d = match origin {
                None => origin_total(&x.dispatched),
                Some(o) => origin_share(&x.dispatched, o),
            };
            let v = self.queued(x, self.now) + d;
            least = least.min(v);
            q.push(v);
        }
        let mut cand = std::mem::take(&mut self.cand);
        cand.clear();
        cand.extend(pool.iter().zip(&q).filter(|(_, &v)| v <= least + 1e-9).map(|(&w, _)| w));
        let w = if cand.len() > 1 { cand[self.rng.integers(cand.len() as u64) as usize] } else { cand[0] };
        self.scratch = q;
        self.cand = cand;
        w
    }

    /// `_DynamoState.refresh`: at the first arrival of a new broadcast period, every worker's
    /// stale view catches up with its events up to the period's start and its queue is sampled.
    fn dynamo_refresh(&mut self, s: &mut DynamoState) {
        let epoch = py_floordiv(self.now, s.period_ms);
        if epoch <= s.epoch {
            return;
        }
        let cutoff = epoch * s.period_ms;
        for &w in &s.workers {
            let wi = w as usize;
            let region = self.workers[wi].region as usize;
            while s.log[wi].front().is_some_and(|e| e.0 <= cutoff) {
                let (_, ops) = s.log[wi].pop_front().expect("checked");
                apply_ops(&mut s.stale[wi], &ops, Some(&mut s.filter[region]));
            }
            s.queue[wi] = self.queued(&self.workers[wi], self.now);
            if let Some(l) = s.landed.get_mut(wi) {
                l.clear();
            }
        }
        s.epoch = epoch;
    }

    /// `schemes._pick`: the best score, near-equal ones (within `tie`) drawn among.
    fn pick(&mut self, scores: &[f64], tie: f64) -> usize {
        let best = scores.iter().copied().fold(f64::INFINITY, f64::min);
        let cand: Vec<usize> = (0..scores.len()).filter(|&i| scores[i] <= best + tie).collect();
        if cand.len() > 1 {
            cand[self.rng.integers(cand.len() as u64) as usize]
        } else {
            cand[0]
        }
    }

    fn dispatched_from(&self, w: u32, origin: u16) -> f64 {
        origin_share(&self.workers[w as usize].dispatched, origin)
    }

    fn choose_dynamo(&mut self, s: &mut DynamoState, origin: u16, l: u64, keys: &[u64]) -> Choice {
        self.dynamo_refresh(s);
        let block = self.block_size as u64;
        let now = self.now;
        if let Some((regions, rbeta, by_region)) = &s.global {
            let mut rs = Vec::with_capacity(regions.len());
            if let Some(&k0) = keys.first() {
                for &r in regions.iter() {
                    s.filter[r as usize].prefetch(k0);
                }
            }
            for (k, &r) in regions.iter().enumerate() {
                let load = by_region[k].iter().map(|&w| s.queue[w as usize] + self.dispatched_from(w, origin) + s.landed_from(w, origin)).fold(f64::INFINITY, f64::min);
                let m = l.min(DynamoState::overlap(keys, &s.filter[r as usize]) as u64 * block);
                rs.push(self.rtt(origin, r) + load + rbeta[k] * (l - m) as f64);
            }
            let k = self.pick(&rs, 1.0);
            let workers = &by_region[k];
            let mut matches = Vec::with_capacity(workers.len());
            let mut scores = Vec::with_capacity(workers.len());
            if let Some(&k0) = keys.first() {
                for &w in workers {
                    s.feed.prefetch(w as usize, k0);
                }
            }
            for &w in workers {
                let m = l.min(s.feed.overlap(w as usize, keys) as u64 * block);
                // The chosen region's router routes every request entering its region, whatever
                // its origin, so it counts all the work it sent that has not arrived (found in
                // review: only the current origin's, so two regions' requests 0.1 ms apart
                // landed on one worker half the time).
                scores.push(self.queued(&self.workers[w as usize], now) + origin_total(&self.workers[w as usize].dispatched) + s.beta[w as usize] * (l - m) as f64);
                matches.push(m);
            }
            let i = self.pick(&scores, 1.0);
            return Choice { worker: workers[i], claimed: matches[i] as i64, delay_ms: 0.0 };
        }
        // A worker's score is its WAN and queue terms plus its residual prefill, which is never
        // negative, so the first two bound it from below: workers are scored in the order of
        // that bound, and the overlap search (a view probe or a dozen) is skipped for every
        // worker whose bound already exceeds the best score so far plus the tie margin, since
        // none of them can be a candidate (`pick` sees them as infinite; same choice).
        let n = s.workers.len();
        let mut bound = Vec::with_capacity(n);
        for &w in &s.workers {
            let x = &self.workers[w as usize];
            let q = (if x.region == origin { self.queued(x, now) } else { s.queue[w as usize] + s.landed_from(w, origin) }) + self.dispatched_from(w, origin);
            bound.push(self.rtt(origin, x.region) + q);
        }
        // The own region's routers read the exact view, the others the broadcast one.
        let local = |w: u32| self.workers[w as usize].region == origin;
        // A view's first probe is the prompt's first block.
        let warm = |i: usize| {
            let w = s.workers[i];
            keys.first().into_iter().for_each(|&k0| if local(w) { s.feed.prefetch(w as usize, k0) } else { s.stale[w as usize].prefetch(k0) })
        };
        let mut matches = vec![0u64; n];
        let scores = bounded_scores(&bound, 1.0, warm, |i| {
            let w = s.workers[i];
            let held = if local(w) { s.feed.overlap(w as usize, keys) } else { DynamoState::overlap(keys, &s.stale[w as usize]) };
            let m = l.min(held as u64 * block);
            matches[i] = m;
            bound[i] + s.beta[w as usize] * (l - m) as f64
        });
        let i = self.pick(&scores, 1.0);
        Choice { worker: s.workers[i], claimed: matches[i] as i64, delay_ms: 0.0 }
    }

    /// `SGLangCacheAware`: the least-loaded worker when the load is imbalanced, else the
    /// longest tree match above the cache threshold, else the smallest tree; the prompt's blocks
    /// then enter the chosen tree, children first (so parents stay the more recently used).
    fn choose_sglang(&mut self, s: &mut SGLangState, length: usize, chain: &[u64]) -> Choice {
        if self.now >= s.next_eviction_ms {
            for t in s.trees.iter_mut() {
                t.cut(s.max_blocks);
            }
            s.next_eviction_ms = (py_floordiv(self.now, s.interval_ms) + 1.0) * s.interval_ms;
        }
        let loads: Vec<u32> = s.workers.iter().map(|&w| self.workers[w as usize].pending).collect();
        let (hi, lo) = (loads.iter().copied().max().unwrap_or(0), loads.iter().copied().min().unwrap_or(0));
        let mut matched = 0i64;
        let i = if hi - lo > s.balance_abs && hi as f64 > s.balance_rel * lo as f64 {
            loads.iter().position(|&x| x == lo).expect("a least load")
        } else {
            // A tree holds a block's parents whenever it holds the block (whole prompts in,
            // least recently used out, parents newer than children): a binary search.
            let (mut best_i, mut best) = (0usize, -1i64);
            if let Some(&k0) = chain.first() {
                for t in &s.trees {
                    t.map.prefetch(k0);
                }
            }
            // Only a tree that beats the best so far matters (ties keep the first), and a
            // prefix-closed tree beats `best` blocks exactly when it holds block `best`: one
            // probe for most trees (those holding a shared head the best already has). That
            // probe is requested `AHEAD` trees early (again for the trees in between whenever
            // the best moves), so the trees' misses overlap instead of coming one by one.
            let ahead = |from: usize, to: usize, best: i64| {
                if let Some(&h) = usize::try_from(best).ok().and_then(|b| chain.get(b)) {
                    s.trees[from.min(s.trees.len())..to.min(s.trees.len())].iter().for_each(|u| u.map.prefetch(h));
                }
            };
            for (k, t) in s.trees.iter().enumerate() {
                ahead(k + AHEAD, k + AHEAD + 1, best);
                let held = |h: &u64| t.map.contains_key(h);
                let m = if best < 0 {
                    leading(chain, held) as i64
                } else if (best as usize) < chain.len() && held(&chain[best as usize]) {
                    best + 1 + leading(&chain[best as usize + 1..], held) as i64
                } else {
                    continue;
                };
                if m > best {
                    best_i = k;
                    best = m;
                    ahead(k + 1, k + 1 + AHEAD, best);
                }
            }
            let block = self.block_size as i64;
            if !chain.is_empty() && (best * block) as f64 > s.cache_threshold * length as f64 {
                matched = best * block;
                best_i
            } else {
                let least = s.trees.iter().map(|t| t.map.len()).min().unwrap_or(0);
                s.trees.iter().position(|t| t.map.len() == least).expect("a smallest tree")
            }
        };
        let t = &mut s.trees[i];
        for (j, &h) in chain.iter().enumerate().rev() {
            if j >= AHEAD {
                t.map.prefetch(chain[j - AHEAD]);
            }
            t.touch(h);
        }
        Choice { worker: s.workers[i], claimed: matched, delay_ms: 0.0 }
    }

    /// Chord's recursive lookup of `key` from region `origin`: `(owner node, hops, delay_ms)`,
    /// each leg at its static one-way time.
    pub(super) fn chord_route(&self, b: &Baseline, origin: u16, key: u64) -> (usize, u32, f64) {
        let (owner, hops, legs) = self.chord_path(b, origin, key);
        (owner, hops, legs.iter().map(|&(a, c)| self.rtt(a, c) / 2.0).sum())
    }

    /// [`Self::chord_route`]'s owner, hops and the legs the lookup travels, region to region.
    pub(super) fn chord_path(&self, b: &Baseline, origin: u16, key: u64) -> (usize, u32, Vec<(u16, u16)>) {
        let Baseline::Chord { ids, regions, fingers, entry, .. } = b else { return (0, 0, Vec::new()) };
        let n = ids.len();
        let entry = match entry[origin as usize] {
            Some(e) => e as usize,
            None => (0..n).min_by(|&i, &j| self.rtt(origin, regions[i]).partial_cmp(&self.rtt(origin, regions[j])).unwrap_or(std::cmp::Ordering::Equal).then(i.cmp(&j))).unwrap_or(0),
        };
        let mut legs = vec![(origin, regions[entry])];
        let mut cur = entry;
        let mut hops = 0;
        let owner;
        loop {
            let succ = (cur + 1) % n;
            if key == ids[succ] || between(key, ids[cur], ids[succ]) || n == 1 {
                owner = if n > 1 { succ } else { cur };
                break;
            }
            let mut nxt = cur;
            for &f in fingers[cur].iter().rev() {
                if between(ids[f as usize], ids[cur], key) {
                    nxt = f as usize;
                    break;
                }
            }
            if nxt == cur {
                nxt = succ;
            }
            legs.push((regions[cur], regions[nxt]));
            cur = nxt;
            hops += 1;
        }
        legs.push((regions[cur], origin));
        (owner, hops, legs)
    }

    /// `schemes._prefix_pick`: the least-loaded of `pool` holding the longest routed prefix.
    fn prefix_pick(&mut self, tree: &History, chain: &[u64], pool: &[u32], origin: u16) -> Option<(u32, i64)> {
        let (n, holders) = tree.matched(chain);
        let cand: Vec<u32> = pool.iter().copied().filter(|w| holders.as_slice().contains(w)).collect();
        if n == 0 || cand.is_empty() {
            return None;
        }
        Some((self.least_loaded(&cand, Some(origin)), (n * self.block_size) as i64))
    }

    /// PlanetServe's balancer (its `hrt+lb` evaluation code): the least-loaded holder of the
    /// longest routed prefix, unless its load is above the pool's 80th percentile; then the
    /// first holder of a shorter prefix (walking up the tree) whose load is below it, else the
    /// least-loaded worker. Loads are queued plus dispatched prefill (PlanetServe's is a moving
    /// average of latency); `(worker, claimed tokens)`.
    fn planetserve_pick(&mut self, tree: &History, chain: &[u64], pool: &[u32], origin: u16) -> (u32, i64) {
        // The routed prefixes' holders are read where the pick needs them (the deepest first, up
        // the tree only past the load threshold), not gathered for every matched block.
        let (matched, _) = tree.matched(chain);
        let at = |d: usize| tree.holders_at(&chain[d]);
        let load = |e: &Engine, w: u32| e.queued(&e.workers[w as usize], e.now) + e.dispatched_from(w, origin);
        let deepest = (0..matched).rev().find(|&d| at(d).as_slice().iter().any(|w| pool.contains(w)));
        let Some(depth) = deepest else {
            return (self.least_loaded(pool, Some(origin)), 0);
        };
        let holders: Vec<u32> = pool.iter().copied().filter(|w| at(depth).as_slice().contains(w)).collect();
        let picked = self.least_loaded(&holders, Some(origin));
        if pool.len() < 2 {
            return (picked, ((depth + 1) * self.block_size) as i64);
        }
        let mut loads: Vec<f64> = pool.iter().map(|&w| load(self, w)).collect();
        loads.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        let n = loads.len();
        let over = loads[((0.8 * n as f64) as usize).min(n - 1)];
        if load(self, picked) <= over {
            return (picked, ((depth + 1) * self.block_size) as i64);
        }
        let under = loads[((0.8 * n as f64).ceil() as usize).saturating_sub(1)];
        for d in (0..depth).rev() {
            for &w in at(d).as_slice() {
                if pool.contains(&w) && load(self, w) < under {
                    return (w, ((d + 1) * self.block_size) as i64);
                }
            }
        }
        (self.least_loaded(pool, Some(origin)), 0)
    }

    /// The baseline's choice for request `req`, whose chain is `chain` (its tokens are expanded
    /// only as far as a content-keyed scheme hashes them).
    pub(super) fn choose_baseline(&mut self, b: &mut Baseline, req: u32, chain: &[u64]) -> Result<Choice> {
        let r = self.prompts.reqs[req as usize];
        let prompts = std::sync::Arc::clone(&self.prompts);
        let tokens = || prompts.tokens_upto(req, usize::MAX);
        let block = self.block_size;
        let done = |worker: u32, claimed: i64, delay_ms: f64| Ok(Choice { worker, claimed, delay_ms });
        match b {
            Baseline::ConsistentHash { levels, rings } => {
                let (level, key) = level_key(levels, r.input_length, |n| prompts.prefix_sum(req, n, block, chain, &mut self.sum_memo), tokens, &self.salts, r.salt);
                let (pos, owner) = &rings[level];
                let i = pos.partition_point(|&p| p < key);
                done(owner[i % owner.len()], 0, 0.0)
            }
            Baseline::Chord { levels, .. } => {
                let (_, key) = level_key(levels, r.input_length, |n| prompts.prefix_sum(req, n, block, chain, &mut self.sum_memo), tokens, &self.salts, r.salt);
                // Every leg of the lookup is a WAN traversal, jittered as the others are (found
                // in review: Chord's hops kept the static times under --wan-jitter).
                let (owner, _, legs) = self.chord_path(b, r.region, key);
                let delay: f64 = legs.iter().map(|&(a, c)| self.way(a, c)).sum();
                let Baseline::Chord { nodes, .. } = &*b else { unreachable!("matched above") };
                done(nodes[owner], 0, delay)
            }
            Baseline::CentralDirectory(c) => {
                // The request reaches the coordinator one way after it arrives; what a worker
                // sent one way before that has reached the coordinator (clamped to now: the
                // engine cannot look ahead, so a worker nearer the coordinator than the request
                // is seen as of now, a little fresher than it could be).
                // The lookup's two WAN legs, jittered as every traversal is (review); both at the
                // request-to-coordinator time, as the static round trip was.
                let there = self.way(r.region, c.coordinator);
                let delay = there + self.way(r.region, c.coordinator);
                let decide = self.now + there;
                let l = r.input_length;
                let block = self.block_size as u64;
                let mut q = Vec::with_capacity(c.workers.len());
                let mut least = f64::INFINITY;
                for i in 0..c.workers.len() {
                    let w = c.workers[i];
                    let wr = self.workers[w as usize].region;
                    let cutoff = (decide - self.rtt(wr, c.coordinator) / 2.0).min(self.now);
                    c.catch_up(w as usize, cutoff);
                    let v = c.queue_at(w as usize, decide);
                    least = least.min(v);
                    q.push(v);
                }
                let lam = c.lambda_max.min(least / c.tau_ms);
                // As in Dynamo's choice: the WAN and queue terms bound a score from below, so
                // workers are scored in that order and those whose bound exceeds the best so far
                // plus the tie margin skip their overlap search (never candidates; same choice).
                let n = c.workers.len();
                let bound: Vec<f64> = (0..n).map(|i| c.wan_fraction * self.rtt(r.region, self.workers[c.workers[i] as usize].region) + q[i]).collect();
                let views = &c.view;
                let warm = |i: usize| chain.first().into_iter().for_each(|&k0| views[c.workers[i] as usize].prefetch(k0));
                let mut hits = vec![(0u64, 0u64, 0.0f64); n];
                let scores = bounded_scores(&bound, c.tie_ms, warm, |i| {
                    let (vb, db) = tiered_overlap(chain, &c.view[c.workers[i] as usize]);
                    let v = l.min(vb as u64 * block);
                    let d = l.min((vb + db) as u64 * block) - v;
                    let work = c.beta[i] * l.saturating_sub(v + d) as f64 + c.gamma * d as f64;
                    hits[i] = (v, d, work);
                    bound[i] + work + lam * c.beta[i] * l.saturating_sub(v + d) as f64
                });
                let i = self.pick(&scores, c.tie_ms);
                let (v, d, work) = hits[i];
                let w = c.workers[i];
                let due = self.now + delay + self.rtt(r.region, self.workers[w as usize].region) / 2.0;
                c.sent[w as usize].push_back((due, work));
                done(w, l.min(v + d) as i64, delay)
            }
            Baseline::Dynamo(st) => Ok(self.choose_dynamo(st, r.region, r.input_length, chain)),
            Baseline::SGLang(st) => Ok(self.choose_sglang(st, r.input_length as usize, chain)),
            Baseline::PlanetServe { pools, trees } => {
                let region = r.region as usize;
                let pool = std::mem::take(&mut pools[region]);
                let (worker, claimed) = self.planetserve_pick(&trees[region], chain, &pool, r.region);
                pools[region] = pool;
                trees[region].insert(chain, worker);
                done(worker, claimed, 0.0)
            }
            Baseline::SkyWalker { pools, trees, remote, region_of } => {
                let region = r.region as usize;
                // Taken out for the call and put back (remote regions are never this one).
                let local = std::mem::take(&mut pools[region]);
                let picked = if local.is_empty() { None } else { self.prefix_pick(&trees[region], chain, &local, r.region) };
                // A replica's pending queue counts what the balancer sent that is still on the
                // WAN, as SkyWalker's own count of its outstanding requests does (found in review:
                // a remote replica looked free until the first push landed, one WAN way later,
                // and took a burst of pushes).
                let waiting = |e: &Engine, w: u32| {
                    let x = &e.workers[w as usize];
                    x.pending.saturating_sub(x.current.is_some() as u32)
                };
                let free: Vec<u32> = local.iter().copied().filter(|&w| waiting(self, w) == 0).collect();
                let mut worker: Option<u32> = None;
                let mut claimed = 0i64;
                let holder = picked.map(|p| p.0);
                if let Some((h, m)) = picked.filter(|&(h, _)| waiting(self, h) == 0) {
                    worker = Some(h);
                    claimed = m;
                } else if !free.is_empty() {
                    worker = Some(self.least_loaded(&free, Some(r.region)));
                } else {
                    for &o in remote[region].iter() {
                        let rfree: Vec<u32> = pools[o as usize].iter().copied().filter(|&w| waiting(self, w) == 0).collect();
                        if !rfree.is_empty() {
                            worker = Some(self.least_loaded(&rfree, Some(r.region)));
                            break;
                        }
                    }
                    if worker.is_none() {
                        if let Some((h, m)) = picked {
                            worker = Some(h);
                            claimed = m;
                        } else if !local.is_empty() {
                            worker = Some(self.least_loaded(&local, Some(r.region)));
                        } else {
                            pools[region] = local;
                            return Err(CoreError::InvalidArgument(format!("request {req} (in arrival order): its region has no workers and no remote replica is free: skywalker cannot serve it")));
                        }
                    }
                }
                let worker = worker.expect("set above");
                let wr = region_of[worker as usize] as usize;
                if claimed == 0 && Some(worker) != holder {
                    let (n, holders) = trees[wr].matched(chain);
                    claimed = if holders.as_slice().contains(&worker) { (n * block) as i64 } else { 0 };
                }
                pools[region] = local;
                trees[wr].insert(chain, worker);
                done(worker, claimed, 0.0)
            }
        }
    }
}

/// `(vram, dram)` hit tokens of `cache` for the seed-free chain `base`.
#[cfg(test)]
mod tests {
    use super::*;

    /// The workers within the tie margin of the best, from the bounded scores, are those from
    /// every score, over random bounds and residuals (many near ties), and workers past the
    /// margin go unscored.
    #[test]
    fn bounded_scores_keep_every_candidate_within_the_tie() {
        let mut g = crate::sim::rng::Pcg64::seeded(5);
        let mut skipped = 0;
        for case in 0..2000 {
            let n = 1 + (g.next_u64() % 24) as usize;
            let tie = [0.0, 0.5, 1.0][case % 3];
            let bound: Vec<f64> = (0..n).map(|_| (g.next_u64() % 40) as f64 * 0.25).collect();
            let extra: Vec<f64> = (0..n).map(|_| if g.next_u64().is_multiple_of(3) { 0.0 } else { (g.next_u64() % 16) as f64 * 0.5 }).collect();
            let full: Vec<f64> = (0..n).map(|i| bound[i] + extra[i]).collect();
            let mut called = 0;
            let part = bounded_scores(&bound, tie, |_| {}, |i| {
                called += 1;
                bound[i] + extra[i]
            });
            let cand = |s: &[f64]| {
                let best = s.iter().copied().fold(f64::INFINITY, f64::min);
                (0..n).filter(|&i| s[i] <= best + tie).collect::<Vec<_>>()
            };
            assert_eq!(cand(&part), cand(&full), "case {case}");
            skipped += n - called;
        }
        assert!(skipped > 1000, "the bound prunes ({skipped} workers skipped)");
    }

    #[test]
    fn unmix64_inverts_mix64() {
        for x in [0u64, 1, 42, u64::MAX, 0x0123_4567_89AB_CDEF] {
            assert_eq!(unmix64(crate::token_ids::mix64(x)), x);
        }
    }

    #[test]
    fn floordiv_is_pythons() {
        assert_eq!(py_floordiv(1.0, 0.1), 9.0); // (1.0 / 0.1).floor() would say 10
        assert_eq!(py_floordiv(250.0, 100.0), 2.0);
        assert_eq!(py_floordiv(99.99, 100.0), 0.0);
    }

    #[test]
    fn bytes_repr_is_pythons() {
        assert_eq!(bytes_repr(b"ab'c"), "b\"ab'c\"");
        assert_eq!(bytes_repr(b"a'\"b"), "b'a\\'\"b'");
        assert_eq!(bytes_repr(&[0, 9, 10, 13, 92, 127, 200]), "b'\\x00\\t\\n\\r\\\\\\x7f\\xc8'");
    }

    #[test]
    fn history_evicts_the_least_recently_touched() {
        let mut h = History::new(2);
        h.insert(&[1], 0);
        h.insert(&[2], 0);
        h.insert(&[1], 1); // touch 1: 2 is now the oldest
        h.insert(&[3], 0);
        assert_eq!(h.matched(&[2]).0, 0);
        let (n, holders) = h.matched(&[1]);
        assert_eq!((n, holders.as_slice()), (1, &[0u32, 1][..]));
        assert_eq!(h.matched(&[3]).0, 1);
    }

    /// A tree cut back by stamps keeps exactly what popping its least recently touched
    /// blocks one by one keeps (Python's dict with pop-and-reinsert), over random touches and
    /// cuts.
    #[test]
    fn lru_blocks_cut_as_an_lru_pops() {
        let mut g = crate::sim::rng::Pcg64::seeded(5);
        let mut t = LruBlocks::default();
        let mut naive: VecDeque<u64> = VecDeque::new(); // oldest first
        for step in 0..20_000u64 {
            if step % 997 == 996 {
                let max = (g.next_u64() % 300) as usize;
                t.cut(max);
                while naive.len() > max {
                    naive.pop_front();
                }
                let mut have: Vec<u64> = t.map.iter().map(|(h, _)| h).collect();
                let mut want: Vec<u64> = naive.iter().copied().collect();
                have.sort_unstable();
                want.sort_unstable();
                assert_eq!(have, want, "after a cut to {max}");
            } else {
                let h = 1 + g.next_u64() % 500;
                t.touch(h);
                if let Some(i) = naive.iter().position(|&x| x == h) {
                    naive.remove(i);
                }
                naive.push_back(h);
            }
            assert_eq!(t.map.len(), naive.len());
        }
        let mut have: Vec<u64> = t.map.iter().map(|(h, _)| h).collect();
        let mut want: Vec<u64> = naive.into_iter().collect();
        have.sort_unstable();
        want.sort_unstable();
        assert_eq!(have, want);
    }

    /// Holders come back in routing order whether they sit inline or spilled (a fourth holder,
    /// or one whose index does not fit the inline slots), and a spilled prefix's list is freed
    /// with it and reused.
    #[test]
    fn history_keeps_holders_in_routing_order() {
        let mut h = History::new(3);
        for w in [5, 2, 9, 7, 2] {
            h.insert(&[10, 11], w);
        }
        assert_eq!(h.matched(&[10, 11]).1.as_slice(), &[5, 2, 9, 7]);
        assert_eq!(h.matched(&[10, 11, 12]).0, 2);
        assert_eq!((h.holders_at(&10).as_slice(), h.holders_at(&11).as_slice()), (&[5, 2, 9, 7][..], &[5, 2, 9, 7][..]));
        assert!(h.holders_at(&12).as_slice().is_empty());
        h.insert(&[20], 1);
        h.insert(&[20], 70_000);
        h.insert(&[20], 3);
        assert_eq!(h.matched(&[20]).1.as_slice(), &[1, 70_000, 3]);
        // Capacity 3: inserting two more prefixes evicts 10 and 11 (the oldest), freeing their lists.
        h.insert(&[30, 31], 4);
        assert_eq!(h.matched(&[10]).0, 0);
        assert_eq!(h.free.len(), 2);
        h.insert(&[31], 8);
        h.insert(&[31], 9);
        h.insert(&[31], 6);
        assert_eq!(h.matched(&[30, 31]).0, 2);
        assert_eq!(h.holders_at(&31).as_slice(), &[4, 8, 9, 6]);
        assert_eq!(h.free.len(), 1, "a freed spill list is reused");
    }
}
