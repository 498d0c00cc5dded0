//! Prefix keys: the 63-bit identity of "the first c tokens of this prompt in this namespace".
//!
//! key(c) = first 63 bits of SHA-256(namespace_digest || tokens[0..c) as little-endian u32).
//! All lengths of one prompt are produced in a single pass over the tokens: the hasher state is
//! cloned at every requested boundary, so a route pays one SHA-256 pass over its longest prefix.

use xxhash_rust::xxh3::xxh3_64_with_seed;
use sha2::{Digest, Sha256};

use crate::error::{element_count, vec_with_capacity, CoreError, Result};

/// Marks "no key" (a length beyond the prompt). Keys are 63-bit, so this never collides.
pub const NO_KEY: u64 = u64::MAX;

/// Domain separator so namespace digests can never equal a digest of anything else we hash.
const NS_DOMAIN: &[u8] = b"kvcompass-ns-v1";

/// Digest of (model, tenant): different models or sharing groups never share an entry.
///
/// Each string is length-prefixed (u32 LE) so ("ab", "c") and ("a", "bc") differ.
pub fn namespace_digest(model: &str, tenant: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(NS_DOMAIN);
    h.update((model.len() as u32).to_le_bytes());
    h.update(model.as_bytes());
    h.update((tenant.len() as u32).to_le_bytes());
    h.update(tenant.as_bytes());
    h.finalize().into()
}

/// The first 63 bits (big-endian) of a SHA-256 digest.
#[inline]
pub fn key_from_digest(d: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_be_bytes(b) >> 1
}

/// The owning shard of a key.
#[inline]
pub fn shard_of(key: u64, shards: u32) -> u32 {
    (key % shards as u64) as u32
}

#[inline]
fn feed(h: &mut Sha256, tokens: &[u32]) {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: u32 has no padding and any byte pattern is a valid u8; on a little-endian
        // target the in-memory bytes are exactly the little-endian encoding we hash.
        let bytes = unsafe {
            std::slice::from_raw_parts(tokens.as_ptr() as *const u8, std::mem::size_of_val(tokens))
        };
        h.update(bytes);
    }
    #[cfg(not(target_endian = "little"))]
    for t in tokens {
        h.update(t.to_le_bytes());
    }
}

/// Keys of `tokens[..c]` for every `c` in `lengths` (any order, duplicates allowed), written to
/// `out[i]` for `lengths[i]`; lengths beyond the prompt give [`NO_KEY`]. One hashing pass.
pub fn prefix_keys_into(ns: &[u8; 32], tokens: &[u32], lengths: &[u32], out: &mut [u64]) -> Result<()> {
    if out.len() != lengths.len() {
        return Err(CoreError::InvalidArgument(format!(
            "output holds {} keys for {} lengths",
            out.len(),
            lengths.len()
        )));
    }
    if let Some(&z) = lengths.iter().find(|&&c| c == 0) {
        return Err(CoreError::InvalidArgument(format!("prefix length {z}: lengths must be >= 1")));
    }
    // Visit lengths in ascending order without allocating when they already are sorted
    // (the common case: a level plan is sorted).
    let sorted = lengths.windows(2).all(|w| w[0] <= w[1]);
    let order: Vec<usize>;
    let idx: &mut dyn Iterator<Item = usize> = if sorted {
        &mut (0..lengths.len())
    } else {
        let mut o: Vec<usize> = (0..lengths.len()).collect();
        o.sort_by_key(|&i| lengths[i]);
        order = o;
        &mut order.iter().copied()
    };
    let mut h = Sha256::new();
    h.update(ns);
    let mut done = 0usize;
    for i in idx {
        let c = lengths[i] as usize;
        if c > tokens.len() {
            out[i] = NO_KEY;
            continue;
        }
        if c > done {
            feed(&mut h, &tokens[done..c]);
            done = c;
        }
        out[i] = key_from_digest(&h.clone().finalize());
    }
    Ok(())
}

/// Keys of `tokens[..c]` for every `c` in `lengths`; see [`prefix_keys_into`].
pub fn prefix_keys(ns: &[u8; 32], tokens: &[u32], lengths: &[u32]) -> Result<Vec<u64>> {
    let mut out = vec![0u64; lengths.len()];
    prefix_keys_into(ns, tokens, lengths, &mut out)?;
    Ok(out)
}

