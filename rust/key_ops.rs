//! An agent batch's key ops as a maintenance unit takes them (`MaintenanceUnit.apply` in
//! `kvcompass/discovery/maintenance.py` documents the rules): every op checked before anything
//! changes, then one op per key, the last one sent winning, removals first (so a table peaks
//! lower) and each group in key order. As a dozen numpy calls on batches of a few dozen keys,
//! this bookkeeping cost more than the table writes it guards.

/// Keys are 63-bit: the top bit is never set.
pub const KEY_LIMIT: u64 = 1 << 63;
/// The largest tier an op may set (0 absent, 1 VRAM, 2 DRAM).
pub const MAX_TIER: u8 = 2;

/// The first op a unit must refuse, in the order the checks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadOp {
    /// `keys[i]` has its top bit set.
    Key(usize),
    /// `keys[i]` belongs to another shard.
    Shard(usize),
    /// `tiers[i]` is above [`MAX_TIER`].
    Tier(usize),
}

/// The first bad op: every key is checked for its width, then every key for its shard, then
/// every tier (so the error names the same op whatever else is wrong).
pub fn first_bad(keys: &[u64], tiers: &[u8], shard: u64, shards: u64) -> Option<BadOp> {
    if let Some(i) = keys.iter().position(|&k| k >= KEY_LIMIT) {
        return Some(BadOp::Key(i));
    }
    if let Some(i) = keys.iter().position(|&k| k % shards != shard) {
        return Some(BadOp::Shard(i));
    }
    tiers.iter().position(|&t| t > MAX_TIER).map(BadOp::Tier)
}

/// The first position of `xs` that is smaller than the one before it (None: sorted ascending).
pub fn first_unsorted(xs: &[u64]) -> Option<usize> {
    xs.windows(2).position(|w| w[1] < w[0]).map(|i| i + 1)
}

/// One op per key (the last sent wins), removals first, each group in key order; and how many
/// of the removals clear a key in `owned`, which must be sorted ascending (it is searched by
/// bisection; callers check it with [`first_unsorted`]).
pub fn coalesce(keys: &[u64], tiers: &[u8], owned: &[u64]) -> (Vec<u64>, Vec<u8>, usize) {
    let mut idx: Vec<usize> = (0..keys.len()).collect();
    // By key, the latest op of a key first; then keep the first of each key.
    idx.sort_unstable_by(|&a, &b| keys[a].cmp(&keys[b]).then(b.cmp(&a)));
    idx.dedup_by(|b, a| keys[*a] == keys[*b]);
    debug_assert_eq!(first_unsorted(owned), None, "owned must be sorted");
    let (mut out_k, mut out_t) = (Vec::with_capacity(idx.len()), Vec::with_capacity(idx.len()));
    let mut cleared = 0;
    for &i in idx.iter().filter(|&&i| tiers[i] == 0) {
        out_k.push(keys[i]);
        out_t.push(0);
        cleared += usize::from(owned.binary_search(&keys[i]).is_ok());
    }
    for &i in idx.iter().filter(|&&i| tiers[i] != 0) {
        out_k.push(keys[i]);
        out_t.push(tiers[i]);
    }
    (out_k, out_t, cleared)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_op_wins_and_removals_come_first() {
        let (k, t, c) = coalesce(&[8, 4, 8, 12, 4, 16], &[1, 2, 0, 1, 1, 0], &[8, 16, 20]);
        assert_eq!(k, vec![8, 16, 4, 12]);
        assert_eq!(t, vec![0, 0, 1, 1]);
        assert_eq!(c, 2);
        assert_eq!(coalesce(&[], &[], &[]), (vec![], vec![], 0));
    }

    #[test]
    fn checks_run_in_order() {
        assert_eq!(first_bad(&[4, 1 << 63, 5], &[9, 0, 0], 0, 4), Some(BadOp::Key(1)));
        assert_eq!(first_bad(&[4, 5], &[9, 0], 0, 4), Some(BadOp::Shard(1)));
        assert_eq!(first_bad(&[4, 8], &[1, 3], 0, 4), Some(BadOp::Tier(1)));
        assert_eq!(first_bad(&[4, 8], &[1, 2], 0, 4), None);
    }

    #[test]
    fn unsorted_owned_keys_are_found() {
        assert_eq!(first_unsorted(&[]), None);
        assert_eq!(first_unsorted(&[4, 4, 8]), None);
        assert_eq!(first_unsorted(&[8, 4]), Some(1));
        assert_eq!(first_unsorted(&[1, 5, 3, 9]), Some(2));
    }
}
