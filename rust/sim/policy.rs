//! The baselines the simulator compares KVCompass with, run inside the engine (they exist only
//! in the simulator; `kvcompass/sim/schemes.py` documents what each models and simplifies, and
//! builds the static parts: rings, finger tables, pools). Every choice is the one the Python
//! implementation made before them, draw for draw (the pinned runs check it): the keys that
//! place a prompt on a ring are the same 64-bit values (`_prefix_hashes`, `_h64` as BLAKE2b-64
//! of the Python `repr` of its arguments), ties are drawn from the run's PCG64 stream in the
//! same order, and routing histories evict in the same LRU order. Where a key only has to
//! name a prefix (routing histories), the engine's block chain of the prompt serves.

use std::collections::VecDeque;

use blake2::digest::{Update, VariableOutput};
use blake2::Blake2bVar;
use rustc_hash::FxHashMap;

use super::{Choice, Engine};
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

/// `schemes._prefix_hashes`: one 64-bit hash per whole-block prefix of `tokens`.
fn prefix_hashes(tokens: &[u32], block: usize, salt: Option<u64>) -> Vec<u64> {
    let n = tokens.len() / block;
    let coef: Vec<u64> = (1..=block as u64).map(|j| fin(j.wrapping_mul(GOLD))).collect();
    let mut acc = 0u64;
    let mut out = Vec::with_capacity(n);
    for (i, row) in tokens[..n * block].chunks_exact(block).enumerate() {
        let mut s = 0u64;
        for (t, c) in row.iter().zip(&coef) {
            s = s.wrapping_add((*t as u64).wrapping_mul(*c));
        }
        acc = acc.wrapping_add(fin(s.wrapping_add((i as u64).wrapping_mul(GOLD))));
        let v = fin(acc);
        out.push(match salt {
            Some(x) => fin(v ^ x),
            None => v,
        });
    }
    out
}

/// `schemes._level_key`: `(level index, key)` of the longest level that fits the prompt.
fn level_key(levels: &[u64], tokens: &[u32], block: usize, salts: &Salts, salt: u32) -> (usize, u64) {
    let len = tokens.len() as u64;
    let level = levels.iter().rposition(|&c| c <= len).unwrap_or(0);
    let n = if levels.is_empty() { tokens.len() } else { len.min(levels[level]) as usize };
    let salt_h = if salt == 0 { None } else { Some(salts.h64[salt as usize]) };
    let ph = prefix_hashes(&tokens[..n], block, salt_h);
    let key = match ph.last() {
        Some(&k) => k,
        None => {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            let salt_repr = if salt == 0 { "None" } else { salts.repr[salt as usize].as_str() };
            h64(&format!("('short', {salt_repr}, {})", bytes_repr(&bytes)))
        }
    };
    (level, h64(&format!("({level}, {key})")))
}

/// A region balancer's routing history (`schemes._History`): prefix -> workers it was sent to,
/// at most `capacity` prefixes, least recently inserted-or-touched evicted first.
#[derive(Clone, Debug)]
pub struct History {
    map: FxHashMap<u64, (Vec<u32>, u64)>,
    order: VecDeque<(u64, u64)>,
    clock: u64,
    capacity: usize,
}

impl History {
    pub fn new(capacity: usize) -> Self {
        History { map: FxHashMap::default(), order: VecDeque::new(), clock: 0, capacity }
    }

    /// `(blocks, holders)` of the longest routed prefix, walked from the root.
    fn matched(&self, hashes: &[u64]) -> (usize, &[u32]) {
        let mut best: &[u32] = &[];
        let mut n = 0;
        for h in hashes {
            match self.map.get(h) {
                Some((s, _)) if !s.is_empty() => {
                    best = s;
                    n += 1;
                }
                _ => break,
            }
        }
        (n, best)
    }