/// Batch form: prompt `i` is `tokens[offsets[i]..offsets[i+1]]`. Returns a row-major
/// `(prompts, lengths)` matrix of keys: at most [`MAX_ELEMENTS`](crate::error::MAX_ELEMENTS) of them (refused before
/// anything is allocated).
pub fn prefix_keys_batch(ns: &[u8; 32], tokens: &[u32], offsets: &[u64], lengths: &[u32]) -> Result<Vec<u64>> {
    if offsets.is_empty() {
        return Err(CoreError::InvalidArgument("offsets must hold at least one element".into()));
    }
    let n = offsets.len() - 1;
    let cells = element_count("prefix keys (prompts x lengths)", (n as u64).checked_mul(lengths.len() as u64))?;
    let mut out: Vec<u64> = vec_with_capacity("prefix keys", cells)?;
    out.resize(cells, 0);
    for i in 0..n {
        let (a, b) = (offsets[i], offsets[i + 1]);
        if a > b || b > tokens.len() as u64 {
            return Err(CoreError::InvalidArgument(format!(
                "offsets[{i}..={}] = {a}..{b} is not a range within {} tokens",
                i + 1,
                tokens.len()
            )));
        }
        let row = &mut out[i * lengths.len()..(i + 1) * lengths.len()];
        prefix_keys_into(ns, &tokens[a as usize..b as usize], lengths, row)?;
    }
    Ok(out)
}

/// Domain separator of the emulated engine's block hashes (never equal to a prefix key's input).
const BLOCK_DOMAIN: &[u8] = b"kvcompass-block-v2";

/// `tokens` as little-endian bytes: the slice itself on a little-endian machine, a copy otherwise.
pub(crate) fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: u32 has no padding and any byte pattern is a valid u8; the length is exact and
        // the alignment of u8 is 1.
        std::borrow::Cow::Borrowed(unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens)) })
    }
    #[cfg(not(target_endian = "little"))]
    {
        std::borrow::Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
    }
}

/// Chained block hashes of the full blocks of `tokens`: block `i` is named by XXH3-64 of its
/// tokens (LE u32) seeded with the previous block's name, the first block's seed being XXH3-64
/// of the domain seeded with `seed`. Equal token prefixes give equal chains and a name stands
/// for its whole prefix, as vLLM's prefix-cache hashes do; `seed` (a cache salt's) varies them.
/// A trailing partial block is not hashed.
///
/// Why XXH3 and not SHA-256 (the index's keys are SHA-256): these names only identify blocks
/// inside one emulated engine and in its KV events, where vLLM itself uses a fast
/// non-cryptographic hash by default; the simulator hashes every prompt it replays, and
/// SHA-256 of a 5,000-token prompt (two compressions per 16-token block) was most of a
/// baseline's per-request time. Any two distinct blocks collide with probability ~2^-64.
pub fn block_chain(seed: u64, tokens: &[u32], block_size: usize) -> Result<Vec<u64>> {
    if block_size == 0 {
        return Err(CoreError::InvalidArgument("block_size must be >= 1".into()));
    }
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    block_chain_extend(block_chain_root(seed), tokens, block_size, &mut out);
    Ok(out)
}

/// The name [`block_chain`] chains its first block from (`seed`'s).
#[inline]
pub fn block_chain_root(seed: u64) -> u64 {
    xxh3_64_with_seed(BLOCK_DOMAIN, seed)
}

/// [`block_chain`] continued: appends the names of the full blocks of `tokens` chained from `h`
/// (the root or the name of the block before them) to `out`. `block_size` must be >= 1. For a
/// driver that has a chain's first part already (a prefix it named before) and hashes only the
/// rest.
pub fn block_chain_extend(mut h: u64, tokens: &[u32], block_size: usize, out: &mut Vec<u64>) {
    let n = tokens.len() / block_size;
    if n == 0 {
        // No full block. Also why `block_size * 4` below cannot wrap: with a block, block_size
        // is at most the tokens' count (found in review: a block_size of 2**62 wrapped to a
        // chunk size of 0 and panicked).
        return;
    }
    let bytes = le_bytes(&tokens[..n * block_size]);
    for block in bytes.chunks_exact(block_size * 4) {
        h = xxh3_64_with_seed(block, h);
        out.push(h);
    }
}

