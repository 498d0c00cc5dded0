//! The recency order of the baselines' routing histories, once they evict: keys in the order
//! they were last inserted or touched, oldest first. (SGLang's trees, cut back only once a
//! simulated minute, need none: see `LruBlocks`.)
//!
//! Each touch stamps its key with the next clock and appends `(key, clock)` to a queue; the
//! key's earlier entry is left in place, stale. Telling a stale entry from a live one used to
//! take a probe of the map for the key's current clock, a miss in a table of a million
//! prefixes for every entry the queue dropped or kept: about 40 % of a history's insert. Here a
//! bitmap by clock says which entries are live, so skipping and compacting read bits in
//! order (about one bit per touch, a thousandth of the map's bytes) and the map is probed only
//! for the key that is evicted. The caller hands the key's previous clock back on a touch
//! ([`LruOrder::retire`]): it has just read it from the key's record.

use std::collections::VecDeque;

/// See the module notes.
#[derive(Clone, Debug, Default)]
pub struct LruOrder {
    queue: VecDeque<(u64, u64)>,
    /// Bit `c - base` of the words, in order: the entry stamped `c` is live. A plain vector
    /// (indexing a `VecDeque` wraps, on every touch): words before the oldest queued entry are
    /// dropped in bulk once they are half of it.
    live: Vec<u64>,
    /// The clock of the first word's bit 0 (a multiple of 64).
    base: u64,
    clock: u64,
    /// Live entries (one a key).
    len: usize,
}

impl LruOrder {
    /// The order of `(key, stamp)` pairs stamped by someone else, one a key, with `clock` the
    /// last stamp handed out (at least every stamp here); later pushes continue from it. For a
    /// map that kept only its records' stamps until it first had to evict (a history that never
    /// fills, most runs', never builds a queue).
    pub fn from_stamps(clock: u64, mut entries: Vec<(u64, u64)>) -> Self {
        entries.sort_unstable_by_key(|&(_, c)| c);
        let first = entries.first().map_or(clock + 1, |&(_, c)| c);
        let base = first - first % 64;
        let mut live = vec![0u64; ((clock.max(base) - base) / 64 + 1) as usize];
        for &(_, c) in &entries {
            debug_assert!(c >= 1 && c <= clock, "a stamp past the clock");
            live[((c - base) / 64) as usize] |= 1 << ((c - base) % 64);
        }
        let len = entries.len();
        debug_assert!(entries.windows(2).all(|w| w[0].1 < w[1].1), "stamps repeat");
        LruOrder { queue: entries.into(), live, base, clock, len }
    }

    /// Stamp `key` with the next clock and append it; the clock (the first is 1).
    #[inline]
    pub fn push(&mut self, key: u64) -> u64 {
        self.clock += 1;
        let c = self.clock;
        let w = ((c - self.base) / 64) as usize;
        if w == self.live.len() {
            self.live.push(0);
        }
        self.live[w] |= 1 << ((c - self.base) % 64);
        self.queue.push_back((key, c));
        self.len += 1;
        if self.queue.len() > 2 * self.len + 1024 {
            self.compact();
        }
        c
    }

    /// The entry stamped `clock` is stale (its key was touched again, or is gone).
    #[inline]
    pub fn retire(&mut self, clock: u64) {
        if clock == 0 || clock < self.base || clock > self.clock {
            return;
        }
        let i = clock - self.base;
        let word = &mut self.live[(i / 64) as usize];
        let bit = 1 << (i % 64);
        if *word & bit != 0 {
            *word &= !bit;
            self.len -= 1;
        }
    }

    #[inline]
    fn is_live(&self, clock: u64) -> bool {
        let i = clock - self.base;
        self.live[(i / 64) as usize] >> (i % 64) & 1 != 0
    }

    /// Take the least recently stamped live entry, `(key, clock)`; it is no longer in the order.
    pub fn pop_oldest(&mut self) -> Option<(u64, u64)> {
        while let Some((k, c)) = self.queue.pop_front() {
            if self.is_live(c) {
                self.retire(c);
                self.trim();
                return Some((k, c));
            }
        }
        self.trim();
        None
    }

