//! A memo of prefix hashing states, so a prefix the process has hashed before costs a fast
//! fingerprint instead of SHA-256.
//!
//! A route hashes its prompt at every plan length (one SHA-256 pass over the longest that fits,
//! [`crate::chunk_hash::prefix_keys_into`]): about 18 µs for 4,096 tokens on the development
//! host, half of a route's time on long prompts. Prompts share their prefixes (system prompts,
//! documents, a conversation's history) and a route's own hand-off or retry hashes the same
//! prompt again, so most of that work was done before. The memo keeps, per hashed prefix, its
//! key and the hashing state after it, under a 128-bit xxh3 fingerprint of (namespace digest,
//! tokens); a route fingerprints its prompt at every plan length (xxh3 runs an order of
//! magnitude faster than SHA-256), takes every length it finds, and hashes from the longest
//! state found onward only what it did not.
//!
//! The keys are exactly [`crate::chunk_hash::prefix_keys_into`]'s (tested against it): a hit
//! replays a state computed from the same bytes. Two different prefixes with one fingerprint
//! would share a key; the fingerprint is seeded per process from the OS's randomness, so no one
//! can build such a pair offline, and a chance collision of 128 bits is not a practical event.
//! Even then the cost is a routing guess, not data: a worker's engine checks its own cache.
//!
//! Bounded: a direct-mapped table of [`SLOTS`] entries (a 32-byte tag and a 104-byte state each,
//! 4.25 MiB), a new prefix replacing whatever shared its slot. One table per process behind a
//! lock; a caller that finds it taken hashes without it rather than wait.

use std::hash::BuildHasher;
use std::sync::{Mutex, OnceLock};

use xxhash_rust::xxh3::Xxh3;

use crate::chunk_hash::{key_from_digest, le_bytes, prefix_keys_into, Midstate, NO_KEY};
use crate::error::{CoreError, Result};

/// Entries of the process's memo (a power of two).
pub const SLOTS: usize = 1 << 15;

/// What a lookup reads: the prefix's fingerprint (odd; 0: an empty slot) and its key. The
/// hashing state sits apart (`PrefixMemo::states`, same index) and is read only where hashing
/// resumes, so a hit touches one cache line.
#[derive(Clone, Copy)]
#[repr(align(32))]
struct Tag {
    fp: u128,
    key: u64,
}

/// Counters: lengths found in the memo, and lengths hashed (and filed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoStats {
    pub hits: u64,
    pub misses: u64,
}

pub struct PrefixMemo {
    tags: Vec<Tag>,
    /// The hashing state after the namespace digest and the slot's prefix.
    states: Vec<Midstate>,
    seed: u64,
    stats: MemoStats,
}

impl PrefixMemo {
    /// A memo of `slots` entries (rounded up to a power of two, at least 1) fingerprinting
    /// under `seed`.
    pub fn new(slots: usize, seed: u64) -> Self {
        let n = slots.max(1).next_power_of_two();
        PrefixMemo { tags: vec![Tag { fp: 0, key: 0 }; n], states: vec![Midstate::default(); n], seed, stats: MemoStats::default() }
    }

    pub fn stats(&self) -> MemoStats {
        self.stats
    }

    /// Keys of `tokens[..c]` for every `c` in `lengths`, which must ascend strictly (a route's
    /// sorted plan lengths); lengths beyond the prompt give [`NO_KEY`]. Equal to
    /// [`prefix_keys_into`].
    pub fn keys_into(&mut self, ns: &[u8; 32], tokens: &[u32], lengths: &[u32], out: &mut [u64]) -> Result<()> {
        if out.len() != lengths.len() {
            return Err(CoreError::InvalidArgument(format!("output holds {} keys for {} lengths", out.len(), lengths.len())));
        }
        if lengths.first() == Some(&0) || lengths.windows(2).any(|w| w[0] >= w[1]) {
            return Err(CoreError::InvalidArgument(format!("memoised prefix lengths must ascend strictly from >= 1, got {lengths:?}")));
        }
        let mask = self.tags.len() - 1;
        let fitting = lengths.partition_point(|&c| c as usize <= tokens.len());
        out[fitting..].fill(NO_KEY);
        // Every fingerprint first, each tag fetched as soon as it is known: the tags are random
        // lines of a 1 MiB table, and their misses overlap instead of queueing.
        let mut fps = [0u128; 64];
        let mut fp = Xxh3::with_seed(self.seed);
        fp.update(ns);
        let mut fp_at = 0usize;
        let mut from = 0usize;
        // The hashing state and how many tokens it has taken (built on the first miss), and the
        // slot and length of the latest hit past it, whose state a miss resumes from.
        let mut state: Option<(Midstate, usize)> = None;
        let mut resume: Option<(usize, usize)> = None;
        while from < fitting {
            let to = fitting.min(from + fps.len());
            for (f, &c) in fps.iter_mut().zip(&lengths[from..to]) {
                let c = c as usize;
                fp.update(&le_bytes(&tokens[fp_at..c]));
                fp_at = c;
                *f = fp.digest128() | 1;
                crate::ludo::prefetch(&self.tags, (*f >> 64) as usize & mask);
            }
            for (i, &f) in (from..to).zip(&fps) {
                let c = lengths[i] as usize;
                let at_slot = (f >> 64) as usize & mask;
                let tag = self.tags[at_slot];
                if tag.fp == f {
                    out[i] = tag.key;
                    resume = Some((at_slot, c));
                    self.stats.hits += 1;
                    continue;
                }
                let (st, at) = match (resume.take(), state.as_mut()) {
                    (Some((j, hit_at)), _) => state.insert((self.states[j], hit_at)),
                    (None, Some(s)) => s,
                    (None, None) => {
                        let mut m = Midstate::default();
                        m.update(ns);
                        state.insert((m, 0))
                    }
                };
                st.update(&le_bytes(&tokens[*at..c]));
                *at = c;
                let key = key_from_digest(&st.finalize());
                out[i] = key;
                self.tags[at_slot] = Tag { fp: f, key };
                self.states[at_slot] = *st;
                self.stats.misses += 1;
            }
            from = to;
        }
        Ok(())
    }
}