/// SHA-256's initial chaining value (FIPS 180-4, 5.3.3).
const SHA256_IV: [u32; 8] = [0x6a09_e667, 0xbb67_ae85, 0x3c6e_f372, 0xa54f_f53a, 0x510e_527f, 0x9b05_688c, 0x1f83_d9ab, 0x5be0_cd19];

/// A resumable SHA-256 whose parts are open: the chaining value after every whole 64-byte
/// block, the bytes after the last one, and the length. `sha2::Sha256` holds the same, but as an
/// opaque 112-byte value; a structure that keeps one state per stored engine block (the agent's
/// forest: millions at fleet scale) keeps only the parts it needs and rebuilds the state here.
/// Digests equal `Sha256`'s for the same bytes (tested).
#[derive(Clone, Copy)]
pub struct Midstate {
    pub cv: [u32; 8],
    /// `buf[..total % 64]`: the bytes not yet compressed.
    pub buf: [u8; 64],
    pub total: u64,
}

impl Default for Midstate {
    fn default() -> Self {
        Midstate { cv: SHA256_IV, buf: [0; 64], total: 0 }
    }
}

impl Midstate {
    /// Bytes held in `buf`.
    #[inline]
    pub fn pending(&self) -> usize {
        (self.total % 64) as usize
    }

    pub fn update(&mut self, mut data: &[u8]) {
        let used = self.pending();
        self.total += data.len() as u64;
        if used > 0 {
            let take = (64 - used).min(data.len());
            self.buf[used..used + take].copy_from_slice(&data[..take]);
            data = &data[take..];
            if used + take < 64 {
                return;
            }
            sha2::block_api::compress256(&mut self.cv, std::slice::from_ref(&self.buf));
        }
        let (blocks, rest) = data.as_chunks::<64>();
        if !blocks.is_empty() {
            sha2::block_api::compress256(&mut self.cv, blocks);
        }
        self.buf[..rest.len()].copy_from_slice(rest);
    }