    fn insert(&mut self, hashes: &[u64], worker: u32) {
        for &h in hashes {
            self.clock += 1;
            let c = self.clock;
            let e = self.map.entry(h).or_insert_with(|| (Vec::new(), 0));
            if !e.0.contains(&worker) {
                e.0.push(worker);
            }
            e.1 = c;
            self.order.push_back((h, c));
        }
        while self.map.len() > self.capacity {
            let (h, c) = self.order.pop_front().expect("every entry is in the order queue");
            if self.map.get(&h).is_some_and(|e| e.1 == c) {
                self.map.remove(&h);
            }
        }
        if self.order.len() > 2 * self.map.len() + 1024 {
            let map = &self.map;
            self.order.retain(|(h, c)| map.get(h).is_some_and(|e| e.1 == *c));
        }
    }
}

/// The static state of each baseline (built by `kvcompass.sim.schemes`).
#[derive(Clone, Debug)]
pub enum Baseline {
    ConsistentHash { levels: Vec<u64>, rings: Vec<(Vec<u64>, Vec<u32>)> },
    Chord { levels: Vec<u64>, ids: Vec<u64>, nodes: Vec<u32>, regions: Vec<u16>, fingers: Vec<Vec<u32>>, entry: Vec<Option<u32>> },
    CentralDirectory { workers: Vec<u32>, beta: Vec<f64>, coordinator: u16, wan_fraction: f64, lambda_max: f64, tau_ms: f64, gamma: f64, tie_ms: f64 },
    PlanetServe { pools: Vec<Vec<u32>>, trees: Vec<History> },
    SkyWalker { pools: Vec<Vec<u32>>, trees: Vec<History>, remote: Vec<Vec<u16>>, region_of: Vec<u16> },
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
                None => x.dispatched.iter().fold(0.0, |a, (_, v)| a + v),
                Some(o) => x.dispatched.iter().find(|(r, _)| *r == o).map_or(0.0, |(_, v)| *v),
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

