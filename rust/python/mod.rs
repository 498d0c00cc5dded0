//! PyO3 bindings: thin wrappers over the core types, exposed as `kvcompass._core`.
//!
//! Inputs cross the boundary as numpy arrays, are checked (dtype, shape, contiguity) with a
//! precise `ValueError`, copied into owned Rust values, and batch work then runs with the GIL
//! released. Core errors map to the exception classes of `kvcompass.errors` in one place.

mod arrays;
mod bench;
mod block_cache;
mod errors;
mod index;
mod router;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::chunk_hash;
use arrays::{ns_bytes, u32_vec, u64_vec};
use errors::core_err;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods};

/// SHA-256 digest of (model, tenant): the namespace every key of that sharing group lives in.
#[pyfunction]
fn namespace_digest<'py>(py: Python<'py>, model: &str, tenant: &str) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &chunk_hash::namespace_digest(model, tenant))
}

/// Keys of tokens[:c] for each c in lengths, in one hashing pass; NO_KEY past the prompt.
#[pyfunction]
fn prefix_keys<'py>(py: Python<'py>, namespace: &Bound<'py, PyAny>, tokens: &Bound<'py, PyAny>, lengths: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let ns = ns_bytes(namespace)?;
    let tokens = u32_vec("tokens", tokens)?;
    let lengths = u32_vec("lengths", lengths)?;
    let keys = py.detach(|| chunk_hash::prefix_keys(&ns, &tokens, &lengths)).map_err(core_err)?;
    Ok(keys.into_pyarray(py))
}

/// Batch form: prompt i is tokens[offsets[i]:offsets[i+1]]; returns a (prompts, lengths) array.
#[pyfunction]
fn prefix_keys_batch<'py>(py: Python<'py>, namespace: &Bound<'py, PyAny>, tokens: &Bound<'py, PyAny>, offsets: &Bound<'py, PyAny>, lengths: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let ns = ns_bytes(namespace)?;
    let tokens = u32_vec("tokens", tokens)?;
    let offsets = u64_vec("offsets", offsets)?;
    let lengths = u32_vec("lengths", lengths)?;
    let keys = py.detach(|| chunk_hash::prefix_keys_batch(&ns, &tokens, &offsets, &lengths)).map_err(core_err)?;
    let rows = offsets.len().saturating_sub(1);
    let arr = keys.into_pyarray(py);
    Ok(arr.reshape([rows, lengths.len()])?)
}

/// Chained hashes of the full blocks of `tokens` (the emulated engine's block names).
#[pyfunction]
fn block_chain_hashes<'py>(py: Python<'py>, tokens: &Bound<'py, PyAny>, block_size: usize, seed: u64) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let tokens = u32_vec("tokens", tokens)?;
    let out = py.detach(|| chunk_hash::block_chain(seed, &tokens, block_size)).map_err(core_err)?;
    Ok(out.into_pyarray(py))
}

/// The shard that owns a key.
#[pyfunction]
fn shard_of(key: u64, shards: u32) -> PyResult<u32> {
    if shards == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err("shards must be >= 1"));
    }
    Ok(chunk_hash::shard_of(key, shards))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("NO_KEY", chunk_hash::NO_KEY)?;
    m.add("PATCH_VERSION", crate::patch::VERSION)?;
    m.add_function(wrap_pyfunction!(namespace_digest, m)?)?;
    m.add_function(wrap_pyfunction!(prefix_keys, m)?)?;
    m.add_function(wrap_pyfunction!(prefix_keys_batch, m)?)?;
    m.add_function(wrap_pyfunction!(shard_of, m)?)?;
    m.add_function(wrap_pyfunction!(block_chain_hashes, m)?)?;
    index::register(m)?;
    block_cache::register(m)?;
    router::register(m)?;
    bench::register(m)?;
    Ok(())
}
