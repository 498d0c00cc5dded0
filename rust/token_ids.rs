//! The simulator's synthetic token and block ids (`kvcompass.sim.workload` documents them): a
//! trace names a prompt's blocks by id, and each id expands into `block_size` token ids derived
//! from the id alone with SplitMix64's finaliser, so equal ids mean equal tokens in any run.
//!
//! Here because a replay expands every prompt it routes (several thousand tokens a request),
//! which as numpy expressions over temporary arrays was a third of a baseline scheme's run.
//! The known answers in `tests/test_sim_workload.py` pin the values.

/// 2**64 / phi, SplitMix64's increment.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
use std::mem::MaybeUninit;

use crate::error::{element_count, vec_with_capacity, Result};

const C1: u64 = 0xBF58_476D_1CE4_E5B9;
const C2: u64 = 0x94D0_49BB_1331_11EB;
/// Mixed into a block id before it seeds that block's tokens ("kvc" "token").
pub const TOKEN_SALT: u64 = 0x6B76_6374_6F6B_656E;
/// Token ids are in `0..VOCAB` (Llama-3's vocabulary size, rounded).
pub const VOCAB: u64 = 128_000;
/// Synthetic block ids are 63-bit, as Mooncake's are non-negative int64.
pub const MAX_ID: u64 = (1 << 63) - 1;

/// SplitMix64's finaliser of `x + GOLDEN`.
#[inline]
pub fn mix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(C1);
    z = (z ^ (z >> 27)).wrapping_mul(C2);
    z ^ (z >> 31)
}

/// The first `input_length` token ids of the blocks `ids` (`block_size` tokens each). The
/// caller checks that the ids cover the length (the engine checks every request's length
/// against [`MAX_ELEMENTS`](crate::error::MAX_ELEMENTS) when it is built; [`try_expand_blocks`] checks it per call).
pub fn expand_blocks(ids: &[u64], input_length: usize, block_size: usize) -> Vec<u32> {
    let n = input_length.min(ids.len().saturating_mul(block_size));
    let mut out: Vec<u32> = Vec::with_capacity(n);
    fill_blocks(ids, block_size, n, &mut out);
    out
}

/// [`expand_blocks`] for a caller's arguments: a length past [`MAX_ELEMENTS`](crate::error::MAX_ELEMENTS) tokens is refused
/// and a refused allocation is an error, before anything is allocated or written.
pub fn try_expand_blocks(ids: &[u64], input_length: usize, block_size: usize) -> Result<Vec<u32>> {
    let n = element_count("tokens", Some(input_length.min(ids.len().saturating_mul(block_size)) as u64))?;
    let mut out: Vec<u32> = vec_with_capacity("tokens", n)?;
    fill_blocks(ids, block_size, n, &mut out);
    Ok(out)
}

/// Write the first `n` tokens of the blocks `ids` into `out` (empty, with room for `n`).
fn fill_blocks(ids: &[u64], block_size: usize, n: usize, out: &mut Vec<u32>) {
    debug_assert!(out.is_empty() && out.capacity() >= n);
    // Written in place, not zeroed first: `vec![0; n]` was a calloc and a memset of every
    // prompt's tokens before the loop below wrote each of them again.
    let spare = &mut out.spare_capacity_mut()[..n];
    // A Mixed prompt is ~5,000 tokens, each three 64-bit multiplies: a quarter of a baseline
    // scheme's run. The loop vectorises, and with AVX-512 (native 64-bit lane multiplies) or
    // AVX2 it runs several tokens a step; the CPU is asked at run time, since the wheel is built
    // for any x86-64. Integer arithmetic only: every variant gives the same tokens.
    #[cfg(target_arch = "x86_64")]
    let done = if std::arch::is_x86_feature_detected!("avx512dq") && std::arch::is_x86_feature_detected!("avx512vl") {
        // SAFETY: the features the function is compiled for were detected on this CPU.
        unsafe { expand_avx512(ids, block_size, spare) };
        true
    } else if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: as above.
        unsafe { expand_avx2(ids, block_size, spare) };
        true
    } else {
        false
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = false;
    if !done {
        expand_into(ids, block_size, spare);
    }
    // SAFETY: expand_into wrote every one of the n elements.
    unsafe { out.set_len(n) };
}

/// # Safety
/// The CPU must have AVX-512 F, DQ and VL and AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2")]
unsafe fn expand_avx512(ids: &[u64], block_size: usize, out: &mut [MaybeUninit<u32>]) {
    expand_into(ids, block_size, out)
}

/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn expand_avx2(ids: &[u64], block_size: usize, out: &mut [MaybeUninit<u32>]) {
    expand_into(ids, block_size, out)
}

/// Tokens in tiles: first every token's mixer input (its block's seed plus its offset times
/// `GOLDEN`), then one flat pass that mixes them all. Why two passes: a block is only 16 tokens,
/// two 8-lane vectors, and mixing them is a chain of dependent 64-bit multiplies (~15 cycles
/// each), so a loop per block waits on latency; the flat pass has hundreds of independent lanes
/// and runs at the multiplier's throughput (3-4x faster on a 5,000-token prompt). `out` must not
/// be longer than `ids.len() * block_size`; every element of it is written.
#[inline(always)]
fn expand_into(ids: &[u64], block_size: usize, out: &mut [MaybeUninit<u32>]) {
    const TILE: usize = 512;
    let bs = block_size.max(1);
    let mut pre = [0u64; TILE];
    let n = out.len();
    let mut pos = 0;
    while pos < n {
        let end = (pos + TILE).min(n);
        let mut i = pos;
        while i < end {
            let (b, j0) = (i / bs, i % bs);
            let seed = mix64(ids[b] ^ TOKEN_SALT);
            let stop = ((b + 1) * bs).min(end);
            for (k, p) in pre[i - pos..stop - pos].iter_mut().enumerate() {
                *p = seed.wrapping_add(((j0 + k) as u64).wrapping_mul(GOLDEN));
            }
            i = stop;
        }
        for (t, &p) in out[pos..end].iter_mut().zip(&pre[..end - pos]) {
            let z = mix64(p);
            // Multiply-shift maps the top 32 bits onto [0, VOCAB) without a division.
            t.write((((z >> 32) * VOCAB) >> 32) as u32);
        }
        pos = end;
    }
}

