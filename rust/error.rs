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
}

pub type Result<T> = std::result::Result<T, CoreError>;
