//! One error type for the whole core. It never touches PyO3; the bindings map each variant
//! to a precise exception in `kvcompass/errors.py`.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CoreError {
    /// A patch batch skipped ahead: the view expected `expected` but got `got`.
    #[error("sequence gap: expected seq {expected}, got {got} (epoch {epoch})")]
    SequenceGap { epoch: u64, expected: u64, got: u64 },
    /// A batch the view has already applied (duplicate) or one older than its position.
    #[error("stale patch batch: epoch {got_epoch} seq {got_seq} is not after the view's epoch {epoch} seq {seq}")]
    StalePatch { epoch: u64, seq: u64, got_epoch: u64, got_seq: u64 },
    /// A newer epoch arrived without a snapshot: the view must resync from a snapshot.
    #[error("epoch changed from {epoch} to {got_epoch} without a snapshot; resync required")]
    EpochChanged { epoch: u64, got_epoch: u64 },
    /// The batch was addressed to another (table, shard).
    #[error("patch for table {got_table} shard {got_shard} applied to view of table {table} shard {shard}")]
    WrongTable { table: u32, shard: u32, got_table: u32, got_shard: u32 },
    /// Bytes that do not decode as a patch batch (truncated, corrupt, bad checksum, bad version).
    #[error("malformed patch: {0}")]
    MalformedPatch(String),
    /// The view has no geometry yet (never received a snapshot).
    #[error("view is not initialised: apply a snapshot first")]
    Uninitialised,
    /// The table cannot grow past its hard maximum.
    #[error("capacity exceeded: {needed} entries needed, hard maximum is {max}")]
    Capacity { needed: u64, max: u64 },
    /// Keys are 63-bit; the top bit is reserved as the "no key" sentinel.
    #[error("invalid key {0:#x}: keys are 63-bit (top bit must be clear)")]
    InvalidKey(u64),
    /// A value that does not fit the table's value width.
    #[error("value {value:#x} does not fit in {bits} bits")]
    ValueTooWide { value: u64, bits: u32 },
    /// A tier field outside 0..=2 (3 is reserved).
    #[error("invalid tier {0}: expected 0 (absent), 1 (VRAM) or 2 (DRAM)")]
    InvalidTier(u8),
    /// A worker field index outside the table's worker group.
    #[error("invalid worker field {field}: the table has {fields} worker fields")]
    InvalidField { field: u32, fields: u32 },
    /// An update/remove addressed a key that is not in the table.
    #[error("key {0:#x} is not in the table")]
    KeyNotFound(u64),
    /// An argument outside its documented range (geometry, lengths, shapes).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The allocator refused an output within [`MAX_ELEMENTS`] (the host has too little memory).
    #[error("out of memory: cannot allocate {bytes} bytes for {what}")]
    OutOfMemory { what: &'static str, bytes: u64 },
}

pub type Result<T> = std::result::Result<T, CoreError>;

/// The most elements a single call builds one output array of (2^32): synthetic block ids,
/// expanded tokens, a batch's prefix keys, a benchmark's samples. A count past it, or one whose
/// arithmetic overflows, is refused ([`CoreError::InvalidArgument`]) before anything is
/// allocated: such a request is a caller's bug, and allocating it aborted the process.
pub const MAX_ELEMENTS: u64 = 1 << 32;

/// `n` (None: its computation overflowed) as a count of `what` one call may allocate: at most
/// [`MAX_ELEMENTS`].
pub fn element_count(what: &str, n: Option<u64>) -> Result<usize> {
    match n {
        Some(n) if n <= MAX_ELEMENTS => usize::try_from(n).map_err(|_| CoreError::InvalidArgument(format!("{what}: {n} elements do not fit this platform"))),
        Some(n) => Err(CoreError::InvalidArgument(format!("{what}: {n} elements, more than one call builds (at most {MAX_ELEMENTS})"))),
        None => Err(CoreError::InvalidArgument(format!("{what}: the element count overflows 64 bits (at most {MAX_ELEMENTS})"))),
    }
}

/// An empty vector with room for exactly `n` elements (a count checked by [`element_count`]),
/// or [`CoreError::OutOfMemory`] when the allocator refuses, instead of aborting the process.
pub fn vec_with_capacity<T>(what: &'static str, n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| CoreError::OutOfMemory { what, bytes: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64) })?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_counts_are_capped() {
        assert_eq!(element_count("x", Some(5)), Ok(5));
        assert_eq!(element_count("x", Some(MAX_ELEMENTS)), Ok(MAX_ELEMENTS as usize));
        assert!(matches!(element_count("x", Some(MAX_ELEMENTS + 1)), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(element_count("x", None), Err(CoreError::InvalidArgument(_))));
        assert_eq!(vec_with_capacity::<u64>("x", 10).unwrap().capacity(), 10);
        assert!(matches!(vec_with_capacity::<u64>("x", usize::MAX / 2), Err(CoreError::OutOfMemory { .. })));
    }
}
