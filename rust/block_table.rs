//! A hash table from block names (`u64`) to small `Copy` records, laid out for the walks the
//! emulated caches make: the keys in one array (a probe run rarely leaves a cache line), the
//! records in another at the same index, and a [`BlockTable::prefetch`] of both for keys known
//! ahead.
//!
//! Why not `hashbrown`: a cache touches, promotes and stores every block of a prompt's chain, a
//! few hundred names known before the walk starts, in tables of millions of blocks that no CPU
//! cache holds. A `hashbrown` lookup reads a control group and then the bucket, two dependent
//! misses, with no way to ask for either early; the simulator spent most of a baseline's run
//! waiting on them. Here a lookup reads a key line and a record line that do not depend on each
//! other, and a walk prefetches both for the names a few steps ahead, so the misses overlap.
//!
//! Open addressing with linear probing at a load of at most 3/4 and backward-shift deletion (no
//! tombstones, so a full cache that evicts as much as it stores keeps a table sized for what it
//! holds). Names are hashes already; a Fibonacci multiply spreads any that are not. The key 0
//! marks an empty slot, so a record named 0 is kept aside.
//!
//! Plain vectors, not [`crate::ludo::mem::HugeBuf`]: these tables grow while a run goes on, and
//! huge pages mapped afresh at every doubling cost more than their TLB misses saved once a
//! process had run a few simulations (the kernel compacts memory to find each 2 MiB page):
//! SkyWalker's run in `bench_sim` was about a quarter slower on them, where the Ludo views,
//! sized once, are a third faster.

use crate::ludo::prefetch;

const FIB: u64 = 0x9E37_79B9_7F4A_7C15;

/// A table's key: a name of 64 bits, or of 32 where a record's own fields tell names that share
/// their bits apart (the agent forest's fingerprint index: 8 bytes a slot, not 12).
/// 0 marks an empty slot.
pub trait SlotKey: Copy + Eq + Default + std::fmt::Debug {
    fn wide(self) -> u64;
}

impl SlotKey for u64 {
    #[inline(always)]
    fn wide(self) -> u64 {
        self
    }
}

impl SlotKey for u32 {
    #[inline(always)]
    fn wide(self) -> u64 {
        u64::from(self)
    }
}

/// See the module notes.
#[derive(Clone, Debug)]
pub struct BlockTable<V: Copy + Default, K: SlotKey = u64> {
    keys: Vec<K>,
    vals: Vec<V>,
    /// `64 - log2(keys.len())`: the multiply's top bits are the home slot.
    shift: u32,
    len: usize,
    zero: Option<V>,
}

impl<V: Copy + Default, K: SlotKey> Default for BlockTable<V, K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V: Copy + Default, K: SlotKey> BlockTable<V, K> {
    pub fn new() -> Self {
        BlockTable { keys: Vec::new(), vals: Vec::new(), shift: 64, len: 0, zero: None }
    }

