//! The route loop: pick the worker that serves one request fastest.
//!
//! One call per request. The prompt is hashed once (every indexed prefix length this edge may
//! query, in a single SHA-256 pass), each region group's table is probed at the lengths of that
//! region's plan, and every worker gets a score that trades network and queue delay against the
//! prefill it still has to do:
//!
//! ```text
//! score(w) = wan[w] + tq[w]
//!          + (1 + lambda) * beta[w] * (L - b_w * m_w)
//!          + gamma * b_w * m_w * [tier_w == DRAM]
//! ```
//!
//! `m_w` is the longest cached prefix the index claims for `w`, `b_w` how much we trust the
//! index about `w`, `L` the prompt length. The winner is the argmin (lowest index on ties).
//! Cost is O(L + probes + W): one hash pass, one lookup per (table, fitting length), one pass
//! over the workers.
//!
//! Table values pack one 2-bit tier per worker field (field `f` in bits `2f..2f+2`), so a table
//! covers at most 32 workers. Tier 3 is reserved; it is read as absent so a future encoding can
//! never be mistaken for a cache hit by an old router.

use crate::chunk_hash::{shard_of, NO_KEY};
use crate::error::{CoreError, Result};

/// The worker does not hold the prefix (or the index does not know).
pub const TIER_ABSENT: u8 = 0;
/// The prefix is resident in GPU memory: reuse is free.
pub const TIER_VRAM: u8 = 1;
/// The prefix sits in host memory: reuse costs a reload of `gamma` ms per token.
pub const TIER_DRAM: u8 = 2;

/// The most worker fields one table value can carry (64 bits / 2 bits per field).
pub const MAX_TABLE_WORKERS: usize = 32;

/// Anything that answers "what value is stored under this key" (a keyless Ludo view returns 0
/// for absent).
pub trait TierLookup {
    fn lookup(&self, key: u64) -> u64;
    /// Start the memory reads a later `lookup(key)` will make (a hint; no effect on results).
    #[inline]
    fn prefetch(&self, _key: u64) {}
}

impl<T: TierLookup + ?Sized> TierLookup for &T {
    #[inline]
    fn lookup(&self, key: u64) -> u64 {
        (**self).lookup(key)
    }
    #[inline]
    fn prefetch(&self, key: u64) {
        (**self).prefetch(key)
    }
}

/// One logical table: the workers of one region group.
///
/// `workers[f]` is the global worker index whose 2-bit tier field is field `f` (bits
/// `2f..2f+2` of the value). `shards[s]` answers keys with `key % shards.len() == s`.
#[derive(Debug)]
pub struct RouteTable<'a, V> {
    pub region: u32,
    pub workers: &'a [u32],
    pub shards: &'a [V],
}

// Written by hand: the derive would demand `V: Clone`, but only references are copied.
impl<V> Clone for RouteTable<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<V> Copy for RouteTable<'_, V> {}

/// Per-worker inputs, all of length W (structure of arrays, as the control plane keeps them).
#[derive(Debug, Clone, Copy)]
pub struct WorkerArrays<'a> {
    /// Region of each worker; selects nothing here but must name a plan entry.
    pub region: &'a [u32],
    /// Prefill cost, ms per token.
    pub beta: &'a [f64],
    /// Network delay from this edge, ms.
    pub wan: &'a [f64],
    /// Queue estimate, ms.
    pub tq: &'a [f64],
    /// Trust in the index's claims about this worker, in [0, 1].
    pub belief: &'a [f64],
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreParams {
    /// DRAM reload cost, ms per token.
    pub gamma: f64,
    /// Capacity price (>= 0): inflates prefill work so cache reuse is preferred under load.
    pub lambda: f64,
    /// Require a worker to hold every shorter planned prefix before its longer hit counts.
    pub closure: bool,
    /// The engines' KV block size, tokens (0: no cap). A match is scored, and claimed by a
    /// commit, as at most the whole blocks before the prompt's last token, what an engine reuses
    /// of it (the route's `matches` stay what the index holds): vLLM computes the last token
    /// again for the first output's logits (`max_cache_hit_length = num_tokens - 1`), so a
    /// prompt whose whole length is indexed reuses all but its last block, and claiming the
    /// whole prompt read as a false hit when the worker reported what it reused.
    pub block: u32,
}