    /// The digest of everything fed so far (the state itself is unchanged).
    pub fn finalize(&self) -> [u8; 32] {
        let used = self.pending();
        let mut cv = self.cv;
        let mut blk = [0u8; 64];
        blk[..used].copy_from_slice(&self.buf[..used]);
        blk[used] = 0x80;
        if used >= 56 {
            sha2::block_api::compress256(&mut cv, std::slice::from_ref(&blk));
            blk = [0u8; 64];
        }
        blk[56..].copy_from_slice(&self.total.wrapping_mul(8).to_be_bytes());
        sha2::block_api::compress256(&mut cv, std::slice::from_ref(&blk));
        let mut out = [0u8; 32];
        for (o, w) in out.chunks_exact_mut(4).zip(cv) {
            o.copy_from_slice(&w.to_be_bytes());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn midstate_digests_equal_sha256_for_any_split() {
        let data: Vec<u8> = (0..700u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [0usize, 1, 31, 32, 55, 56, 63, 64, 65, 119, 120, 128, 300, 700] {
            let want: [u8; 32] = Sha256::digest(&data[..len]).into();
            for cut in [0usize, 1, 7, 32, 63, 64, 100] {
                let cut = cut.min(len);
                let mut m = Midstate::default();
                m.update(&data[..cut]);
                let mid = m.finalize(); // finalising leaves the state as it was
                m.update(&data[cut..len]);
                assert_eq!(m.finalize(), want, "len {len} cut {cut}");
                assert_eq!(mid, <[u8; 32]>::from(Sha256::digest(&data[..cut])));
            }
        }
    }

    use super::*;

    fn hex(d: &[u8]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Known answers computed independently with Python's hashlib (see tests/test_chunk_hash.py
    /// for the same derivation written out in Python).
    #[test]
    fn namespace_known_answer() {
        let d = namespace_digest("llama-3.1-8b", "public");
        assert_eq!(hex(&d), KAT_NS_HEX);
    }

    #[test]
    fn prefix_known_answer() {
        let ns = namespace_digest("llama-3.1-8b", "public");
        let tokens: Vec<u32> = (0..8u32).map(|i| i * 1000 + 7).collect();
        let keys = prefix_keys(&ns, &tokens, &[1, 4, 8, 9]).unwrap();
        assert_eq!(keys[0], KAT_KEY_1);
        assert_eq!(keys[1], KAT_KEY_4);
        assert_eq!(keys[2], KAT_KEY_8);
        assert_eq!(keys[3], NO_KEY);
    }

    #[test]
    fn one_pass_equals_separate_hashes_and_order_is_irrelevant() {
        let ns = namespace_digest("m", "t");
        let tokens: Vec<u32> = (0..300u32).map(|i| i.wrapping_mul(2654435761)).collect();
        let lengths = [256u32, 1, 64, 300, 64, 128];
        let keys = prefix_keys(&ns, &tokens, &lengths).unwrap();
        for (i, &c) in lengths.iter().enumerate() {
            let mut h = Sha256::new();
            h.update(ns);
            for t in &tokens[..c as usize] {
                h.update(t.to_le_bytes());
            }
            assert_eq!(keys[i], key_from_digest(&h.finalize()));
            assert_eq!(keys[i] >> 63, 0);
        }
    }

    #[test]
    fn namespaces_separate_and_strings_are_length_prefixed() {
        assert_ne!(namespace_digest("ab", "c"), namespace_digest("a", "bc"));
        let t = [1u32, 2, 3];
        let a = prefix_keys(&namespace_digest("m", "a"), &t, &[3]).unwrap();
        let b = prefix_keys(&namespace_digest("m", "b"), &t, &[3]).unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn block_chain_names_prefixes() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999; // differs in block 2 (of size 8)
        let ha = block_chain(7, &a, 8).unwrap();
        let hb = block_chain(7, &b, 8).unwrap();
        assert_eq!(ha.len(), 5);
        assert_eq!(&ha[..2], &hb[..2]);
        assert!(ha[2..].iter().zip(&hb[2..]).all(|(x, y)| x != y));
        assert_ne!(block_chain(8, &a, 8).unwrap()[0], ha[0]);
        assert_eq!(block_chain(7, &a[..39], 8).unwrap().len(), 4);
        // A block's hash depends on its parent, not only its tokens.
        let mut c = a.clone();
        c[..8].copy_from_slice(&[5; 8]);
        assert_ne!(block_chain(7, &c, 8).unwrap()[1], ha[1]);
        assert!(block_chain(7, &a, 0).is_err());
    }

    #[test]
    fn batch_matches_single_and_checks_offsets() {
        let ns = namespace_digest("m", "t");
        let tokens: Vec<u32> = (0..50).collect();
        let offsets = [0u64, 10, 10, 50];
        let lengths = [1u32, 5, 20];
        let got = prefix_keys_batch(&ns, &tokens, &offsets, &lengths).unwrap();
        for i in 0..3 {
            let p = &tokens[offsets[i] as usize..offsets[i + 1] as usize];
            assert_eq!(&got[i * 3..i * 3 + 3], prefix_keys(&ns, p, &lengths).unwrap().as_slice());
        }
        assert!(prefix_keys_batch(&ns, &tokens, &[0, 60], &lengths).is_err());
        assert!(prefix_keys_batch(&ns, &tokens, &[5, 2], &lengths).is_err());
        assert!(prefix_keys(&ns, &tokens, &[0]).is_err());
        // A matrix past MAX_ELEMENTS keys is refused before it is allocated.
        let many_offsets = vec![0u64; 1 << 17];
        let many_lengths = vec![1u32; 1 << 16];
        assert!(matches!(prefix_keys_batch(&ns, &tokens, &many_offsets, &many_lengths), Err(CoreError::InvalidArgument(_))));
    }
}

#[cfg(test)]
const KAT_NS_HEX: &str = "0ace51f96917c52aa632830dec8e10c8d747cc92c623086cbff9b5c3f913459b";
#[cfg(test)]
const KAT_KEY_1: u64 = 0x448b_8915_9a03_a245;
#[cfg(test)]
const KAT_KEY_4: u64 = 0x4be1_0151_a51b_4959;
#[cfg(test)]
const KAT_KEY_8: u64 = 0x3c9a_63d3_757b_21ad;
