//! PyO3 bindings: thin wrappers over the core types, exposed as `kvcompass._core`.
//!
//! Inputs cross the boundary as numpy arrays, are checked (dtype, shape, contiguity) with a
//! precise `ValueError`, copied into owned Rust values, and batch work then runs with the GIL
//! released. Core errors map to the exception classes of `kvcompass.errors` in one place.

mod agent;
mod arrays;
mod bench;
mod block_cache;
mod bpe;
mod errors;
mod index;
pub(crate) mod queues;
mod edge_core;
mod router;
mod sim;

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

/// Token ids of a prompt from its block ids (`kvcompass.sim.workload.expand_blocks` checks the
/// arguments; this is the arithmetic). At most `MAX_ELEMENTS` (2^32) tokens: a longer
/// `input_length` is refused (InvalidArgumentError) before anything is allocated.
#[pyfunction]
fn expand_block_tokens<'py>(py: Python<'py>, ids: &Bound<'py, PyAny>, input_length: usize, block_size: usize) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let ids = u64_vec("ids", ids)?;
    if block_size == 0 || ids.len() != input_length.div_ceil(block_size) {
        return Err(pyo3::exceptions::PyValueError::new_err(format!("{} ids cannot cover input_length {input_length} at block_size {block_size}", ids.len())));
    }
    Ok(py.detach(|| crate::token_ids::try_expand_blocks(&ids, input_length, block_size)).map_err(core_err)?.into_pyarray(py))
}

/// Block ids of synthetic runs `(chains[i], counts[i])` (`kvcompass.sim.workload.ChainBlocks`).
/// Counts summing past `MAX_ELEMENTS` (2^32), or past 64 bits, are refused
/// (InvalidArgumentError) before anything is allocated; the ids are made with the GIL released.
#[pyfunction]
fn chain_block_ids<'py>(py: Python<'py>, chains: &Bound<'py, PyAny>, counts: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let chains = u64_vec("chains", chains)?;
    let counts = u64_vec("counts", counts)?;
    if chains.len() != counts.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!("{} chains but {} counts", chains.len(), counts.len())));
    }
    Ok(py.detach(|| crate::token_ids::chain_block_ids(&chains, &counts)).map_err(core_err)?.into_pyarray(py))
}

/// `h` folded with every part: `h = mix64(h ^ part)` (SplitMix64's finaliser, as token ids use):
/// how a synthetic workload names a prompt segment and chains segments (a Python loop of
/// 64-bit arithmetic was a fifth of generating 500,000 Mixed requests).
#[pyfunction]
fn mix_fold(h: u64, parts: Vec<u64>) -> u64 {
    parts.iter().fold(h, |h, &p| crate::token_ids::mix64(h ^ p))
}

/// The index of the first item of `tokens` (a list or tuple) that is not an exact int in
/// 0..2**32-1 (a bool is not), or -1: the check every decoded KV event's token ids get, in one
/// pass instead of a type census, a min and a max.
#[pyfunction]
fn first_bad_token(tokens: &Bound<'_, PyAny>) -> PyResult<i64> {
    Ok(each_exact_u32(tokens, |_| ())?.err().unwrap_or(-1))
}

/// Token ids given as a list or tuple as a uint32 array, checked in the same pass: `(array,
/// -1)`, or `(empty array, i)` for the first item that is not an exact int in 0..2**32-1 (a bool
/// is not). A door reading a JSON prompt of token ids pays this once, not a type census, an
/// int64 copy, a min, a max and a cast.
#[pyfunction]
fn token_array<'py>(py: Python<'py>, tokens: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyArray1<u32>>, i64)> {
    let mut out = Vec::with_capacity(tokens.len().unwrap_or(0));
    Ok(match each_exact_u32(tokens, |v| out.push(v))? {
        Ok(()) => (out.into_pyarray(py), -1),
        Err(i) => (Vec::<u32>::new().into_pyarray(py), i),
    })
}