    #[inline]
    fn home(&self, key: K) -> usize {
        (key.wide().wrapping_mul(FIB) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.keys.len() - 1
    }

    /// The slot holding `key` (not 0), if any.
    #[inline]
    fn find(&self, key: K) -> Option<usize> {
        if self.keys.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let k = self.keys[i];
            if k == key {
                return Some(i);
            }
            if k == K::default() {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    /// Ask the CPU for `key`'s home slot now, for a lookup a few steps later.
    #[inline(always)]
    pub fn prefetch(&self, key: K) {
        if !self.keys.is_empty() {
            let i = self.home(key);
            prefetch(&self.keys, i);
            prefetch(&self.vals, i);
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Slots allocated (for memory accounting).
    pub fn capacity(&self) -> usize {
        self.keys.len()
    }

    /// Bytes of one slot (a key and a record).
    pub const SLOT_BYTES: usize = std::mem::size_of::<K>() + std::mem::size_of::<V>();

    #[inline]
    pub fn get(&self, key: &K) -> Option<&V> {
        if *key == K::default() {
            return self.zero.as_ref();
        }
        self.find(*key).map(|i| &self.vals[i])
    }

    #[inline]
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        if *key == K::default() {
            return self.zero.as_mut();
        }
        self.find(*key).map(move |i| &mut self.vals[i])
    }

    pub fn contains_key(&self, key: &K) -> bool {
        self.get(key).is_some()
    }

    /// Insert or replace; the previous record, if any.
    pub fn insert(&mut self, key: K, val: V) -> Option<V> {
        if key == K::default() {
            let old = self.zero.take();
            self.zero = Some(val);
            if old.is_none() {
                self.len += 1;
            }
            return old;
        }
        let (i, was) = self.claim(key);
        let old = std::mem::replace(&mut self.vals[i], val);
        was.then_some(old)
    }

    /// The record of `key`, a `V::default()` put in first when it is absent: one probe where a
    /// `get` and then an `insert` of the changed copy made two, for the walks that update a
    /// prompt's every block. Grows exactly when [`Self::insert`] would.
    pub fn entry_or_default(&mut self, key: K) -> &mut V {
        if key == K::default() {
            if self.zero.is_none() {
                self.zero = Some(V::default());
                self.len += 1;
            }
            return self.zero.as_mut().expect("just set");
        }
        let (i, _) = self.claim(key);
        &mut self.vals[i]
    }

    /// The slot of `key` (not 0), taken for it with a default record when it is absent (the
    /// table grown first if one more key would pass three quarters), and whether it was there.
    fn claim(&mut self, key: K) -> (usize, bool) {
        if (self.len + 1) * 4 > self.keys.len() * 3 {
            self.grow();
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let k = self.keys[i];
            if k == key {
                return (i, true);
            }
            if k == K::default() {
                self.keys[i] = key;
                self.vals[i] = V::default();
                self.len += 1;
                return (i, false);
            }
            i = (i + 1) & mask;
        }
    }

    /// Remove `key`; its record, if it was there.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        if *key == K::default() {
            let old = self.zero.take();
            if old.is_some() {
                self.len -= 1;
            }
            return old;
        }
        let mut i = self.find(*key)?;
        let val = self.vals[i];
        self.len -= 1;
        // Backward shift: pull later members of the probe run into the hole when the hole lies
        // on their way from home, so every key stays reachable without tombstones.
        let mask = self.mask();
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let k = self.keys[j];
            if k == K::default() {
                break;
            }
            let h = self.home(k);
            // Does j's home lie cyclically in (i, j]? Then j stays put.
            let stays = if i <= j { i < h && h <= j } else { i < h || h <= j };
            if !stays {
                self.keys[i] = k;
                self.vals[i] = self.vals[j];
                i = j;
            }
        }
        self.keys[i] = K::default();
        Some(val)
    }

    pub fn clear(&mut self) {
        *self = Self::new();
    }

    /// Every `(key, record)`, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (K, &V)> {
        self.zero.iter().map(|v| (K::default(), v)).chain(self.keys.iter().zip(&self.vals).filter(|(k, _)| **k != K::default()).map(|(k, v)| (*k, v)))
    }

    fn grow(&mut self) {
        let n = (self.keys.len() * 2).max(16);
        let keys = std::mem::replace(&mut self.keys, vec![K::default(); n]);
        let vals = std::mem::replace(&mut self.vals, vec![V::default(); n]);
        self.shift = 64 - n.trailing_zeros();
        let mask = n - 1;
        for (k, v) in keys.into_iter().zip(vals).filter(|(k, _)| *k != K::default()) {
            let mut i = self.home(k);
            while self.keys[i] != K::default() {
                i = (i + 1) & mask;
            }
            self.keys[i] = k;
            self.vals[i] = v;
        }
    }
}