/// How many block ids the runs `counts` make: their sum, None when it overflows 64 bits.
pub fn run_total(counts: &[u64]) -> Option<u64> {
    counts.iter().try_fold(0u64, |s, &n| s.checked_add(n))
}

/// The block ids of runs `(chain, count)`: `mix64(chain + j * GOLDEN) & MAX_ID` for `j = 1..=count`.
/// Counts summing past [`MAX_ELEMENTS`](crate::error::MAX_ELEMENTS) (or past 64 bits) are refused before anything is
/// allocated.
pub fn chain_block_ids(chains: &[u64], counts: &[u64]) -> Result<Vec<u64>> {
    let total = element_count("block ids", run_total(counts))?;
    let mut out = vec_with_capacity("block ids", total)?;
    for (&c, &n) in chains.iter().zip(counts) {
        for j in 1..=n {
            out.push(mix64(c.wrapping_add(j.wrapping_mul(GOLDEN))) & MAX_ID);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::MAX_ELEMENTS;

    #[test]
    fn known_answers() {
        // The same values tests/test_sim_workload.py pins for the Python entry point.
        assert_eq!(expand_blocks(&[0, 1], 5, 4), vec![85192, 20828, 103872, 6824, 75434]);
        assert_eq!(expand_blocks(&[(1 << 63) - 1], 3, 8), vec![85479, 93283, 118171]);
    }

    /// The definition, a block at a time, that the tiled loop must reproduce.
    fn reference(ids: &[u64], block_size: usize, out: &mut [u32]) {
        for (chunk, &id) in out.chunks_mut(block_size.max(1)).zip(ids) {
            let seed = mix64(id ^ TOKEN_SALT);
            for (j, t) in chunk.iter_mut().enumerate() {
                let z = mix64(seed.wrapping_add((j as u64).wrapping_mul(GOLDEN)));
                *t = (((z >> 32) * VOCAB) >> 32) as u32;
            }
        }
    }

    /// `n` elements written by `f` into fresh, unzeroed room (checked afterwards against a
    /// reference: an element `f` missed would differ from it, or read as garbage).
    fn written(n: usize, f: impl FnOnce(&mut [MaybeUninit<u32>])) -> Vec<u32> {
        let mut v: Vec<u32> = Vec::with_capacity(n);
        f(&mut v.spare_capacity_mut()[..n]);
        // SAFETY: every variant writes all of `out` (what the comparison checks).
        unsafe { v.set_len(n) };
        v
    }

    #[test]
    fn every_variant_gives_the_same_tokens() {
        let ids: Vec<u64> = (0..97u64).map(|i| mix64(i) & MAX_ID).collect();
        // Block sizes that divide the 512-token tile and ones that straddle it.
        for bs in [1usize, 3, 16, 64, 100, 700] {
            for len in [0usize, 1, bs * 40 + 1, 511, 513, 1025, ids.len() * bs] {
                let mut scalar = vec![0u32; len.min(ids.len() * bs)];
                reference(&ids, bs, &mut scalar);
                let tiled = written(scalar.len(), |out| expand_into(&ids, bs, out));
                assert_eq!(tiled, scalar, "block size {bs}, length {len}");
                assert_eq!(expand_blocks(&ids, len, bs), scalar);
                #[cfg(target_arch = "x86_64")]
                {
                    if std::arch::is_x86_feature_detected!("avx2") {
                        let v = written(scalar.len(), |out| unsafe { expand_avx2(&ids, bs, out) });
                        assert_eq!(v, scalar);
                    }
                }
            }
        }
    }

    #[test]
    fn runs_expand_in_order() {
        let ids = chain_block_ids(&[5, 9], &[2, 1]).unwrap();
        assert_eq!(ids, vec![mix64(5 + GOLDEN) & MAX_ID, mix64(5u64.wrapping_add(2u64.wrapping_mul(GOLDEN))) & MAX_ID, mix64(9 + GOLDEN) & MAX_ID]);
    }

    #[test]
    fn oversized_outputs_are_refused_before_allocating() {
        // A sum that wraps to 0 (it once spun through 2^64 iterations), one past the cap, one
        // whose byte size overflows.
        assert!(chain_block_ids(&[1, 2], &[1 << 63, 1 << 63]).is_err());
        assert!(chain_block_ids(&[1], &[MAX_ELEMENTS + 1]).is_err());
        assert!(chain_block_ids(&[1], &[1 << 62]).is_err());
        assert!(try_expand_blocks(&[1], 1 << 40, 1 << 40).is_err());
        assert_eq!(try_expand_blocks(&[0, 1], 5, 4).unwrap(), expand_blocks(&[0, 1], 5, 4));
        assert_eq!(run_total(&[u64::MAX, 1]), None);
    }
}
