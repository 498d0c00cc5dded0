//! The seeded hash functions shared by the maintenance table and the view. Both sides must
//! compute bit-identical bucket, Othello, slot and fingerprint positions from a key alone.

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64 finaliser: full avalanche, ~1 ns. Keys are SHA-256 derived already, but tests and
/// users also feed sequential keys, so every position is mixed anyway.
#[inline(always)]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[inline(always)]
pub fn hash_with(key: u64, seed: u64) -> u64 {
    mix64(key.wrapping_add(seed.wrapping_mul(GOLDEN)) ^ seed)
}

/// Lemire's multiply-shift range reduction of a 32-bit hash into `0..n`.
#[inline(always)]
pub fn reduce(x: u32, n: u32) -> u32 {
    ((x as u64 * n as u64) >> 32) as u32
}

/// The per-table seeds, all derived from one table seed so a snapshot needs to carry only that.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seeds {
    pub bucket: u64,
    pub othello: u64,
    pub slot: u64,
    pub fp: u64,
}

impl Seeds {
    pub fn from_table_seed(seed: u64) -> Self {
        Seeds {
            bucket: mix64(seed ^ 0x0b0c_4e75),
            othello: mix64(seed ^ 0x07e1_1005),
            slot: mix64(seed ^ 0x0051_07aa),
            fp: mix64(seed ^ 0x00f1_9e55),
        }
    }
}

/// Two distinct candidate buckets (n_buckets >= 2).
#[inline(always)]
pub fn buckets(key: u64, seeds: &Seeds, n_buckets: u32) -> (u32, u32) {
    let h = hash_with(key, seeds.bucket);
    let b0 = reduce(h as u32, n_buckets);
    let mut b1 = reduce((h >> 32) as u32, n_buckets - 1);
    if b1 >= b0 {
        b1 += 1;
    }
    (b0, b1)
}

/// The key's Othello edge: a node in array A (0..ma) and one in array B (0..mb).
#[inline(always)]
pub fn othello_edge(key: u64, seeds: &Seeds, ma: u32, mb: u32) -> (u32, u32) {
    let h = hash_with(key, seeds.othello);
    (reduce(h as u32, ma), reduce((h >> 32) as u32, mb))
}

/// Odd multipliers of the per-bucket slot hash family, one per seed (a fixed random table, so
/// the writer and every view agree without sending it).
const SLOT_MULS: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut i = 0;
    while i < 256 {
        let mut z = (i as u64 + 1).wrapping_mul(GOLDEN);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        t[i] = (z ^ (z >> 31)) | 1;
        i += 1;
    }
    t
};

/// The key's slot hash: mixed once, then each seed costs one multiply (multiply-shift family),
/// which keeps the seed search of a re-seeded bucket cheap.
#[inline(always)]
pub fn slot_hash(key: u64, seeds: &Seeds) -> u64 {
    hash_with(key, seeds.slot)
}

/// Slot (0..4) of a key with slot hash `h` in a bucket whose seed is `s`.
#[inline(always)]
pub fn slot_of(h: u64, s: u8) -> usize {
    (h.wrapping_mul(SLOT_MULS[s as usize]) >> 62) as usize
}

/// The key's slot in a bucket whose slot seed is `s`.
#[inline(always)]
pub fn slot(key: u64, seeds: &Seeds, s: u8) -> usize {
    slot_of(slot_hash(key, seeds), s)
}

/// The key's f-bit fingerprint; never 0 (0 marks an empty slot).
#[inline(always)]
pub fn fingerprint(key: u64, seeds: &Seeds, fp_bits: u8) -> u64 {
    if fp_bits == 0 {
        return 0;
    }
    let f = hash_with(key, seeds.fp) >> (64 - fp_bits as u32);
    if f == 0 {
        1
    } else {
        f
    }
}

/// The smallest seed that sends `keys` to pairwise distinct slots, if any does.
pub fn find_seed(keys: &[u64], seeds: &Seeds) -> Option<u8> {
    let mut h = [0u64; 4];
    let n = keys.len().min(4);
    for i in 0..n {
        h[i] = slot_hash(keys[i], seeds);
    }
    find_seed_h(&h[..n])
}

/// [`find_seed`] over precomputed slot hashes.
///
/// About one seed in ten separates four keys, so the search is short but its outcome random:
/// seeds are tried eight at a time without branching on each (a seed works when its slots, as
/// a bit set, have as many bits as there are keys), which spares a mispredicted branch per try.
pub fn find_seed_h(h: &[u64]) -> Option<u8> {
    debug_assert!(h.len() <= 4);
    let n = h.len() as u32;
    let mut base = 0u32;
    while base <= super::MAX_SEED as u32 {
        let mut ok = 0u32;
        for j in 0..8u32 {
            let s = base + j;
            let mut used = 0u32;
            for &x in h {
                used |= 1 << slot_of(x, s as u8);
            }
            ok |= ((used.count_ones() == n && s <= super::MAX_SEED as u32) as u32) << j;
        }
        if ok != 0 {
            return Some((base + ok.trailing_zeros()) as u8);
        }
        base += 8;
    }
    None
}

/// The straightforward search [`find_seed_h`] must agree with (tests only).
#[cfg(test)]
fn find_seed_h_plain(h: &[u64]) -> Option<u8> {
    'seed: for s in 0..=super::MAX_SEED {
        let mut used = 0u8;
        for &x in h {
            let bit = 1u8 << slot_of(x, s);
            if used & bit != 0 {
                continue 'seed;
            }
            used |= bit;
        }
        return Some(s);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidate_buckets_differ_and_are_in_range() {
        let s = Seeds::from_table_seed(7);
        for n in [2u32, 3, 17, 1000] {
            for k in 0..2000u64 {
                let (a, b) = buckets(k, &s, n);
                assert!(a < n && b < n && a != b);
            }
        }
    }

    #[test]
    fn batched_seed_search_finds_the_smallest_seed() {
        let s = Seeds::from_table_seed(9);
        for t in 0..20_000u64 {
            let n = (t % 5) as usize;
            let h: Vec<u64> = (0..n as u64).map(|i| slot_hash(mix64(t * 8 + i), &s)).collect();
            assert_eq!(find_seed_h(&h), find_seed_h_plain(&h), "{h:?}");
        }
        // Keys no seed separates: two equal slot hashes.
        assert_eq!(find_seed_h(&[7, 7]), None);
        assert_eq!(find_seed_h_plain(&[7, 7]), None);
    }

    #[test]
    fn full_bucket_seed_search_needs_about_ten_tries() {
        let s = Seeds::from_table_seed(1);
        let mut total = 0u64;
        let trials = 2000u64;
        for t in 0..trials {
            let keys = [t * 4, t * 4 + 1, t * 4 + 2, t * 4 + 3];
            total += find_seed(&keys, &s).expect("a seed exists") as u64 + 1;
        }
        let mean = total as f64 / trials as f64;
        // 4!/4^4 = 3/32 success per try -> mean 10.7 tries.
        assert!((8.0..14.0).contains(&mean), "mean tries {mean}");
    }
}
