//! The simulator's synthetic token and block ids (`kvcompass.sim.workload` documents them): a
//! trace names a prompt's blocks by id, and each id expands into `block_size` token ids derived
//! from the id alone with SplitMix64's finaliser, so equal ids mean equal tokens in any run.
//!
//! Here because a replay expands every prompt it routes (several thousand tokens a request),
//! which as numpy expressions over temporary arrays was a third of a baseline scheme's run.
//! The known answers in `tests/test_sim_workload.py` pin the values.

/// 2**64 / phi, SplitMix64's increment.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
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
/// caller checks that the ids cover the length.
pub fn expand_blocks(ids: &[u64], input_length: usize, block_size: usize) -> Vec<u32> {
    let mut out = vec![0u32; input_length.min(ids.len().saturating_mul(block_size))];
    // Whole blocks without a length check per token (the loop over `j` is branch-free, so
    // its independent multiplies overlap), then the partial last block.
    for (chunk, &id) in out.chunks_mut(block_size.max(1)).zip(ids) {
        let seed = mix64(id ^ TOKEN_SALT);
        for (j, t) in chunk.iter_mut().enumerate() {
            let z = mix64(seed.wrapping_add((j as u64).wrapping_mul(GOLDEN)));
            // Multiply-shift maps the top 32 bits onto [0, VOCAB) without a division.
            *t = (((z >> 32) * VOCAB) >> 32) as u32;
        }
    }
    out
}

/// The block ids of runs `(chain, count)`: `mix64(chain + j * GOLDEN) & MAX_ID` for `j = 1..=count`.
pub fn chain_block_ids(chains: &[u64], counts: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(counts.iter().sum::<u64>() as usize);
    for (&c, &n) in chains.iter().zip(counts) {
        for j in 1..=n {
            out.push(mix64(c.wrapping_add(j.wrapping_mul(GOLDEN))) & MAX_ID);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers() {
        // The same values tests/test_sim_workload.py pins for the Python entry point.
        assert_eq!(expand_blocks(&[0, 1], 5, 4), vec![85192, 20828, 103872, 6824, 75434]);
        assert_eq!(expand_blocks(&[(1 << 63) - 1], 3, 8), vec![85479, 93283, 118171]);
    }

    #[test]
    fn runs_expand_in_order() {
        let ids = chain_block_ids(&[5, 9], &[2, 1]);
        assert_eq!(ids, vec![mix64(5 + GOLDEN) & MAX_ID, mix64(5u64.wrapping_add(2u64.wrapping_mul(GOLDEN))) & MAX_ID, mix64(9 + GOLDEN) & MAX_ID]);
    }
}
