//! Test-only: the emulated cache's policy computed the slow, obvious way, as the specification
//! the radix-of-runs [`super::BlockCache`] is checked against (the differential proptest).
//!
//! One record per block in a map; a victim is found by scanning every block for the leaves of a
//! tier (VRAM: in VRAM with no child in VRAM; DRAM: in DRAM with no child at all) and taking
//! the least `(uses if LFU else 0, last use, stamp)`, skipping the blocks the call pins. No heap,
//! no runs, no counters kept in step: quadratic, and plainly the rules of the module notes.

use std::collections::HashMap;

use super::{BlockInfo, Event, Stats, DRAM, VRAM};

/// The tier of a block a call is lifting out of DRAM: in neither tier until room is made.
const LIFTING: u8 = 0;

struct Rec {
    parent: Option<u64>,
    pos: u32,
    tier: u8,
    uses: u64,
    last: f64,
    stamp: u64,
    born: u64,
    salt: u32,
    toks: Vec<u32>,
}

pub struct Oracle {
    bs: usize,
    cap: [usize; 3],
    lfu: bool,
    recs: HashMap<u64, Rec>,
    stamp: u64,
    born: u64,
    pub stats: Stats,
}

#[derive(Default)]
struct Moves {
    cpu_stored: Vec<u64>,
    gpu_removed: Vec<u64>,
    cpu_removed: Vec<u64>,
}

impl Oracle {
    pub fn new(bs: usize, vram: usize, dram: usize, lfu: bool) -> Self {
        Oracle { bs, cap: [0, vram, dram], lfu, recs: HashMap::new(), stamp: 0, born: 0, stats: Stats::default() }
    }

    pub fn len(&self) -> usize {
        self.recs.len()
    }

    pub fn used(&self, tier: u8) -> usize {
        self.recs.values().filter(|r| r.tier == tier).count()
    }

    pub fn lookup(&self, chain: &[u64]) -> (usize, usize) {
        let k = chain.iter().take_while(|h| self.recs.contains_key(h)).count();
        let v = chain[..k].iter().take_while(|h| self.recs[h].tier == VRAM).count();
        (v, k - v)
    }

    pub fn blocks(&self) -> Vec<BlockInfo> {
        let mut v: Vec<(&u64, &Rec)> = self.recs.iter().collect();
        v.sort_by_key(|(_, r)| r.born);
        v.into_iter().map(|(&h, r)| BlockInfo { hash: h, parent: r.parent, position: r.pos, tier: r.tier, uses: r.uses, last: r.last }).collect()
    }

    pub fn clear(&mut self) {
        self.recs.clear();
        self.stats.clears += 1;
    }

    fn is_leaf(&self, h: u64, tier: u8) -> bool {
        self.recs[&h].tier == tier && !self.recs.values().any(|c| c.parent == Some(h) && (tier == DRAM || c.tier == VRAM))
    }

