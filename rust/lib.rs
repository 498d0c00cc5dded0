//! KVCompass core: the hot paths of the KV-cache discovery plane.
//!
//! Everything here is plain Rust with no Python dependency; the PyO3 bindings live in
//! [`python`] behind the `python` feature so `cargo test`/`cargo bench` never link libpython.

/// `PartialEq`, `Eq` and `PartialOrd` of a type from its `Ord` (heap entries compare by a
/// computed key, so the three follow `cmp`).
macro_rules! ord_from_cmp {
    ($t:ty) => {
        impl PartialEq for $t {
            fn eq(&self, o: &Self) -> bool {
                self.cmp(o) == std::cmp::Ordering::Equal
            }
        }
        impl Eq for $t {}
        impl PartialOrd for $t {
            fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(o))
            }
        }
    };
}
pub(crate) use ord_from_cmp;

pub mod agent_forest;
pub mod block_cache;
pub mod block_table;
pub mod bpe;
pub mod chunk_hash;
pub mod key_ops;
pub mod error;
pub mod ludo;
pub mod patch;
pub mod prefix_memo;
pub mod queues;
pub mod score;
pub mod sim;
pub mod slots;
pub mod token_ids;

#[cfg(feature = "python")]
mod python;

pub use error::CoreError;