    /// Chord's recursive lookup of `key` from region `origin`: `(owner node, hops, delay_ms)`.
    pub(super) fn chord_route(&self, b: &Baseline, origin: u16, key: u64) -> (usize, u32, f64) {
        let Baseline::Chord { ids, regions, fingers, entry, .. } = b else { return (0, 0, 0.0) };
        let n = ids.len();
        let entry = match entry[origin as usize] {
            Some(e) => e as usize,
            None => (0..n).min_by(|&i, &j| self.rtt(origin, regions[i]).partial_cmp(&self.rtt(origin, regions[j])).unwrap_or(std::cmp::Ordering::Equal).then(i.cmp(&j))).unwrap_or(0),
        };
        let mut delay = self.rtt(origin, regions[entry]) / 2.0;
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
            delay += self.rtt(regions[cur], regions[nxt]) / 2.0;
            cur = nxt;
            hops += 1;
        }
        delay += self.rtt(regions[cur], origin) / 2.0;
        (owner, hops, delay)
    }

    /// `schemes._prefix_pick`: the least-loaded of `pool` holding the longest routed prefix.
    fn prefix_pick(&mut self, tree: &History, chain: &[u64], pool: &[u32], origin: u16) -> Option<(u32, i64)> {
        let (n, holders) = tree.matched(chain);
        let cand: Vec<u32> = pool.iter().copied().filter(|w| holders.contains(w)).collect();
        if n == 0 || cand.is_empty() {
            return None;
        }
        Some((self.least_loaded(&cand, Some(origin)), (n * self.block_size) as i64))
    }

    /// The baseline's choice for request `req`, whose tokens and chain are `tokens`, `chain`.
    pub(super) fn choose_baseline(&mut self, b: &mut Baseline, req: u32, tokens: &[u32], chain: &[u64]) -> Result<Choice> {
        let r = self.reqs[req as usize];
        let block = self.block_size;
        let done = |worker: u32, claimed: i64, delay_ms: f64| Ok(Choice { worker, claimed, delay_ms });
        match b {
            Baseline::ConsistentHash { levels, rings } => {
                let (level, key) = level_key(levels, tokens, block, &self.salts, r.salt);
                let (pos, owner) = &rings[level];
                let i = pos.partition_point(|&p| p < key);
                done(owner[i % owner.len()], 0, 0.0)
            }
            Baseline::Chord { levels, nodes, .. } => {
                let (_, key) = level_key(levels, tokens, block, &self.salts, r.salt);
                let nodes = nodes.clone();
                let (owner, _, delay) = self.chord_route(b, r.region, key);
                done(nodes[owner], 0, delay)
            }
            Baseline::CentralDirectory { workers, beta, coordinator, wan_fraction, lambda_max, tau_ms, gamma, tie_ms } => {
                let delay = self.rtt(r.region, *coordinator);
                let l = tokens.len() as u64;
                let mut q = Vec::with_capacity(workers.len());
                let mut least = f64::INFINITY;
                for &w in workers.iter() {
                    let x = &self.workers[w as usize];
                    let v = self.queued(x, self.now) + x.dispatched.iter().fold(0.0, |a, (_, v)| a + v);
                    least = least.min(v);
                    q.push(v);
                }
                let lam = lambda_max.min(least / *tau_ms);
                let mut hits = Vec::with_capacity(workers.len());
                let mut scores = Vec::with_capacity(workers.len());
                let mut best = f64::INFINITY;
                for (i, &w) in workers.iter().enumerate() {
                    let x = &self.workers[w as usize];
                    let (v, d) = lookup_base_tokens(&x.cache, chain);
                    let s = *wan_fraction * self.rtt(r.region, x.region) + q[i] + (1.0 + lam) * beta[i] * l.saturating_sub(v + d) as f64 + *gamma * d as f64;
                    best = best.min(s);
                    hits.push((v, d));
                    scores.push(s);
                }
                let cand: Vec<usize> = (0..workers.len()).filter(|&i| scores[i] <= best + *tie_ms).collect();
                let i = if cand.len() > 1 { cand[self.rng.integers(cand.len() as u64) as usize] } else { cand[0] };
                let (v, d) = hits[i];
                done(workers[i], l.min(v + d) as i64, delay)
            }
            Baseline::PlanetServe { pools, trees } => {
                let region = r.region as usize;
                let pool = std::mem::take(&mut pools[region]);
                let picked = self.prefix_pick(&trees[region], chain, &pool, r.region);
                let (worker, claimed) = match picked {
                    Some(p) => p,
                    None => (self.least_loaded(&pool, Some(r.region)), 0),
                };
                pools[region] = pool;
                trees[region].insert(chain, worker);
                done(worker, claimed, 0.0)
            }
            Baseline::SkyWalker { pools, trees, remote, region_of } => {
                let region = r.region as usize;
                let local = pools[region].clone();
                let picked = if local.is_empty() { None } else { self.prefix_pick(&trees[region], chain, &local, r.region) };
                let waiting = |e: &Engine, w: u32| e.workers[w as usize].waiting.len();
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
                            return Err(CoreError::InvalidArgument(format!("request {req} (in arrival order): its region has no workers and no remote replica is free: skywalker cannot serve it")));
                        }
                    }
                }
                let worker = worker.expect("set above");
                let wr = region_of[worker as usize] as usize;
                if claimed == 0 && Some(worker) != holder {
                    let (n, holders) = trees[wr].matched(chain);
                    claimed = if holders.contains(&worker) { (n * block) as i64 } else { 0 };
                }
                trees[wr].insert(chain, worker);
                done(worker, claimed, 0.0)
            }
        }
    }
}

/// `(vram, dram)` hit tokens of `cache` for the seed-free chain `base`.
fn lookup_base_tokens(cache: &crate::block_cache::BlockCache, base: &[u64]) -> (u64, u64) {
    let (v, d) = cache.lookup_base(base);
    let b = cache.block_size() as u64;
    (v as u64 * b, d as u64 * b)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(h.matched(&[1]), (1, &[0u32, 1][..]));
        assert_eq!(h.matched(&[3]).0, 1);
    }
}