    fn victim(&self, tier: u8, pinned: impl Fn(u64, &Rec) -> bool) -> u64 {
        let key = |r: &Rec| (if self.lfu { r.uses } else { 0 }, r.last, r.stamp);
        self.recs
            .iter()
            .filter(|(&h, r)| self.is_leaf(h, tier) && !pinned(h, r))
            .min_by(|a, b| {
                let (ka, kb) = (key(a.1), key(b.1));
                ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1)).then(ka.2.cmp(&kb.2))
            })
            .map(|(&h, _)| h)
            .expect("a full tier has a leaf")
    }

    fn drop_block(&mut self, h: u64, m: &mut Moves) {
        let r = self.recs.remove(&h).expect("victim");
        self.stats.evicted_blocks += 1;
        if r.tier == DRAM {
            m.cpu_removed.push(h);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn add(&mut self, h: u64, parent: Option<u64>, i: usize, tier: u8, now: f64, salt: u32, tokens: &[u32]) {
        self.stamp += 1;
        self.born += 1;
        let toks = tokens[i * self.bs..(i + 1) * self.bs].to_vec();
        self.recs.insert(h, Rec { parent, pos: i as u32, tier, uses: 1, last: now, stamp: self.stamp, born: self.born, salt: if parent.is_none() { salt } else { 0 }, toks });
        self.stats.stored_blocks += 1;
    }

    fn stored(&self, hashes: &[u64], medium: u8) -> Event {
        let first = &self.recs[&hashes[0]];
        let tokens = hashes.iter().flat_map(|h| self.recs[h].toks.iter().copied()).collect();
        Event::Stored { medium, hashes: hashes.to_vec(), parent: first.parent, tokens, salt: if first.parent.is_none() { first.salt } else { 0 } }
    }

    fn events(&self, m: &Moves) -> Vec<Event> {
        let mut out = Vec::new();
        let mut stored: Vec<u64> = m.cpu_stored.iter().copied().filter(|h| !m.cpu_removed.contains(h)).collect();
        stored.sort_by_key(|h| self.recs[h].pos);
        let mut runs: Vec<Vec<u64>> = Vec::new();
        for h in stored {
            let p = self.recs[&h].parent;
            match runs.iter_mut().find(|r| p.is_some() && r.last().copied() == p) {
                Some(r) => r.push(h),
                None => runs.push(vec![h]),
            }
        }
        out.extend(runs.iter().map(|r| self.stored(r, DRAM)));
        if !m.gpu_removed.is_empty() {
            out.push(Event::Removed { medium: VRAM, hashes: m.gpu_removed.clone() });
        }
        let gone: Vec<u64> = m.cpu_removed.iter().copied().filter(|h| !m.cpu_stored.contains(h)).collect();
        if !gone.is_empty() {
            out.push(Event::Removed { medium: DRAM, hashes: gone });
        }
        out
    }

    pub fn place_vram(&mut self, tokens: &[u32], chain: &[u64], now: f64, salt: u32, request: bool) -> Vec<Event> {
        let (v, d) = self.lookup(chain);
        let (n, k) = (chain.len(), v + d);
        if request {
            self.stats.admits += 1;
            self.stats.prompt_tokens += tokens.len() as u64;
            self.stats.vram_hit_tokens += (v * self.bs) as u64;
            self.stats.dram_hit_tokens += (d * self.bs) as u64;
        } else {
            self.stats.copies += 1;
        }
        let n_cap = n.min(self.cap[1]);
        self.stats.truncated_blocks += (n - n_cap) as u64;
        if n_cap == 0 {
            return Vec::new();
        }
        let kept = k.min(n_cap);
        let before = self.stamp;
        for h in &chain[..kept] {
            self.stamp += 1;
            let r = self.recs.get_mut(h).expect("cached");
            r.uses += 1;
            r.last = now;
            r.stamp = self.stamp;
        }
        let lifted: Vec<u64> = if v < kept { chain[v..kept].to_vec() } else { Vec::new() };
        for h in &lifted {
            self.recs.get_mut(h).expect("cached").tier = LIFTING;
        }
        let mut m = Moves::default();
        self.demote_for(n_cap as i64 - v as i64, |_, r| r.stamp > before, &mut m);
        for h in &lifted {
            self.recs.get_mut(h).expect("lifted").tier = VRAM;
        }
        self.stats.promoted_blocks += lifted.len() as u64;
        for i in kept..n_cap {
            self.add(chain[i], if i > 0 { Some(chain[i - 1]) } else { None }, i, VRAM, now, salt, tokens);
        }
        let mut out = self.events(&m);
        if n_cap > v {
            out.push(self.stored(&chain[v..n_cap], VRAM));
        }
        if !lifted.is_empty() {
            out.push(Event::Removed { medium: DRAM, hashes: lifted });
        }
        out
    }

    /// VRAM victims demoted (or dropped without DRAM) until `needed` more blocks fit.
    fn demote_for(
        &mut self,
        needed: i64,
        pinned: impl Fn(u64, &Rec) -> bool + Copy,
        m: &mut Moves,
    ) {
        while self.used(VRAM) as i64 + needed > self.cap[1] as i64 {
            let h = self.victim(VRAM, pinned);
            m.gpu_removed.push(h);
            if self.cap[2] == 0 {
                self.drop_block(h, m);
                continue;
            }
            if self.used(DRAM) >= self.cap[2] {
                let x = self.victim(DRAM, |_, _| false);
                self.drop_block(x, m);
            }
            self.recs.get_mut(&h).expect("victim").tier = DRAM;
            self.stats.demoted_blocks += 1;
            m.cpu_stored.push(h);
        }
    }

    pub fn set_vram_capacity(&mut self, blocks: usize) -> Vec<Event> {
        self.cap[1] = blocks;
        let mut m = Moves::default();
        self.demote_for(0, |_, _| false, &mut m);
        self.events(&m)
    }

    pub fn place_dram(&mut self, tokens: &[u32], chain: &[u64], now: f64, salt: u32) -> Vec<Event> {
        self.stats.copies += 1;
        let (v, d) = self.lookup(chain);
        let (n, k) = (chain.len(), v + d);
        let m_new = (n - k).min(self.cap[2] - d);
        self.stats.truncated_blocks += (n - k - m_new) as u64;
        if m_new == 0 {
            return Vec::new();
        }
        let mut m = Moves::default();
        let prefix: Vec<u64> = chain[..k].to_vec();
        while self.used(DRAM) + m_new > self.cap[2] {
            let x = self.victim(DRAM, |h, _| prefix.contains(&h));
            self.drop_block(x, &mut m);
        }
        for i in k..k + m_new {
            self.add(chain[i], if i > 0 { Some(chain[i - 1]) } else { None }, i, DRAM, now, salt, tokens);
        }
        let mut out = self.events(&m);
        out.push(self.stored(&chain[k..k + m_new], DRAM));
        out
    }
}