fn process_memo() -> &'static Mutex<PrefixMemo> {
    static MEMO: OnceLock<Mutex<PrefixMemo>> = OnceLock::new();
    MEMO.get_or_init(|| {
        // std's RandomState draws its keys from the OS: a seed nobody outside the process knows.
        let seed = std::collections::hash_map::RandomState::new().hash_one(0x6b76_636f_6d70_6173u64);
        Mutex::new(PrefixMemo::new(SLOTS, seed))
    })
}

/// [`PrefixMemo::keys_into`] on the process's memo; without it (another thread holds it) the
/// plain pass.
pub fn keys_into(ns: &[u8; 32], tokens: &[u32], lengths: &[u32], out: &mut [u64]) -> Result<()> {
    match process_memo().try_lock() {
        Ok(mut m) => m.keys_into(ns, tokens, lengths, out),
        Err(_) => prefix_keys_into(ns, tokens, lengths, out),
    }
}

/// The process memo's counters.
pub fn stats() -> MemoStats {
    match process_memo().lock() {
        Ok(m) => m.stats(),
        Err(p) => p.into_inner().stats(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk_hash::prefix_keys;
    use proptest::prelude::*;

    fn plain(ns: &[u8; 32], t: &[u32], l: &[u32]) -> Vec<u64> {
        prefix_keys(ns, t, l).unwrap()
    }

    #[test]
    fn repeated_prompt_hits_every_length_and_keys_agree() {
        let mut m = PrefixMemo::new(64, 7);
        let ns = [3u8; 32];
        let t: Vec<u32> = (0..300).map(|i| i * 7 + 1).collect();
        let l = [16u32, 64, 256, 512];
        let mut a = vec![0; 4];
        m.keys_into(&ns, &t, &l, &mut a).unwrap();
        assert_eq!(m.stats(), MemoStats { hits: 0, misses: 3 });
        assert_eq!(a, plain(&ns, &t, &l));
        assert_eq!(a[3], NO_KEY);
        let mut b = vec![0; 4];
        m.keys_into(&ns, &t, &l, &mut b).unwrap();
        assert_eq!(a, b);
        assert_eq!(m.stats(), MemoStats { hits: 3, misses: 3 });
        // Another namespace, same tokens: nothing shared.
        let mut c = vec![0; 4];
        m.keys_into(&[4u8; 32], &t, &l, &mut c).unwrap();
        assert_eq!(c, plain(&[4u8; 32], &t, &l));
        assert_eq!(m.stats().hits, 3);
    }

    #[test]
    fn more_lengths_than_one_fingerprint_round() {
        let mut m = PrefixMemo::new(1 << 10, 9);
        let ns = [5u8; 32];
        let t: Vec<u32> = (0..200).map(|i| i * 31 % 97).collect();
        let l: Vec<u32> = (1..=150).map(|i| i * 3 / 2).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        assert!(l.len() > 64);
        for round in 0..2 {
            let mut o = vec![0; l.len()];
            m.keys_into(&ns, &t, &l, &mut o).unwrap();
            assert_eq!(o, plain(&ns, &t, &l), "round {round}");
        }
        assert!(m.stats().hits > 100);
    }

    #[test]
    fn unsorted_lengths_are_refused() {
        let mut m = PrefixMemo::new(8, 1);
        let mut o = vec![0; 2];
        assert!(m.keys_into(&[0; 32], &[1, 2, 3], &[2, 1], &mut o).is_err());
        assert!(m.keys_into(&[0; 32], &[1, 2, 3], &[0, 1], &mut o).is_err());
        assert!(m.keys_into(&[0; 32], &[1, 2, 3], &[1], &mut o).is_err());
    }

    proptest! {
        /// Prompts that share prefixes of every length with earlier ones, through a memo small
        /// enough to evict: every key equals the plain pass's (a hit after a miss, a miss after
        /// a hit, a partial block carried in the state).
        #[test]
        fn keys_equal_plain_hashing(
            seed in any::<u64>(),
            slots in 1usize..32,
            prompts in proptest::collection::vec((0usize..4, 0usize..120, proptest::collection::vec(0u32..5, 0..120), 0u8..2), 1..24),
            raw_lengths in proptest::collection::btree_set(1u32..260, 1..10),
        ) {
            let lengths: Vec<u32> = raw_lengths.into_iter().collect();
            let mut m = PrefixMemo::new(slots, seed);
            let mut seen: Vec<Vec<u32>> = vec![(0..200).map(|i| i % 3).collect()];
            for (from, cut, tail, nsb) in prompts {
                let base = &seen[from % seen.len()];
                let mut t: Vec<u32> = base[..cut.min(base.len())].to_vec();
                t.extend(tail);
                let ns = [nsb; 32];
                let mut out = vec![0u64; lengths.len()];
                m.keys_into(&ns, &t, &lengths, &mut out).unwrap();
                prop_assert_eq!(out, plain(&ns, &t, &lengths));
                seen.push(t);
            }
        }
    }
}