    /// Live entries.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Drop the words wholly before the oldest queued entry, once they are half the words.
    fn trim(&mut self) {
        let first = self.queue.front().map_or(self.clock + 1, |&(_, c)| c);
        let dead = (((first - self.base) / 64) as usize).min(self.live.len());
        if dead == self.live.len() {
            self.live.clear();
            self.base = first - first % 64;
        } else if dead > 0 && 2 * dead >= self.live.len() {
            self.live.drain(..dead);
            self.base += 64 * dead as u64;
        }
    }

    /// Keep only the live entries, in order.
    fn compact(&mut self) {
        let (live, base) = (&self.live, self.base);
        let v = self.queue.make_contiguous();
        let mut kept = 0;
        for i in 0..v.len() {
            let b = v[i].1 - base;
            if live[(b / 64) as usize] >> (b % 64) & 1 != 0 {
                v[kept] = v[i];
                kept += 1;
            }
        }
        self.queue.truncate(kept);
        self.trim();
    }

    /// Queued entries, stale ones included.
    #[cfg(test)]
    pub fn queued(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        // Against the plain rule (a map of each key's clock; the oldest live entry is the
        // smallest clock in it): any mix of touches and pops takes the same keys in the same
        // order, and the live count is the map's size.
        #[test]
        fn pops_the_least_recently_touched(ops in proptest::collection::vec((0u8..4, 0u64..40), 0..3000)) {
            let mut order = LruOrder::default();
            let mut clocks: HashMap<u64, u64> = HashMap::new();
            for (op, k) in ops {
                if op == 0 {
                    let want = clocks.iter().min_by_key(|(_, &c)| c).map(|(&k, &c)| (k, c));
                    let got = order.pop_oldest();
                    prop_assert_eq!(got, want);
                    if let Some((k, _)) = got {
                        clocks.remove(&k);
                    }
                } else {
                    if let Some(&old) = clocks.get(&k) {
                        order.retire(old);
                    }
                    let c = order.push(k);
                    clocks.insert(k, c);
                }
                prop_assert_eq!(order.len(), clocks.len());
                prop_assert!(order.queued() <= 2 * order.len() + 1025);
            }
        }
    }

    #[test]
    fn compaction_keeps_the_bitmap_short() {
        let mut order = LruOrder::default();
        let mut last = 0;
        for _ in 0..100_000 {
            order.retire(last);
            last = order.push(7);
        }
        assert_eq!(order.len(), 1);
        assert!(order.queued() <= 1025);
        assert!(order.live.len() <= 1025 / 64 + 2, "{} words", order.live.len());
        assert_eq!(order.pop_oldest(), Some((7, last)));
        assert_eq!(order.pop_oldest(), None);
        assert_eq!(order.len(), 0);
    }

    proptest! {
        // An order built from a map's stamps part-way pops, touches and retires as the order
        // that was kept all along.
        #[test]
        fn an_order_from_stamps_continues_as_one_kept_all_along(ops in proptest::collection::vec((0u8..4, 0u64..40), 0..2000), at in 0usize..2000) {
            let mut kept = LruOrder::default();
            let mut stamps: HashMap<u64, u64> = HashMap::new();
            let mut late: Option<LruOrder> = None;
            let mut clock = 0u64;
            for (i, (op, k)) in ops.into_iter().enumerate() {
                if i == at {
                    late = Some(LruOrder::from_stamps(clock, stamps.iter().map(|(&k, &c)| (k, c)).collect()));
                }
                if op == 0 {
                    let got = kept.pop_oldest();
                    if let Some(l) = late.as_mut() {
                        prop_assert_eq!(l.pop_oldest(), got);
                    }
                    if let Some((k, _)) = got {
                        stamps.remove(&k);
                    }
                } else {
                    if let Some(&old) = stamps.get(&k) {
                        kept.retire(old);
                        if let Some(l) = late.as_mut() {
                            l.retire(old);
                        }
                    }
                    let c = kept.push(k);
                    if let Some(l) = late.as_mut() {
                        prop_assert_eq!(l.push(k), c);
                    }
                    clock = c;
                    stamps.insert(k, c);
                }
                if let Some(l) = late.as_ref() {
                    prop_assert_eq!(l.len(), kept.len());
                }
            }
        }
    }
}
