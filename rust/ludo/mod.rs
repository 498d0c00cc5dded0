//! The Ludo discovery index: a keyed maintenance table (the single writer of a (table, shard))
//! and the keyless view every edge replicates.
//!
//! Layout and algorithm follow Shi & Qian, "Ludo hashing" (POMACS 2020): 4-slot cuckoo buckets
//! with a per-bucket slot seed, two candidate buckets per key, and an Othello classifier that
//! tells a keyless reader which of the two buckets holds a key.

pub mod hash;
pub mod maintenance;
pub mod mem;
pub mod othello;
pub mod view;

pub use maintenance::LudoTable;
pub use view::{Geometry, LudoView};

/// Slots per bucket.
pub const SLOTS: usize = 4;
/// Target occupancy that sizes the bucket array.
pub const MAX_LOAD: f64 = 0.95;
/// Largest per-bucket slot seed; 255 is never used so a corrupt seed byte is detectable.
pub const MAX_SEED: u8 = 254;
/// Deepest cuckoo displacement path the insert will search.
pub const MAX_CUCKOO_DEPTH: usize = 5;

/// Hint the CPU to fetch `arr[idx]`'s cache line now: the index structures are larger than the
/// caches, and overlapping independent misses is most of what makes a lookup or write fast.
#[inline(always)]
pub(crate) fn prefetch<T>(arr: &[T], idx: usize) {
    #[cfg(target_arch = "x86_64")]
    if idx < arr.len() {
        // SAFETY: the pointer is in bounds; a prefetch never faults and has no other effect.
        unsafe { std::arch::x86_64::_mm_prefetch(arr.as_ptr().add(idx) as *const i8, std::arch::x86_64::_MM_HINT_T0) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (arr, idx);
}