/// `sink` of each item of a list or tuple while they are exact ints in 0..2**32-1 (a bool is
/// not): `Ok(Err(i))` names the first that is not, a TypeError says `seq` is neither. Read
/// through the C API (borrowed items, no reference counting, one conversion call each): a
/// tokenizer's 4,096 ids cost ~80 µs through PyO3's iterator and `extract`, several times this
/// loop.
fn each_exact_u32(seq: &Bound<'_, PyAny>, mut sink: impl FnMut(u32)) -> PyResult<Result<(), i64>> {
    use pyo3::ffi;
    use pyo3::types::{PyList, PyTuple};
    let tuple = if seq.is_instance_of::<PyList>() {
        false
    } else if seq.is_instance_of::<PyTuple>() {
        true
    } else {
        return Err(pyo3::exceptions::PyTypeError::new_err("tokens: expected a list or tuple of ints"));
    };
    let p = seq.as_ptr();
    // SAFETY: `p` is a live list or tuple (checked above) and the GIL is held.
    let n = unsafe { if tuple { ffi::PyTuple_GET_SIZE(p) } else { ffi::PyList_GET_SIZE(p) } };
    for i in 0..n {
        // SAFETY: `i` is below the length read above, and nothing in this loop runs Python code
        // (an exact int's conversion calls no user method), so the sequence cannot change
        // meanwhile; the item is borrowed from the sequence for this iteration only.
        let (ok, v) = unsafe {
            let item = if tuple { ffi::PyTuple_GET_ITEM(p, i) } else { ffi::PyList_GET_ITEM(p, i) };
            if ffi::PyLong_CheckExact(item) == 0 {
                (false, 0)
            } else {
                let v = ffi::PyLong_AsUnsignedLongLong(item);
                if v == u64::MAX && !ffi::PyErr_Occurred().is_null() {
                    ffi::PyErr_Clear(); // negative or too large for 64 bits
                    (false, 0)
                } else {
                    (v <= u32::MAX as u64, v as u32)
                }
            }
        };
        if !ok {
            return Ok(Err(i as i64));
        }
        sink(v);
    }
    Ok(Ok(()))
}

/// Token ids (a list or tuple of ints in 0..2**32-1) as little-endian u32 bytes, the form the
/// agent keys by. A bool is not a token id (TypeError), as `token_array` and `first_bad_token`
/// say.
#[pyfunction]
fn pack_tokens<'py>(py: Python<'py>, tokens: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    use pyo3::types::{PyBool, PyList, PyTuple};
    let mut out: Vec<u8> = Vec::new();
    let mut i = 0usize;
    let mut push = |t: Bound<'py, PyAny>| -> PyResult<()> {
        if t.is_instance_of::<PyBool>() {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!("tokens[{i}]: a bool is not a token id")));
        }
        out.extend_from_slice(&t.extract::<u32>()?.to_le_bytes());
        i += 1;
        Ok(())
    };
    if let Ok(l) = tokens.cast::<PyList>() {
        for t in l.iter() {
            push(t)?;
        }
    } else if let Ok(tu) = tokens.cast::<PyTuple>() {
        for t in tu.iter() {
            push(t)?;
        }
    } else {
        return Err(pyo3::exceptions::PyTypeError::new_err("tokens: expected a list or tuple of ints"));
    }
    Ok(PyBytes::new(py, &out))
}

/// The shard that owns a key.
#[pyfunction]
fn shard_of(key: u64, shards: u32) -> PyResult<u32> {
    if shards == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err("shards must be >= 1"));
    }
    Ok(chunk_hash::shard_of(key, shards))
}

// Declared GIL-dependent: parts of the bindings read numpy arrays and borrowed list items in
// place on the strength of the GIL (found in review: PyO3 0.30 declares a module GIL-free by
// default, so a free-threaded CPython would have run them unsoundly).
#[pymodule(gil_used = true)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("NO_KEY", chunk_hash::NO_KEY)?;
    m.add("NO_PARENT", crate::sim::engine::NO_PARENT)?;
    m.add("MAX_QUEUE_MS", crate::queues::MAX_QUEUE_MS)?;
    m.add("PATCH_VERSION", crate::patch::VERSION)?;
    m.add_function(wrap_pyfunction!(namespace_digest, m)?)?;
    m.add_function(wrap_pyfunction!(prefix_keys, m)?)?;
    m.add_function(wrap_pyfunction!(prefix_keys_batch, m)?)?;
    m.add_function(wrap_pyfunction!(shard_of, m)?)?;
    m.add_function(wrap_pyfunction!(block_chain_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(expand_block_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(chain_block_ids, m)?)?;
    m.add_function(wrap_pyfunction!(mix_fold, m)?)?;
    m.add_function(wrap_pyfunction!(first_bad_token, m)?)?;
    m.add_function(wrap_pyfunction!(pack_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(token_array, m)?)?;
    index::register(m)?;
    block_cache::register(m)?;
    bpe::register(m)?;
    sim::register(m)?;
    agent::register(m)?;
    router::register(m)?;
    edge_core::register(m)?;
    queues::register(m)?;
    bench::register(m)?;
    Ok(())
}
