//! Timing probes for `benches/bench_core.py`: operations timed inside Rust, so the figures are
//! the core's cost without the FFI (the script times the Python batch APIs separately, which
//! makes the boundary's overhead visible). Not used on any serving path.

use std::hint::black_box;
use std::time::Instant;

use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use sha2::{Digest, Sha256};

use super::arrays::{f64_vec, ns_bytes, u32_vec, u64_vec};
use super::errors::core_err;
use super::index::{PyLudoTable, PyLudoView};
use super::router::PyRouter;
use crate::score::{RouteScratch, ScoreParams, WorkerArrays};

/// Room for `n` samples: at most `MAX_ELEMENTS` (2^32), refused (InvalidArgumentError) before
/// anything is allocated, and MemoryError when the allocator refuses (a huge `n` panicked with
/// "capacity overflow" or aborted the process).
fn samples(n: usize) -> PyResult<Vec<f64>> {
    let n = crate::error::element_count("samples", Some(n as u64)).map_err(core_err)?;
    crate::error::vec_with_capacity("samples", n).map_err(core_err)
}

fn check_block(block: usize) -> PyResult<()> {
    if block == 0 {
        return Err(PyValueError::new_err("block must be >= 1"));
    }
    Ok(())
}

/// Mean ns per single-key `lookup` over consecutive blocks of `block` keys (one sample a block).
#[pyfunction]
#[pyo3(signature = (view, keys, block=256))]
fn bench_lookup_ns<'py>(py: Python<'py>, view: PyRef<'py, PyLudoView>, keys: &Bound<'py, PyAny>, block: usize) -> PyResult<Bound<'py, PyArray1<f64>>> {
    check_block(block)?;
    let keys = u64_vec("keys", keys)?;
    let inner = view.inner.clone();
    let out = py.detach(move || {
        let v = inner.read().expect("view lock");
        keys.chunks(block)
            .map(|c| {
                let t = Instant::now();
                let mut acc = 0u64;
                for &k in c {
                    acc = acc.wrapping_add(v.lookup(black_box(k)));
                }
                black_box(acc);
                t.elapsed().as_nanos() as f64 / c.len() as f64
            })
            .collect::<Vec<f64>>()
    });
    Ok(out.into_pyarray(py))
}

/// Per-op ns of `remove(old[i])` then `insert(new[i], value)`: occupancy stays where it is, so
/// each insert is measured at the table's current load. Batches are taken (untimed) every 256.
#[pyfunction]
fn bench_remove_insert_ns<'py>(py: Python<'py>, table: PyRef<'py, PyLudoTable>, old: &Bound<'py, PyAny>, new: &Bound<'py, PyAny>, value: u64) -> PyResult<(Bound<'py, PyArray1<f64>>, Bound<'py, PyArray1<f64>>)> {
    let old = u64_vec("old", old)?;
    let new = u64_vec("new", new)?;
    if old.len() != new.len() {
        return Err(PyValueError::new_err("old and new must have the same length"));
    }
    let tb: &PyLudoTable = &table;
    let (ins, rem) = py.detach(|| tb.with_table(|t| {
        let mut ins = Vec::with_capacity(new.len());
        let mut rem = Vec::with_capacity(old.len());
        for i in 0..new.len() {
            let a = Instant::now();
            t.remove(old[i])?;
            let b = Instant::now();
            t.insert(new[i], value)?;
            let c = Instant::now();
            rem.push((b - a).as_nanos() as f64);
            ins.push((c - b).as_nanos() as f64);
            if i % 256 == 255 {
                black_box(t.take_batch());
            }
        }
        black_box(t.take_batch());
        Ok((ins, rem))
    }))?.map_err(core_err)?;
    Ok((ins.into_pyarray(py), rem.into_pyarray(py)))
}

/// Mean ns per value update (`set` on present keys, alternating two values) per block.
#[pyfunction]
#[pyo3(signature = (table, keys, block=256))]
fn bench_update_ns<'py>(py: Python<'py>, table: PyRef<'py, PyLudoTable>, keys: &Bound<'py, PyAny>, block: usize) -> PyResult<Bound<'py, PyArray1<f64>>> {
    check_block(block)?;
    let keys = u64_vec("keys", keys)?;
    let tb: &PyLudoTable = &table;
    let out = py.detach(|| tb.with_table(|t| {
        let mut out = Vec::with_capacity(keys.len() / block + 1);
        for (bi, c) in keys.chunks(block).enumerate() {
            let v = 1 + (bi as u64 & 1);
            let a = Instant::now();
            for &k in c {
                t.set(k, v)?;
            }
            out.push(a.elapsed().as_nanos() as f64 / c.len() as f64);
            black_box(t.take_batch());
        }
        Ok(out)
    }))?.map_err(core_err)?;
    Ok(out.into_pyarray(py))
}