impl ScoreParams {
    /// The most of a prompt of `prompt_len` tokens an engine reuses from its cache (see
    /// [`ScoreParams::block`]; every match when `block` is 0): what a match is scored and
    /// claimed as.
    #[inline]
    pub fn reusable(&self, prompt_len: usize) -> u32 {
        if self.block == 0 {
            return u32::MAX;
        }
        let b = self.block as usize;
        u32::try_from(prompt_len.saturating_sub(1) / b * b).unwrap_or(u32::MAX)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct RouteResult {
    pub winner: usize,
    pub score: f64,
    /// Matched prefix length per worker (0 = none).
    pub matches: Vec<u32>,
    /// Tier of that match per worker ([`TIER_ABSENT`] when none).
    pub tiers: Vec<u8>,
    /// Score of every worker.
    pub scores: Vec<f64>,
}

/// The winner of a [`route_with`] call; the per-worker arrays stay in the scratch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteWinner {
    pub winner: usize,
    pub score: f64,
}

/// Buffers reused across [`route_with`] calls so the hot loop does not allocate once warm.
///
/// After a successful call, [`matches`](Self::matches), [`tiers`](Self::tiers) and
/// [`scores`](Self::scores) describe that call; after an error their contents are unspecified.
#[derive(Debug, Clone, Default)]
pub struct RouteScratch {
    lengths: Vec<u32>,
    keys: Vec<u64>,
    matches: Vec<u32>,
    tiers: Vec<u8>,
    scores: Vec<f64>,
    /// Hash every prefix afresh instead of through the process's prefix memo: what a prompt
    /// seen for the first time costs (the benchmark's figure against plain SHA-256).
    cold: bool,
}

impl RouteScratch {
    pub fn new() -> Self {
        Self::default()
    }
    /// A scratch whose routes never use the prefix memo (see `cold`).
    pub fn cold() -> Self {
        RouteScratch { cold: true, ..Self::default() }
    }
    pub fn matches(&self) -> &[u32] {
        &self.matches
    }
    pub fn tiers(&self) -> &[u8] {
        &self.tiers
    }
    pub fn scores(&self) -> &[f64] {
        &self.scores
    }
    /// The prefix lengths the call hashed (ascending) and their keys, position for position.
    pub fn lengths(&self) -> &[u32] {
        &self.lengths
    }
    pub fn keys(&self) -> &[u64] {
        &self.keys
    }
}

/// Route one request. `plan[r]` = ascending indexed prefix lengths this edge queries toward
/// region `r`. See the module docs for the score; see [`route_with`] for an allocation-free form.
pub fn route<V: TierLookup>(
    ns: &[u8; 32],
    tokens: &[u32],
    plan: &[Vec<u32>],
    tables: &[RouteTable<'_, V>],
    workers: &WorkerArrays<'_>,
    params: &ScoreParams,
) -> Result<RouteResult> {
    let mut s = RouteScratch::new();
    let w = route_with(&mut s, ns, tokens, plan, tables, workers, params, None)?;
    Ok(RouteResult {
        winner: w.winner,
        score: w.score,
        matches: s.matches,
        tiers: s.tiers,
        scores: s.scores,
    })
}

/// [`route`] writing matches, tiers and scores into `scratch` instead of fresh vectors.
///
/// With `only` naming a region, only its plan's lengths are hashed and only its tables read, so
/// every other worker matches nothing and scores infinity. Its own workers get exactly the
/// matches, tiers and scores the full route gives them (a worker's claims live in its region's
/// tables only): what an edge re-placing a request among its own workers reads (the hand-off).
#[allow(clippy::too_many_arguments)]
pub fn route_with<V: TierLookup>(
    scratch: &mut RouteScratch,
    ns: &[u8; 32],
    tokens: &[u32],
    plan: &[Vec<u32>],
    tables: &[RouteTable<'_, V>],
    workers: &WorkerArrays<'_>,
    params: &ScoreParams,
    only: Option<u32>,
) -> Result<RouteWinner> {
    let w_count = validate(plan, tables, workers, params)?;
    if let Some(r) = only {
        if r as usize >= plan.len() {
            return Err(CoreError::InvalidArgument(format!("route within region {r}: the plan covers {} regions", plan.len())));
        }
    }
    let prompt_len = tokens.len();

    // Every region's lengths share one hash pass: the longest fitting length costs the same
    // SHA-256 work whether we hash one plan or all of them.
    scratch.lengths.clear();
    for (r, p) in plan.iter().enumerate() {
        if only.is_none_or(|o| o as usize == r) {
            scratch.lengths.extend_from_slice(fitting(p, prompt_len));
        }
    }
    scratch.lengths.sort_unstable();
    scratch.lengths.dedup();
    scratch.keys.clear();
    scratch.keys.resize(scratch.lengths.len(), NO_KEY);
    // Through the process's memo: a prefix hashed before costs a fingerprint (prefix_memo).
    if scratch.cold {
        crate::chunk_hash::prefix_keys_into(ns, tokens, &scratch.lengths, &mut scratch.keys)?;
    } else {
        crate::prefix_memo::keys_into(ns, tokens, &scratch.lengths, &mut scratch.keys)?;
    }

    scratch.matches.clear();
    scratch.matches.resize(w_count, 0);
    scratch.tiers.clear();
    scratch.tiers.resize(w_count, TIER_ABSENT);

    let RouteScratch {
        lengths,
        keys,
        matches,
        tiers,
        scores,
        ..
    } = scratch;
    // Each table's first probe is a cache miss on a table of megabytes: start them all
    // before reading any, so they overlap instead of queueing one table after another.
    for t in tables.iter().filter(|t| only.is_none_or(|o| o == t.region)) {
        warm_table(t, plan, prompt_len, lengths, keys, params.closure);
    }
    for t in tables.iter().filter(|t| only.is_none_or(|o| o == t.region)) {
        probe_table(
            t,
            plan,
            prompt_len,
            lengths,
            keys,
            params.closure,
            matches,
            tiers,
        );
    }

    // Scored on what an engine reuses of the match; `matches` keeps what the index holds (the
    // planned length a speculative entry or a migration is about).
    let cap = params.reusable(prompt_len);

    scores.clear();
    scores.reserve(w_count);
    let mut best = RouteWinner {
        winner: 0,
        score: f64::INFINITY,
    };
    for w in 0..w_count {
        let s = if only.is_some_and(|o| o != workers.region[w]) {
            // A layout keeps a worker's claims in its own region's tables; should one list it
            // elsewhere, it still matches nothing here.
            matches[w] = 0;
            tiers[w] = TIER_ABSENT;
            f64::INFINITY
        } else {
            worker_score(
                prompt_len,
                matches[w].min(cap),
                tiers[w],
                workers.beta[w],
                workers.wan[w],
                workers.tq[w],
                workers.belief[w],
                params,
            )
        };
        scores.push(s);
        // Strict `<` keeps the lowest index on ties; `w == 0` seeds it even if every score
        // overflowed to infinity.
        if w == 0 || s < best.score {
            best = RouteWinner {
                winner: w,
                score: s,
            };
        }
    }
    Ok(best)
}

/// The score formula, in exactly the order the module docs write it so callers that recompute
/// it (tests, the Python reference) get bit-identical results.
#[allow(clippy::too_many_arguments)]
#[inline]
fn worker_score(
    prompt_len: usize,
    m: u32,
    tier: u8,
    beta: f64,
    wan: f64,
    tq: f64,
    belief: f64,
    p: &ScoreParams,
) -> f64 {
    let m = f64::from(m);
    let remaining = prompt_len as f64 - belief * m;
    // Guards keep huge-but-finite inputs from forming inf * 0 = NaN, which would poison the
    // argmin; with finite products they change nothing.
    let prefill = if remaining > 0.0 {
        (1.0 + p.lambda) * beta * remaining
    } else {
        0.0
    };
    let reload = if tier == TIER_DRAM {
        p.gamma * belief * m
    } else {
        0.0
    };
    wan + tq + prefill + reload
}

/// The prefix of an ascending plan whose lengths fit a prompt of `prompt_len` tokens.
#[inline]
fn fitting(p: &[u32], prompt_len: usize) -> &[u32] {
    // Compared in u64 so a u32 length never truncates on a 16/32-bit usize.
    let n = p.partition_point(|&c| u64::from(c) <= prompt_len as u64);
    &p[..n]
}

#[inline]
fn field_tier(value: u64, field: u32) -> u8 {
    let t = ((value >> (2 * field)) & 3) as u8;
    if t == 3 {
        TIER_ABSENT
    } else {
        t
    }
}

/// Keep the better claim when a worker is reported more than once (several tables, or a
/// repeated field): longer wins, and at equal length VRAM beats DRAM since it is cheaper.
#[inline]
fn record(matches: &mut [u32], tiers: &mut [u8], w: usize, c: u32, tier: u8) {
    if c > matches[w] || (c == matches[w] && tier < tiers[w]) {
        matches[w] = c;
        tiers[w] = tier;
    }
}

#[allow(clippy::too_many_arguments)]
/// Prefetch the slot `probe_table` reads first for `t`: its shortest (closure) or longest
/// fitting length.
fn warm_table<V: TierLookup>(t: &RouteTable<'_, V>, plan: &[Vec<u32>], prompt_len: usize, lengths: &[u32], keys: &[u64], closure: bool) {
    if t.workers.is_empty() {
        return;
    }
    let Some(p) = plan.get(t.region as usize) else { return };
    let fit = fitting(p, prompt_len);
    let c = if closure { fit.first() } else { fit.last() };
    if let Some(&c) = c {
        prefetch_probe(t, lengths, keys, c);
    }
}

#[inline]
fn prefetch_probe<V: TierLookup>(t: &RouteTable<'_, V>, lengths: &[u32], keys: &[u64], c: u32) {
    let Ok(n) = u32::try_from(t.shards.len()) else { return };
    if let Ok(i) = lengths.binary_search(&c) {
        if let Some(&key) = keys.get(i) {
            if key != NO_KEY {
                if let Some(s) = t.shards.get(shard_of(key, n) as usize) {
                    s.prefetch(key);
                }
            }
        }
    }
}

fn probe_table<V: TierLookup>(
    t: &RouteTable<'_, V>,
    plan: &[Vec<u32>],
    prompt_len: usize,
    lengths: &[u32],
    keys: &[u64],
    closure: bool,
    matches: &mut [u32],
    tiers: &mut [u8],
) {
    let fields = t.workers.len();
    if fields == 0 {
        return;
    }
    let all: u32 = if fields >= 32 {
        u32::MAX
    } else {
        (1u32 << fields) - 1
    };
    let Some(p) = plan.get(t.region as usize) else {
        return;
    };
    let Ok(n_shards) = u32::try_from(t.shards.len()) else {
        return;
    };
    // Only absent on a broken invariant (a plan length missing from the hashed set); reading it
    // as "value 0" makes that a miss rather than a panic.
    let probe = |c: u32| -> u64 {
        let Ok(i) = lengths.binary_search(&c) else {
            return 0;
        };
        let Some(&key) = keys.get(i) else { return 0 };
        if key == NO_KEY {
            return 0;
        }
        match t.shards.get(shard_of(key, n_shards) as usize) {
            Some(s) => s.lookup(key),
            None => 0,
        }
    };
    let fit = fitting(p, prompt_len);

    if closure {
        // A hit at c_j only counts if every shorter planned prefix is also held, so walk up
        // and drop workers at their first miss; once none is left the rest cannot matter.
        let mut alive = all;
        for (j, &c) in fit.iter().enumerate() {
            // The next level's read starts while this one is decided (wasted if none is left).
            if let Some(&next) = fit.get(j + 1) {
                prefetch_probe(t, lengths, keys, next);
            }
            let v = probe(c);
            let mut bits = alive;
            while bits != 0 {
                let f = bits.trailing_zeros();
                bits &= bits - 1;
                let tier = field_tier(v, f);
                if tier == TIER_ABSENT {
                    alive &= !(1u32 << f);
                } else {
                    record(matches, tiers, t.workers[f as usize] as usize, c, tier);
                }
            }
            if alive == 0 {
                break;
            }
        }
    } else {
        // Only the longest hit matters, so walk down and stop once every field has one.
        let mut pending = all;
        for &c in fit.iter().rev() {
            let v = probe(c);
            let mut bits = pending;
            while bits != 0 {
                let f = bits.trailing_zeros();
                bits &= bits - 1;
                let tier = field_tier(v, f);
                if tier != TIER_ABSENT {
                    pending &= !(1u32 << f);
                    record(matches, tiers, t.workers[f as usize] as usize, c, tier);
                }
            }
            if pending == 0 {
                break;
            }
        }
    }
}

fn bad(msg: String) -> CoreError {
    CoreError::InvalidArgument(msg)
}

fn check_nonneg(what: &str, i: usize, x: f64) -> Result<()> {
    if x.is_finite() && x >= 0.0 {
        Ok(())
    } else {
        Err(bad(format!(
            "worker {i}: {what} = {x} must be finite and >= 0"
        )))
    }
}

/// Everything the loop indexes by is checked here, so the loop itself cannot go out of bounds.
fn validate<V>(
    plan: &[Vec<u32>],
    tables: &[RouteTable<'_, V>],
    workers: &WorkerArrays<'_>,
    params: &ScoreParams,
) -> Result<usize> {
    let w_count = workers.region.len();
    if w_count == 0 {
        return Err(bad(
            "no workers: the worker arrays must hold at least one entry".into(),
        ));
    }
    for (name, len) in [
        ("beta", workers.beta.len()),
        ("wan", workers.wan.len()),
        ("tq", workers.tq.len()),
        ("belief", workers.belief.len()),
    ] {
        if len != w_count {
            return Err(bad(format!(
                "worker array {name} has {len} entries but region has {w_count}"
            )));
        }
    }
    for (i, &r) in workers.region.iter().enumerate() {
        if r as usize >= plan.len() {
            return Err(bad(format!(
                "worker {i}: region {r} has no plan entry (plan covers {} regions)",
                plan.len()
            )));
        }
    }
    for i in 0..w_count {
        check_nonneg("beta", i, workers.beta[i])?;
        check_nonneg("wan", i, workers.wan[i])?;
        check_nonneg("tq", i, workers.tq[i])?;
        let b = workers.belief[i];
        // Written so NaN fails too.
        if !(0.0..=1.0).contains(&b) {
            return Err(bad(format!("worker {i}: belief = {b} must be in [0, 1]")));
        }
    }
    for (name, x) in [("gamma", params.gamma), ("lambda", params.lambda)] {
        if !(x.is_finite() && x >= 0.0) {
            return Err(bad(format!("{name} = {x} must be finite and >= 0")));
        }
    }
    for (r, p) in plan.iter().enumerate() {
        if let Some(&first) = p.first() {
            if first == 0 {
                return Err(bad(format!(
                    "plan[{r}][0] = 0: prefix lengths must be >= 1"
                )));
            }
        }
        for (j, w) in p.windows(2).enumerate() {
            if w[0] >= w[1] {
                return Err(bad(format!(
                    "plan[{r}] is not strictly ascending: plan[{r}][{}] = {} follows {}",
                    j + 1,
                    w[1],
                    w[0]
                )));
            }
        }
    }
    for (ti, t) in tables.iter().enumerate() {
        if t.region as usize >= plan.len() {
            return Err(bad(format!(
                "tables[{ti}]: region {} has no plan entry (plan covers {} regions)",
                t.region,
                plan.len()
            )));
        }
        if t.workers.len() > MAX_TABLE_WORKERS {
            return Err(bad(format!(
                "tables[{ti}] has {} worker fields; a value holds at most {MAX_TABLE_WORKERS}",
                t.workers.len()
            )));
        }
        if let Some((f, &w)) = t
            .workers
            .iter()
            .enumerate()
            .find(|&(_, &w)| w as usize >= w_count)
        {
            return Err(bad(format!(
                "tables[{ti}].workers[{f}] = {w} is not a worker index (W = {w_count})"
            )));
        }
        if t.shards.is_empty() {
            return Err(bad(format!("tables[{ti}] has no shards")));
        }
        if u32::try_from(t.shards.len()).is_err() {
            return Err(bad(format!(
                "tables[{ti}] has {} shards; at most {} are addressable",
                t.shards.len(),
                u32::MAX
            )));
        }
    }
    Ok(w_count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk_hash::{namespace_digest, prefix_keys};
    use proptest::prelude::*;
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// A shard backed by a HashMap that also logs every key it is asked about.
    #[derive(Default, Debug)]
    struct MapShard {
        map: HashMap<u64, u64>,
        log: RefCell<Vec<u64>>,
    }

    impl TierLookup for MapShard {
        fn lookup(&self, key: u64) -> u64 {
            self.log.borrow_mut().push(key);
            self.map.get(&key).copied().unwrap_or(0)
        }
    }

    fn pack(tiers: &[u8]) -> u64 {
        tiers
            .iter()
            .enumerate()
            .fold(0u64, |v, (f, &t)| v | (u64::from(t) << (2 * f)))
    }

    fn key(ns: &[u8; 32], tokens: &[u32], c: u32) -> u64 {
        prefix_keys(ns, tokens, &[c]).unwrap()[0]
    }

    /// A table under construction: owns its shards and worker list.
    struct Tbl {
        region: u32,
        workers: Vec<u32>,
        shards: Vec<MapShard>,
    }

    impl Tbl {
        fn new(region: u32, workers: &[u32], n_shards: usize) -> Self {
            Tbl {
                region,
                workers: workers.to_vec(),
                shards: (0..n_shards).map(|_| MapShard::default()).collect(),
            }
        }
        /// Store `tiers` (one per field) under the key of `tokens[..c]`.
        fn put(&mut self, ns: &[u8; 32], tokens: &[u32], c: u32, tiers: &[u8]) {
            self.put_raw(ns, tokens, c, pack(tiers));
        }
        fn put_raw(&mut self, ns: &[u8; 32], tokens: &[u32], c: u32, v: u64) {
            let k = key(ns, tokens, c);
            let n = self.shards.len() as u64;
            self.shards[(k % n) as usize].map.insert(k, v);
        }
        fn view(&self) -> RouteTable<'_, MapShard> {
            RouteTable {
                region: self.region,
                workers: &self.workers,
                shards: &self.shards,
            }
        }
        fn lookups(&self) -> usize {
            self.shards.iter().map(|s| s.log.borrow().len()).sum()
        }
        fn clear_log(&self) {
            for s in &self.shards {
                s.log.borrow_mut().clear();
            }
        }
    }

    #[derive(Clone)]
    struct Ws {
        region: Vec<u32>,
        beta: Vec<f64>,
        wan: Vec<f64>,
        tq: Vec<f64>,
        belief: Vec<f64>,
    }

    impl Ws {
        /// W workers in region 0, beta 1 ms/token, no WAN or queue delay, full belief.
        fn new(w: usize) -> Self {
            Ws {
                region: vec![0; w],
                beta: vec![1.0; w],
                wan: vec![0.0; w],
                tq: vec![0.0; w],
                belief: vec![1.0; w],
            }
        }
        fn view(&self) -> WorkerArrays<'_> {
            WorkerArrays {
                region: &self.region,
                beta: &self.beta,
                wan: &self.wan,
                tq: &self.tq,
                belief: &self.belief,
            }
        }
    }

    fn params(gamma: f64, lambda: f64, closure: bool) -> ScoreParams {
        ScoreParams {
            gamma,
            lambda,
            closure,
            block: 0,
        }
    }

    fn ns() -> [u8; 32] {
        namespace_digest("llama", "tenant")
    }

    fn prompt() -> Vec<u32> {
        (0..100u32).map(|i| i.wrapping_mul(2654435761)).collect()
    }

    fn plan1() -> Vec<Vec<u32>> {
        vec![vec![16, 32, 64, 128]]
    }

    fn run(
        tbls: &[&Tbl],
        plan: &[Vec<u32>],
        tokens: &[u32],
        ws: &Ws,
        p: ScoreParams,
    ) -> RouteResult {
        let views: Vec<_> = tbls.iter().map(|t| t.view()).collect();
        route(&ns(), tokens, plan, &views, &ws.view(), &p).unwrap()
    }

    /// Table where the given workers hold every planned prefix of the prompt up to `upto`.
    fn holders(fields: &[u32], tiers_upto: &[(u8, u32)]) -> Tbl {
        let (ns, tokens) = (ns(), prompt());
        let mut t = Tbl::new(0, fields, 1);
        for &c in &[16u32, 32, 64] {
            let tiers: Vec<u8> = tiers_upto
                .iter()
                .map(|&(tier, upto)| if c <= upto { tier } else { 0 })
                .collect();
            t.put(&ns, &tokens, c, &tiers);
        }
        t
    }

    #[test]
    fn wan_decides_between_equal_holders() {
        let t = holders(&[0, 1], &[(TIER_VRAM, 64), (TIER_VRAM, 64)]);
        let mut ws = Ws::new(2);
        ws.wan = vec![5.0, 3.0];
        let r = run(&[&t], &plan1(), &prompt(), &ws, params(0.0, 0.0, true));
        assert_eq!(r.matches, vec![64, 64]);
        assert_eq!(r.tiers, vec![TIER_VRAM, TIER_VRAM]);
        assert_eq!(r.scores, vec![5.0 + 36.0, 3.0 + 36.0]);
        assert_eq!((r.winner, r.score), (1, 39.0));
        ws.wan = vec![3.0, 5.0];
        assert_eq!(
            run(&[&t], &plan1(), &prompt(), &ws, params(0.0, 0.0, true)).winner,
            0
        );
    }

    #[test]
    fn queue_decides_and_ties_go_to_lowest_index() {
        let t = holders(&[0, 1], &[(TIER_VRAM, 64), (TIER_VRAM, 64)]);
        let mut ws = Ws::new(2);
        ws.wan = vec![4.0, 4.0];
        ws.tq = vec![10.0, 2.0];
        let r = run(&[&t], &plan1(), &prompt(), &ws, params(0.0, 0.0, true));
        assert_eq!(r.scores, vec![4.0 + 10.0 + 36.0, 4.0 + 2.0 + 36.0]);
        assert_eq!(r.winner, 1);
        ws.tq = vec![2.0, 2.0];
        let r = run(&[&t], &plan1(), &prompt(), &ws, params(0.0, 0.0, true));
        assert_eq!(r.scores[0], r.scores[1]);
        assert_eq!(r.winner, 0);
    }

    #[test]
    fn longer_match_wins() {
        let t = holders(&[0, 1], &[(TIER_VRAM, 32), (TIER_VRAM, 64)]);
        let r = run(
            &[&t],
            &plan1(),
            &prompt(),
            &Ws::new(2),
            params(0.0, 0.0, true),
        );
        assert_eq!(r.matches, vec![32, 64]);
        assert_eq!(r.scores, vec![68.0, 36.0]);
        assert_eq!(r.winner, 1);
    }

    #[test]
    fn dram_reload_cost_flips_the_winner() {
        // Worker 0 holds it in VRAM but is 10 ms further away; worker 1 holds it in DRAM.
        let t = holders(&[0, 1], &[(TIER_VRAM, 64), (TIER_DRAM, 64)]);
        let mut ws = Ws::new(2);
        ws.wan = vec![10.0, 0.0];
        let r = run(&[&t], &plan1(), &prompt(), &ws, params(1.0, 0.0, true));
        assert_eq!(r.tiers, vec![TIER_VRAM, TIER_DRAM]);
        assert_eq!(r.scores, vec![10.0 + 36.0, 36.0 + 64.0]);
        assert_eq!(r.winner, 0);
        let r = run(&[&t], &plan1(), &prompt(), &ws, params(0.125, 0.0, true));
        assert_eq!(r.scores, vec![10.0 + 36.0, 36.0 + 8.0]);
        assert_eq!(r.winner, 1);
    }

    #[test]
    fn lambda_makes_a_far_holder_beat_an_idle_non_holder() {
        // Worker 0 holds 64 of 100 tokens but is 100 ms away; worker 1 is idle and local.
        let t = holders(&[0, 1], &[(TIER_VRAM, 64), (TIER_VRAM, 0)]);
        let mut ws = Ws::new(2);
        ws.wan = vec![100.0, 0.0];
        let r = run(&[&t], &plan1(), &prompt(), &ws, params(0.0, 0.0, true));
        assert_eq!(r.matches, vec![64, 0]);
        assert_eq!(r.scores, vec![100.0 + 36.0, 100.0]);
        assert_eq!(r.winner, 1);
        let r = run(&[&t], &plan1(), &prompt(), &ws, params(0.0, 1.0, true));
        assert_eq!(r.scores, vec![100.0 + 2.0 * 36.0, 2.0 * 100.0]);
        assert_eq!((r.winner, r.score), (0, 172.0));
    }

    #[test]
    fn belief_scales_the_claimed_match() {
        let t = holders(&[0, 1], &[(TIER_DRAM, 64), (TIER_VRAM, 0)]);
        let mut ws = Ws::new(2);
        ws.wan = vec![1.0, 0.0];
        let g = 0.25;
        let r = run(&[&t], &plan1(), &prompt(), &ws, params(g, 0.0, true));
        assert_eq!(r.scores, vec![1.0 + 36.0 + 16.0, 100.0]);
        assert_eq!(r.winner, 0);
        ws.belief[0] = 0.5;
        let r = run(&[&t], &plan1(), &prompt(), &ws, params(g, 0.0, true));
        assert_eq!(r.scores[0], 1.0 + 68.0 + 8.0);
        ws.belief[0] = 0.0;
        let r = run(&[&t], &plan1(), &prompt(), &ws, params(g, 0.0, true));
        // The match is still reported; it just earns nothing (and costs no reload).
        assert_eq!(r.matches[0], 64);
        assert_eq!(r.scores, vec![101.0, 100.0]);
        assert_eq!(r.winner, 1);
    }

    #[test]
    fn closure_discounts_to_longest_consistent_prefix() {
        let (ns, tokens) = (ns(), prompt());
        // Worker 0: hits at 16 and 64, misses 32. Worker 1: misses 16, hits 32 and 64.
        let mut t = Tbl::new(0, &[0, 1], 1);
        t.put(&ns, &tokens, 16, &[TIER_VRAM, 0]);
        t.put(&ns, &tokens, 32, &[0, TIER_VRAM]);
        t.put(&ns, &tokens, 64, &[TIER_DRAM, TIER_VRAM]);
        let ws = Ws::new(2);

        let r = run(&[&t], &plan1(), &tokens, &ws, params(0.0, 0.0, true));
        assert_eq!(r.matches, vec![16, 0]);
        assert_eq!(r.tiers, vec![TIER_VRAM, TIER_ABSENT]);
        // Worker 1 dies at 16, worker 0 at 32: the 64 lookup is never made.
        assert_eq!(t.lookups(), 2);
        t.clear_log();

        let r = run(&[&t], &plan1(), &tokens, &ws, params(0.0, 0.0, false));
        assert_eq!(r.matches, vec![64, 64]);
        assert_eq!(r.tiers, vec![TIER_DRAM, TIER_VRAM]);
        // Both hit at the longest length, so the downward walk stops there.
        assert_eq!(t.lookups(), 1);
    }

    #[test]
    fn reserved_tier_and_foreign_bits_are_ignored() {
        let (ns, tokens) = (ns(), prompt());
        let mut t = Tbl::new(0, &[0, 1], 1);
        // Field 0 = 3 (reserved), field 1 = VRAM, bits beyond field 1 set.
        t.put_raw(&ns, &tokens, 16, 0b01_11 | (u64::MAX << 4));
        let r = run(
            &[&t],
            &plan1(),
            &tokens,
            &Ws::new(2),
            params(0.0, 0.0, false),
        );
        assert_eq!(r.matches, vec![0, 16]);
        assert_eq!(r.tiers, vec![TIER_ABSENT, TIER_VRAM]);
    }

    #[test]
    fn lengths_beyond_the_prompt_are_never_probed() {
        let ns = ns();
        let long: Vec<u32> = (0..200u32).map(|i| i.wrapping_mul(2654435761)).collect();
        let short = &long[..100];
        let mut t = Tbl::new(0, &[0], 1);
        for c in [16u32, 32, 64, 128] {
            t.put(&ns, &long, c, &[TIER_VRAM]);
        }
        let r = run(&[&t], &plan1(), short, &Ws::new(1), params(0.0, 0.0, true));
        assert_eq!(r.matches, vec![64]);
        let log = t.shards[0].log.borrow().clone();
        assert_eq!(log.len(), 3);
        assert!(!log.contains(&NO_KEY));
        assert!(!log.contains(&key(&ns, &long, 128)));
        t.clear_log();

        let r = run(&[&t], &plan1(), &long, &Ws::new(1), params(0.0, 0.0, true));
        assert_eq!(r.matches, vec![128]);

        // Nothing fits: no probes, everyone pays the whole prompt.
        t.clear_log();
        let r = run(
            &[&t],
            &plan1(),
            &long[..10],
            &Ws::new(1),
            params(0.0, 0.0, false),
        );
        assert_eq!((r.matches[0], r.scores[0]), (0, 10.0));
        assert_eq!(t.lookups(), 0);
        let r = run(&[&t], &plan1(), &[], &Ws::new(1), params(0.0, 0.0, false));
        assert_eq!((r.winner, r.score), (0, 0.0));
    }

    #[test]
    fn keys_go_to_shard_key_mod_n() {
        let (ns, tokens) = (ns(), prompt());
        let plan = vec![(1..=100u32).collect::<Vec<_>>()];
        for n in [1usize, 2, 3, 7] {
            let mut t = Tbl::new(0, &[0], n);
            for c in 1..=100u32 {
                t.put(&ns, &tokens, c, &[TIER_VRAM]);
            }
            let r = run(&[&t], &plan, &tokens, &Ws::new(1), params(0.0, 0.0, true));
            assert_eq!(r.matches, vec![100]);
            assert_eq!(t.lookups(), 100);
            for (s, shard) in t.shards.iter().enumerate() {
                let log = shard.log.borrow();
                assert!(
                    log.iter().all(|&k| k % n as u64 == s as u64),
                    "n={n} shard {s}"
                );
                if n > 1 {
                    assert!(
                        !log.is_empty(),
                        "100 keys should reach every one of {n} shards"
                    );
                }
            }
        }
    }

    #[test]
    fn regions_use_their_own_plans_and_duplicates_keep_the_best_claim() {
        let (ns, tokens) = (ns(), prompt());
        let plan = vec![vec![16, 64], vec![8, 32, 99]];
        // Region 0 table: worker 0 holds both lengths in DRAM.
        let mut a = Tbl::new(0, &[0], 2);
        a.put(&ns, &tokens, 16, &[TIER_DRAM]);
        a.put(&ns, &tokens, 64, &[TIER_DRAM]);
        // Region 1 table: worker 1 holds 8, 32, 99; worker 0 also appears and holds 8 and 32.
        let mut b = Tbl::new(1, &[1, 0], 3);
        b.put(&ns, &tokens, 8, &[TIER_VRAM, TIER_VRAM]);
        b.put(&ns, &tokens, 32, &[TIER_VRAM, TIER_VRAM]);
        b.put(&ns, &tokens, 99, &[TIER_VRAM, 0]);
        // A length only region 0 plans is invisible to region 1's table even if stored there.
        b.put(&ns, &tokens, 64, &[TIER_VRAM, TIER_VRAM]);
        let mut ws = Ws::new(2);
        ws.region = vec![0, 1];
        let r = run(&[&a, &b], &plan, &tokens, &ws, params(0.0, 0.0, true));
        assert_eq!(r.matches, vec![64, 99]);
        assert_eq!(r.tiers, vec![TIER_DRAM, TIER_VRAM]);

        // Equal length claims: VRAM beats DRAM whatever the table order.
        let mut c = Tbl::new(0, &[0], 1);
        c.put(&ns, &tokens, 16, &[TIER_VRAM]);
        c.put(&ns, &tokens, 64, &[TIER_VRAM]);
        for order in [[&a, &c], [&c, &a]] {
            let r = run(&order, &plan, &tokens, &ws, params(0.0, 0.0, true));
            assert_eq!((r.matches[0], r.tiers[0]), (64, TIER_VRAM));
        }
        // A field repeated inside one table behaves the same way.
        let mut d = Tbl::new(0, &[0, 0], 1);
        d.put(&ns, &tokens, 16, &[TIER_DRAM, TIER_VRAM]);
        let r = run(&[&d], &plan, &tokens, &ws, params(0.0, 0.0, false));
        assert_eq!((r.matches[0], r.tiers[0]), (16, TIER_VRAM));
    }

    #[test]
    fn full_32_field_table() {
        let (ns, tokens) = (ns(), prompt());
        let fields: Vec<u32> = (0..32).collect();
        let mut t = Tbl::new(0, &fields, 1);
        let mut tiers = vec![TIER_VRAM; 32];
        tiers[31] = TIER_DRAM;
        t.put(&ns, &tokens, 16, &tiers);
        let r = run(
            &[&t],
            &plan1(),
            &tokens,
            &Ws::new(32),
            params(0.0, 0.0, true),
        );
        assert!(r.matches.iter().all(|&m| m == 16));
        assert_eq!(r.tiers[31], TIER_DRAM);
    }

    #[test]
    fn scratch_is_reusable_and_matches_route() {
        let t = holders(&[0, 1], &[(TIER_VRAM, 32), (TIER_DRAM, 64)]);
        let views = [t.view()];
        let ws = Ws::new(3);
        let p = params(0.5, 0.25, true);
        let mut s = RouteScratch::new();
        for tokens in [prompt(), prompt()[..40].to_vec(), prompt()] {
            let w = route_with(&mut s, &ns(), &tokens, &plan1(), &views, &ws.view(), &p, None).unwrap();
            let r = route(&ns(), &tokens, &plan1(), &views, &ws.view(), &p).unwrap();
            assert_eq!((w.winner, w.score), (r.winner, r.score));
            assert_eq!(s.matches(), r.matches.as_slice());
            assert_eq!(s.tiers(), r.tiers.as_slice());
            assert_eq!(s.scores(), r.scores.as_slice());
        }
    }

    fn expect_err(
        plan: &[Vec<u32>],
        tables: &[RouteTable<'_, MapShard>],
        ws: &Ws,
        p: ScoreParams,
        needle: &str,
    ) {
        match route(&ns(), &prompt(), plan, tables, &ws.view(), &p) {
            Err(CoreError::InvalidArgument(m)) => {
                assert!(m.contains(needle), "{m:?} lacks {needle:?}")
            }
            other => panic!("expected InvalidArgument containing {needle:?}, got {other:?}"),
        }
    }

    #[test]
    fn every_validation_error() {
        let shards = [MapShard::default()];
        let ok = RouteTable {
            region: 0,
            workers: &[0, 1],
            shards: &shards,
        };
        let plan = plan1();
        let ws = Ws::new(2);
        let p = params(1.0, 0.5, true);
        assert!(route(&ns(), &prompt(), &plan, &[ok], &ws.view(), &p).is_ok());

        expect_err(&plan, &[], &Ws::new(0), p, "no workers");
        for (name, edit) in [
            (
                "beta",
                (|w: &mut Ws| {
                    w.beta.pop();
                }) as fn(&mut Ws),
            ),
            ("wan", |w| {
                w.wan.push(0.0);
            }),
            ("tq", |w| {
                w.tq.pop();
            }),
            ("belief", |w| {
                w.belief.pop();
            }),
        ] {
            let mut w = ws.clone();
            edit(&mut w);
            expect_err(&plan, &[ok], &w, p, &format!("worker array {name}"));
        }
        let mut w = ws.clone();
        w.region[1] = 1;
        expect_err(&plan, &[ok], &w, p, "worker 1: region 1");
        for bad_x in [-1.0, f64::NAN, f64::INFINITY] {
            let mut w = ws.clone();
            w.beta[1] = bad_x;
            expect_err(&plan, &[ok], &w, p, "worker 1: beta");
            let mut w = ws.clone();
            w.wan[0] = bad_x;
            expect_err(&plan, &[ok], &w, p, "worker 0: wan");
            let mut w = ws.clone();
            w.tq[1] = bad_x;
            expect_err(&plan, &[ok], &w, p, "worker 1: tq");
            expect_err(&plan, &[ok], &ws, params(bad_x, 0.0, true), "gamma");
            expect_err(&plan, &[ok], &ws, params(0.0, bad_x, false), "lambda");
        }
        for bad_b in [-0.1, 1.5, f64::NAN] {
            let mut w = ws.clone();
            w.belief[0] = bad_b;
            expect_err(&plan, &[ok], &w, p, "worker 0: belief");
        }
        expect_err(&[vec![0, 5]], &[ok], &ws, p, "plan[0][0] = 0");
        expect_err(&[vec![4, 8, 8]], &[ok], &ws, p, "plan[0][2] = 8");
        expect_err(&[vec![4, 9, 8]], &[ok], &ws, p, "not strictly ascending");
        let t = RouteTable { region: 1, ..ok };
        expect_err(&plan, &[ok, t], &ws, p, "tables[1]: region 1");
        let many: Vec<u32> = vec![0; 33];
        let t = RouteTable {
            workers: &many,
            ..ok
        };
        expect_err(&plan, &[t], &ws, p, "tables[0] has 33 worker fields");
        let t = RouteTable {
            workers: &[0, 2],
            ..ok
        };
        expect_err(&plan, &[ok, t], &ws, p, "tables[1].workers[1] = 2");
        let t = RouteTable { shards: &[], ..ok };
        expect_err(&plan, &[t], &ws, p, "tables[0] has no shards");
    }

    #[cfg(target_pointer_width = "64")]
    #[test]
    fn too_many_shards_is_an_error() {
        #[derive(Clone, Copy)]
        struct Zst;
        impl TierLookup for Zst {
            fn lookup(&self, _: u64) -> u64 {
                0
            }
        }
        let len = u32::MAX as usize + 1;
        // SAFETY: a slice of a zero-sized type needs no backing memory, only a dangling,
        // aligned pointer, so any length is valid.
        let shards: &[Zst] =
            unsafe { std::slice::from_raw_parts(std::ptr::NonNull::dangling().as_ptr(), len) };
        let t = RouteTable {
            region: 0,
            workers: &[0],
            shards,
        };
        let ws = Ws::new(1);
        let e = route(
            &ns(),
            &prompt(),
            &plan1(),
            &[t],
            &ws.view(),
            &params(0.0, 0.0, true),
        )
        .unwrap_err();
        assert!(matches!(e, CoreError::InvalidArgument(m) if m.contains("addressable")));
    }

    // ---- property tests against a naive reference ----

    #[derive(Debug, Clone)]
    struct Case {
        tokens: Vec<u32>,
        plan: Vec<Vec<u32>>,
        /// (region, fields, shard count, value for each length 1..=MAXLEN)
        tables: Vec<(u32, Vec<u32>, usize, Vec<u64>)>,
        region: Vec<u32>,
        beta: Vec<f64>,
        wan: Vec<f64>,
        tq: Vec<f64>,
        belief: Vec<f64>,
        gamma: f64,
        lambda: f64,
    }

    const MAXLEN: u32 = 24;

    fn tier_strategy() -> impl Strategy<Value = u8> {
        // Mostly hits, so closure chains get long enough to be interesting.
        prop::sample::select(vec![0u8, 1, 1, 1, 2, 2, 2, 3])
    }

    fn case_strategy() -> impl Strategy<Value = Case> {
        (1usize..=6, 1usize..=3).prop_flat_map(|(w, r)| {
            let plan = prop::collection::vec(prop::collection::btree_set(1u32..=MAXLEN, 0..6), r)
                .prop_map(|v| {
                    v.into_iter()
                        .map(|s| s.into_iter().collect::<Vec<_>>())
                        .collect::<Vec<_>>()
                });
            let table = (
                0..r as u32,
                prop::collection::vec(0..w as u32, 0..=5),
                1usize..=3,
                any::<u64>(),
            )
                .prop_flat_map(|(region, fields, shards, junk)| {
                    let nf = fields.len();
                    prop::collection::vec(
                        prop::collection::vec(tier_strategy(), nf),
                        MAXLEN as usize,
                    )
                    .prop_map(move |rows| {
                        // Bits above the table's fields are noise the router must ignore.
                        let hi = if nf == 0 {
                            junk
                        } else {
                            junk.checked_shl(2 * nf as u32).unwrap_or(0)
                        };
                        let vals = rows.iter().map(|row| pack(row) | hi).collect();
                        (region, fields.clone(), shards, vals)
                    })
                });
            let f = |hi: f64| prop::collection::vec(0.0..hi, w);
            (
                prop::collection::vec(any::<u32>(), 0..=(MAXLEN as usize + 4)),
                plan,
                prop::collection::vec(table, 0..=4),
                prop::collection::vec(0..r as u32, w),
                (
                    f(3.0),
                    f(50.0),
                    f(50.0),
                    prop::collection::vec(prop_oneof![Just(0.0), Just(1.0), 0.0..=1.0], w),
                ),
                (0.0..3.0f64, 0.0..3.0f64),
            )
                .prop_map(
                    |(tokens, plan, tables, region, (beta, wan, tq, belief), (gamma, lambda))| {
                        Case {
                            tokens,
                            plan,
                            tables,
                            region,
                            beta,
                            wan,
                            tq,
                            belief,
                            gamma,
                            lambda,
                        }
                    },
                )
        })
    }

    /// Straightforward reference: reads each (table, length) value straight from the case.
    fn naive(case: &Case, closure: bool) -> (Vec<u32>, Vec<u8>, Vec<f64>, usize) {
        let w = case.region.len();
        let l = case.tokens.len();
        let mut m = vec![0u32; w];
        let mut tier = vec![0u8; w];
        for (region, fields, _, vals) in &case.tables {
            let fit: Vec<u32> = case.plan[*region as usize]
                .iter()
                .copied()
                .filter(|&c| c as usize <= l)
                .collect();
            for (f, &wk) in fields.iter().enumerate() {
                let tier_at = |c: u32| {
                    let t = ((vals[c as usize - 1] >> (2 * f)) & 3) as u8;
                    if t == 3 {
                        0
                    } else {
                        t
                    }
                };
                let mut best = (0u32, 0u8);
                for &c in &fit {
                    let t = tier_at(c);
                    if t != 0 {
                        best = (c, t);
                    } else if closure {
                        break;
                    }
                }
                let wk = wk as usize;
                if best.0 > m[wk] || (best.0 == m[wk] && best.0 > 0 && best.1 < tier[wk]) {
                    m[wk] = best.0;
                    tier[wk] = best.1;
                }
            }
        }
        let scores: Vec<f64> = (0..w)
            .map(|i| {
                let (b, mi) = (case.belief[i], m[i] as f64);
                let dram = if tier[i] == TIER_DRAM { 1.0 } else { 0.0 };
                case.wan[i]
                    + case.tq[i]
                    + (1.0 + case.lambda) * case.beta[i] * (l as f64 - b * mi)
                    + case.gamma * b * mi * dram
            })
            .collect();
        let mut win = 0;
        for i in 1..w {
            if scores[i] < scores[win] {
                win = i;
            }
        }
        (m, tier, scores, win)
    }

    fn build(case: &Case) -> Vec<Tbl> {
        let ns = ns();
        case.tables
            .iter()
            .map(|(region, fields, shards, vals)| {
                let mut t = Tbl::new(*region, fields, *shards);
                // Stored under keys of a long prompt sharing the test prompt's prefix, so
                // lengths beyond the prompt exist in the table but must not be found.
                let mut long = case.tokens.clone();
                long.resize(MAXLEN as usize, 7);
                for c in 1..=MAXLEN {
                    t.put_raw(&ns, &long, c, vals[c as usize - 1]);
                }
                t
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn route_matches_naive_reference(case in case_strategy()) {
            let tbls = build(&case);
            let views: Vec<_> = tbls.iter().map(|t| t.view()).collect();
            let ws = WorkerArrays {
                region: &case.region,
                beta: &case.beta,
                wan: &case.wan,
                tq: &case.tq,
                belief: &case.belief,
            };
            for closure in [false, true] {
                let p = ScoreParams { gamma: case.gamma, lambda: case.lambda, closure, block: 0 };
                let r = route(&ns(), &case.tokens, &case.plan, &views, &ws, &p).unwrap();
                let (m, tier, scores, win) = naive(&case, closure);
                prop_assert_eq!(&r.matches, &m);
                prop_assert_eq!(&r.tiers, &tier);
                prop_assert_eq!(&r.scores, &scores);
                prop_assert_eq!(r.winner, win);
                prop_assert_eq!(r.score, scores[win]);
                // Within one region: everyone else matches nothing and scores inf; when each
                // worker's claims are in its own region's tables only (as a layout keeps
                // them: the region of the tables listing it), its workers exactly as above;
                // the keys of its lengths as the full route hashed them.
                let mut full = RouteScratch::new();
                route_with(&mut full, &ns(), &case.tokens, &case.plan, &views, &ws, &p, None).unwrap();
                let mut home: Vec<Option<u32>> = vec![None; case.region.len()];
                let mut consistent = true;
                for (r, fields, _, _) in &case.tables {
                    for &w in fields {
                        consistent &= *home[w as usize].get_or_insert(*r) == *r;
                    }
                }
                let region2: Vec<u32> = home.iter().zip(&case.region).map(|(h, &r)| h.unwrap_or(r)).collect();
                let ws2 = WorkerArrays { region: &region2, ..ws };
                for reg in 0..case.plan.len() as u32 {
                    let mut s = RouteScratch::new();
                    let w1 = route_with(&mut s, &ns(), &case.tokens, &case.plan, &views, &ws2, &p, Some(reg)).unwrap();
                    for w in 0..case.region.len() {
                        if region2[w] == reg {
                            if !consistent {
                                continue;
                            }
                            prop_assert_eq!((s.matches()[w], s.tiers()[w]), (m[w], tier[w]));
                            prop_assert_eq!(s.scores()[w].to_bits(), scores[w].to_bits());
                        } else {
                            prop_assert_eq!((s.matches()[w], s.tiers()[w], s.scores()[w]), (0, TIER_ABSENT, f64::INFINITY));
                        }
                    }
                    prop_assert!(s.scores()[w1.winner] <= s.scores().iter().copied().fold(f64::INFINITY, f64::min));
                    for (c, k) in s.lengths().iter().zip(s.keys()) {
                        let i = full.lengths().binary_search(c).unwrap();
                        prop_assert_eq!(*k, full.keys()[i]);
                    }
                    let mine = fitting(&case.plan[reg as usize], case.tokens.len());
                    prop_assert_eq!(s.lengths(), mine);
                }
                prop_assert!(route_with(&mut full, &ns(), &case.tokens, &case.plan, &views, &ws, &p, Some(case.plan.len() as u32)).is_err());
                for t in &tbls {
                    for (s, shard) in t.shards.iter().enumerate() {
                        let n = t.shards.len() as u64;
                        let log = shard.log.borrow();
                        prop_assert!(log.iter().all(|&k| k % n == s as u64 && k != NO_KEY));
                    }
                    t.clear_log();
                }
            }
        }

        /// Garbage in (bad indices, unsorted plans, NaN, huge values): an answer or an error,
        /// never a panic, and never a NaN score.
        #[test]
        fn never_panics(
            w in 0usize..4,
            plan in prop::collection::vec(prop::collection::vec(0u32..40, 0..5), 0..3),
            tables in prop::collection::vec(
                (0u32..4, prop::collection::vec(0u32..6, 0..40), 0usize..3),
                0..3,
            ),
            regions in prop::collection::vec(0u32..4, 0..5),
            floats in prop::collection::vec(
                prop_oneof![Just(f64::NAN), Just(f64::MAX), Just(-1.0), 0.0..2.0, Just(1e300)],
                4 * 5,
            ),
            gamma in prop_oneof![Just(f64::MAX), Just(f64::NAN), 0.0..2.0],
            lambda in prop_oneof![Just(f64::MAX), Just(f64::INFINITY), 0.0..2.0],
            tokens in prop::collection::vec(any::<u32>(), 0..50),
            closure in any::<bool>(),
        ) {
            let shard_store: Vec<Vec<MapShard>> = tables
                .iter()
                .map(|&(_, _, n)| (0..n).map(|_| MapShard::default()).collect())
                .collect();
            let views: Vec<_> = tables
                .iter()
                .zip(&shard_store)
                .map(|((r, f, _), s)| RouteTable { region: *r, workers: f, shards: s })
                .collect();
            let region: Vec<u32> = regions.iter().copied().take(w).collect();
            let col = |k: usize| -> Vec<f64> { floats[k * 5..k * 5 + w].to_vec() };
            let (beta, wan, tq, belief) = (col(0), col(1), col(2), col(3));
            let ws =
                WorkerArrays { region: &region, beta: &beta, wan: &wan, tq: &tq, belief: &belief };
            let p = ScoreParams { gamma, lambda, closure, block: 0 };
            if let Ok(r) = route(&ns(), &tokens, &plan, &views, &ws, &p) {
                prop_assert!(r.scores.iter().all(|s| !s.is_nan()));
                prop_assert!(r.winner < region.len());
            }
        }
    }
}
