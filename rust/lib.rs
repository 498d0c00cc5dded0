//! KVCompass core: the hot paths of the KV-cache discovery plane.
//!
//! Everything here is plain Rust with no Python dependency; the PyO3 bindings live in
//! [`python`] behind the `python` feature so `cargo test`/`cargo bench` never link libpython.

pub mod agent_forest;
pub mod block_cache;
pub mod chunk_hash;
pub mod error;
pub mod ludo;
pub mod patch;
pub mod queues;
pub mod score;
pub mod sim;
pub mod token_ids;

#[cfg(feature = "python")]
mod python;

pub use error::CoreError;