/// Per-call ns of the whole route loop (hashing, lookups, closure check, scoring), `n` calls of
/// the same prompt: by default each hashes it afresh (a prompt's first route); `memo=True` lets
/// the repeats come through the process's prefix memo (a prompt routed before).
#[pyfunction]
#[pyo3(signature = (router, tokens, namespace, region, beta, wan, tq, belief, n, gamma=0.005, lam=0.0, closure=true, memo=false))]
#[allow(clippy::too_many_arguments)]
fn bench_route_ns<'py>(py: Python<'py>, router: PyRef<'py, PyRouter>, tokens: &Bound<'py, PyAny>, namespace: &Bound<'py, PyAny>, region: &Bound<'py, PyAny>, beta: &Bound<'py, PyAny>, wan: &Bound<'py, PyAny>, tq: &Bound<'py, PyAny>, belief: &Bound<'py, PyAny>, n: usize, gamma: f64, lam: f64, closure: bool, memo: bool) -> PyResult<Bound<'py, PyArray1<f64>>> {
    let ns = ns_bytes(namespace)?;
    let tokens = u32_vec("tokens", tokens)?;
    let (region, beta, wan, tq, belief) = (u32_vec("region", region)?, f64_vec("beta", beta)?, f64_vec("wan", wan)?, f64_vec("tq", tq)?, f64_vec("belief", belief)?);
    let w = WorkerArrays { region: &region, beta: &beta, wan: &wan, tq: &tq, belief: &belief };
    let params = ScoreParams { gamma, lambda: lam, closure, block: 0 };
    let r = &*router;
    let mut out = samples(n)?;
    let out = py.detach(|| {
        let mut scratch = if memo { RouteScratch::new() } else { RouteScratch::cold() };
        for _ in 0..n {
            let a = Instant::now();
            black_box(r.run(&ns, black_box(&tokens), &w, &params, &mut scratch, None)?);
            out.push(a.elapsed().as_nanos() as f64);
        }
        Ok::<_, crate::error::CoreError>(out)
    })
    .map_err(core_err)?;
    Ok(out.into_pyarray(py))
}

/// Per-call ns of a plain SHA-256 over the tokens' little-endian bytes (the route's floor).
#[pyfunction]
fn bench_sha256_ns<'py>(py: Python<'py>, tokens: &Bound<'py, PyAny>, n: usize) -> PyResult<Bound<'py, PyArray1<f64>>> {
    let tokens = u32_vec("tokens", tokens)?;
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let mut out = samples(n)?;
    py.detach(|| {
        out.extend((0..n).map(|_| {
            let a = Instant::now();
            black_box(Sha256::digest(black_box(&bytes)));
            a.elapsed().as_nanos() as f64
        }))
    });
    Ok(out.into_pyarray(py))
}

/// Nanoseconds per dependent load over `mib` MiB (a pointer chase on the index arrays' kind of
/// memory): the host's memory latency, beside which the writer's per-op latencies are read.
#[pyfunction]
#[pyo3(signature = (mib=64, steps=2_000_000, seed=1))]
fn bench_mem_latency_ns(py: Python<'_>, mib: usize, steps: usize, seed: u64) -> PyResult<f64> {
    if mib == 0 || steps == 0 || mib > 4096 {
        return Err(PyValueError::new_err(format!("mib must be 1..=4096 and steps >= 1, got mib={mib} steps={steps}")));
    }
    Ok(py.detach(|| crate::ludo::mem::dependent_load_ns(mib << 20, steps, seed)))
}

/// Median ns of an empty `Instant::now()` pair: what a per-op timer adds to each sample, for
/// the script to take off the per-op figures it reports.
#[pyfunction]
#[pyo3(signature = (n=100_000))]
fn bench_timer_ns(py: Python<'_>, n: usize) -> PyResult<f64> {
    if n == 0 {
        return Err(PyValueError::new_err("n must be >= 1"));
    }
    let mut v = samples(n)?;
    Ok(py.detach(|| {
        v.extend((0..n).map(|_| {
            let a = Instant::now();
            let b = black_box(Instant::now());
            (b - a).as_nanos() as f64
        }));
        v.sort_by(|a, b| a.total_cmp(b));
        v[n / 2]
    }))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(bench_timer_ns, m)?)?;
    m.add_function(wrap_pyfunction!(bench_mem_latency_ns, m)?)?;
    m.add_function(wrap_pyfunction!(bench_lookup_ns, m)?)?;
    m.add_function(wrap_pyfunction!(bench_remove_insert_ns, m)?)?;
    m.add_function(wrap_pyfunction!(bench_update_ns, m)?)?;
    m.add_function(wrap_pyfunction!(bench_route_ns, m)?)?;
    m.add_function(wrap_pyfunction!(bench_sha256_ns, m)?)?;
    Ok(())
}