impl<V: Copy + Default, K: SlotKey> std::ops::Index<&K> for BlockTable<V, K> {
    type Output = V;
    fn index(&self, key: &K) -> &V {
        self.get(key).expect("key in the block table")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// Any sequence of inserts (kind 0), removes (1) and in-place updates through
    /// `entry_or_default` (2: add `v`) of `keys` leaves `t` holding what std's map does, every
    /// key findable and listed once.
    fn check_as_map<K: SlotKey + std::hash::Hash + Ord>(ops: Vec<(u8, K, u32)>) -> Result<(), TestCaseError> {
        let mut t: BlockTable<u32, K> = BlockTable::new();
        let mut m: HashMap<K, u32> = HashMap::new();
        for (kind, key, v) in ops {
            match kind % 3 {
                0 => prop_assert_eq!(t.insert(key, v), m.insert(key, v)),
                1 => prop_assert_eq!(t.remove(&key), m.remove(&key)),
                _ => {
                    let e = t.entry_or_default(key);
                    *e = e.wrapping_add(v);
                    let want = m.entry(key).or_default();
                    *want = want.wrapping_add(v);
                    prop_assert_eq!(*e, *want);
                }
            }
            prop_assert_eq!(t.len(), m.len());
        }
        for (k, v) in &m {
            prop_assert_eq!(t.get(k), Some(v));
        }
        let mut got: Vec<(K, u32)> = t.iter().map(|(k, v)| (k, *v)).collect();
        got.sort_unstable();
        let mut want: Vec<(K, u32)> = m.into_iter().collect();
        want.sort_unstable();
        prop_assert_eq!(got, want);
        Ok(())
    }

    proptest! {
        // Small keys (0 included) multiplied out so several share a home slot and runs wrap.
        #[test]
        fn behaves_as_a_map(ops in proptest::collection::vec((any::<u8>(), 0u64..64, any::<u32>()), 0..400)) {
            check_as_map(ops.into_iter().map(|(i, k, v)| (i, k.wrapping_mul(0x1000_0000_0000_0001), v)).collect())?;
        }

        // The same with 32-bit keys (the forest's fingerprint index): 8-byte slots.
        #[test]
        fn behaves_as_a_map_with_narrow_keys(ops in proptest::collection::vec((any::<u8>(), 0u32..64, any::<u32>()), 0..400)) {
            check_as_map(ops.into_iter().map(|(i, k, v)| (i, k.wrapping_mul(0x1000_0001), v)).collect())?;
            prop_assert_eq!(BlockTable::<u32, u32>::SLOT_BYTES, 8);
        }
    }

    /// A table of a million slots (past the caches, as the baselines' histories grow):
    /// growth, lookups, removals and a clone behave as on small tables.
    #[test]
    fn a_large_table_behaves_as_a_small_one() {
        let mut t: BlockTable<u32> = BlockTable::new();
        let n = 700_000u64; // 1 M slots: 8 MiB of keys, 4 MiB of records
        for k in 1..=n {
            assert_eq!(t.insert(k.wrapping_mul(0x9E37_79B9_7F4A_7C15), k as u32), None);
        }
        assert!(t.capacity() >= 1 << 20);
        for k in (1..=n).step_by(2) {
            assert_eq!(t.remove(&k.wrapping_mul(0x9E37_79B9_7F4A_7C15)), Some(k as u32));
        }
        let c = t.clone();
        for k in 1..=n {
            let want = (k % 2 == 0).then_some(k as u32);
            assert_eq!(t.get(&k.wrapping_mul(0x9E37_79B9_7F4A_7C15)).copied(), want);
            assert_eq!(c.get(&k.wrapping_mul(0x9E37_79B9_7F4A_7C15)).copied(), want);
        }
        assert_eq!((t.len(), c.len(), c.iter().count()), (n as usize / 2, n as usize / 2, n as usize / 2));
    }

    #[test]
    fn load_stays_at_most_three_quarters() {
        let mut t: BlockTable<u64> = BlockTable::new();
        for k in 1..=10_000u64 {
            t.insert(k, k);
            assert!(t.len() * 4 <= t.capacity() * 3);
        }
        for k in 1..=10_000u64 {
            assert_eq!(t.remove(&k), Some(k));
        }
        assert!(t.is_empty());
        assert_eq!(t.iter().count(), 0);
    }
}
