//! `BlockCache`: the emulated engine's prefix cache (`crate::block_cache`), wrapped by
//! `kvcompass.engine.cache.PrefixCache`, which checks arguments and turns the raw events returned
//! here into `kvcompass.agent.events` objects.

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::arrays::{u32_vec, u64_vec};
use super::errors::core_err;
use crate::block_cache::{BlockCache, Event, DRAM, VRAM};
use crate::error::CoreError;

/// `(hash, parent, position, tier, uses, last)`.
type BlockRow = (u64, Option<u64>, u32, u8, u64, f64);

#[pyclass(name = "BlockCache", module = "kvcompass._core")]
pub struct PyBlockCache {
    pub(crate) inner: BlockCache,
}

fn tier_arg(tier: u8) -> PyResult<u8> {
    if tier == VRAM || tier == DRAM {
        Ok(tier)
    } else {
        Err(core_err(CoreError::InvalidTier(tier)))
    }
}

/// Events as tuples: `(True, medium, hashes, parent or None, tokens, salt)` for a store,
/// `(False, medium, hashes)` for a removal; hashes uint64 and tokens uint32 arrays.
pub(crate) fn events_out<'py>(py: Python<'py>, events: Vec<Event>) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for e in events {
        match e {
            Event::Stored { medium, hashes, parent, tokens, salt } => {
                let t = PyTuple::new(py, [true.into_pyobject(py)?.to_owned().into_any(), medium.into_pyobject(py)?.into_any(), hashes.into_pyarray(py).into_any(), parent.into_pyobject(py)?.into_any(), tokens.into_pyarray(py).into_any(), salt.into_pyobject(py)?.into_any()])?;
                out.append(t)?;
            }
            Event::Removed { medium, hashes } => {
                let t = PyTuple::new(py, [false.into_pyobject(py)?.to_owned().into_any(), medium.into_pyobject(py)?.into_any(), hashes.into_pyarray(py).into_any()])?;
                out.append(t)?;
            }
        }
    }
    Ok(out)
}

/// A batch of the emulated cache's events kept as Rust values: the simulator's engine hands one
/// to its driver at every admit, and a worker agent's forest reads it in place
/// (`AgentForest.cache_events`), so no Python object is built per event or per block on the way.
#[pyclass(name = "CacheEvents", module = "kvcompass._core", frozen)]
pub struct PyCacheEvents {
    pub(crate) events: Vec<Event>,
    pub(crate) block_size: u32,
}

impl PyCacheEvents {
    pub(crate) fn new_inner(events: Vec<Event>, block_size: u32) -> Self {
        PyCacheEvents { events, block_size }
    }
}

#[pymethods]
impl PyCacheEvents {
    /// From the tuples `BlockCache.place_*` returns (see `events_out`), for a cache of
    /// `block_size` tokens a block.
    #[new]
    fn new(raw: &Bound<'_, PyList>, block_size: u32) -> PyResult<Self> {
        let mut events = Vec::with_capacity(raw.len());
        for (i, item) in raw.iter().enumerate() {
            let t = item.cast::<PyTuple>().map_err(|_| pyo3::exceptions::PyValueError::new_err(format!("events[{i}]: expected a tuple")))?;
            let stored: bool = t.get_item(0)?.extract()?;
            let medium: u8 = t.get_item(1)?.extract()?;
            tier_arg(medium)?;
            let hashes = u64_vec(&format!("events[{i}] hashes"), &t.get_item(2)?)?;
            if stored {
                if t.len() != 6 {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!("events[{i}]: a store is (True, medium, hashes, parent, tokens, salt)")));
                }
                let parent: Option<u64> = t.get_item(3)?.extract()?;
                let tokens = u32_vec(&format!("events[{i}] tokens"), &t.get_item(4)?)?;
                if tokens.len() != hashes.len() * block_size as usize {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!("events[{i}]: {} tokens for {} blocks of {block_size}", tokens.len(), hashes.len())));
                }
                let salt: u32 = t.get_item(5)?.extract()?;
                events.push(Event::Stored { medium, hashes, parent, tokens, salt });
            } else {
                events.push(Event::Removed { medium, hashes });
            }
        }
        Ok(PyCacheEvents { events, block_size })
    }

    #[getter]
    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn __len__(&self) -> usize {
        self.events.len()
    }

    /// The events as the tuples `BlockCache.place_*` returns (for `PrefixCache.events_from_core`).
    fn raw<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        events_out(py, self.events.clone())
    }
}

impl PyBlockCache {
    /// A placement: the prompt's chain (remembered or hashed) and `f`, without the GIL.
    fn place<'py, F>(&mut self, py: Python<'py>, tokens: &Bound<'py, PyAny>, salt_seed: u64, f: F) -> PyResult<Bound<'py, PyList>>
    where
        F: FnOnce(&mut BlockCache, &[u32], &[u64]) -> crate::error::Result<Vec<Event>> + Send,
    {
        let tokens = u32_vec("tokens", tokens)?;
        let inner = &mut self.inner;
        let out = py
            .detach(|| {
                let chain = inner.chain(&tokens, salt_seed)?;
                f(inner, &tokens, &chain)
            })
            .map_err(core_err)?;
        events_out(py, out)
    }
}

#[pymethods]
impl PyBlockCache {
    #[new]
    #[pyo3(signature = (block_size, vram_blocks, dram_blocks, lfu, name_seed=0))]
    fn new(block_size: usize, vram_blocks: usize, dram_blocks: usize, lfu: bool, name_seed: u64) -> PyResult<Self> {
        Ok(PyBlockCache { inner: BlockCache::new(block_size, vram_blocks, dram_blocks, lfu, name_seed).map_err(core_err)? })
    }

    /// Bytes of this thread's chain memo, shared by every cache (a few prompts).
    #[staticmethod]
    fn memo_bytes() -> usize {
        crate::block_cache::memo_bytes()
    }

    /// `(vram_blocks, dram_blocks)` of the longest cached prefix of `tokens` (`salt_seed`: the cache salt's, 0 for none).
    fn lookup(&mut self, py: Python<'_>, tokens: &Bound<'_, PyAny>, salt_seed: u64) -> PyResult<(usize, usize)> {
        let tokens = u32_vec("tokens", tokens)?;
        let inner = &mut self.inner;
        py.detach(|| {
            let chain = inner.chain(&tokens, salt_seed)?;
            Ok(inner.lookup(&chain))
        })
        .map_err(core_err)
    }

    /// `(vram_blocks, dram_blocks)` the prompt `tokens` takes from the cache when an engine
    /// schedules it: the longest cached prefix, never its last token (vLLM's cap).
    fn prompt_hit(&mut self, py: Python<'_>, tokens: &Bound<'_, PyAny>, salt_seed: u64) -> PyResult<(usize, usize)> {
        let tokens = u32_vec("tokens", tokens)?;
        let inner = &mut self.inner;
        py.detach(|| {
            let chain = inner.chain(&tokens, salt_seed)?;
            Ok(inner.prompt_hit(&chain, tokens.len(), false))
        })
        .map_err(core_err)
    }

    /// Every full block of `tokens` (up to VRAM capacity) into VRAM; `request`: an admit (hit
    /// statistics counted), else a copy. Returns the events (empty unless `events`).
    #[pyo3(signature = (tokens, salt_seed, now, salt, request, events=true))]
    #[allow(clippy::too_many_arguments)]
    fn place_vram<'py>(&mut self, py: Python<'py>, tokens: &Bound<'py, PyAny>, salt_seed: u64, now: f64, salt: u32, request: bool, events: bool) -> PyResult<Bound<'py, PyList>> {
        self.place(py, tokens, salt_seed, |c, t, chain| c.place_vram(t, chain, now, salt, request, events))
    }

    /// The blocks of `tokens` missing past its cached prefix into DRAM (a cross-region copy).
    #[pyo3(signature = (tokens, salt_seed, now, salt, events=true))]
    fn place_dram<'py>(&mut self, py: Python<'py>, tokens: &Bound<'py, PyAny>, salt_seed: u64, now: f64, salt: u32, events: bool) -> PyResult<Bound<'py, PyList>> {
        self.place(py, tokens, salt_seed, |c, t, chain| c.place_dram(t, chain, now, salt, events))
    }

    fn clear(&mut self) {
        self.inner.clear();
    }

    /// VRAM holds `blocks` (>= 1) from now: what no longer fits is demoted (dropped without
    /// DRAM), and the events say so (empty unless `events`). The KV pool's share for the cache.
    #[pyo3(signature = (blocks, events=true))]
    fn set_vram_capacity<'py>(&mut self, py: Python<'py>, blocks: usize, events: bool) -> PyResult<Bound<'py, PyList>> {
        let out = self.inner.set_vram_capacity(blocks, events).map_err(core_err)?;
        events_out(py, out)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Blocks cached in `tier` (1: VRAM, 2: DRAM).
    fn used(&self, tier: u8) -> PyResult<usize> {
        Ok(self.inner.used(tier_arg(tier)?))
    }

    fn capacity(&self, tier: u8) -> PyResult<usize> {
        Ok(self.inner.capacity(tier_arg(tier)?))
    }

    /// Entries (live or stale) in the victim heap of `tier`.
    fn heap_len(&self, tier: u8) -> PyResult<usize> {
        Ok(self.inner.heap_len(tier_arg(tier)?))
    }

    /// Heap bytes held by the cache (Rust allocations, invisible to tracemalloc).
    fn memory_bytes(&self) -> usize {
        self.inner.memory_bytes()
    }

    /// 0 (absent), 1 (VRAM) or 2 (DRAM).
    fn tier_of(&self, block_hash: u64) -> u8 {
        self.inner.tier_of(block_hash)
    }

    /// The counters, in `kvcompass.engine.cache.CacheStats` field order.
    fn stats(&self) -> [u64; 11] {
        let s = self.inner.stats;
        [s.admits, s.copies, s.clears, s.prompt_tokens, s.vram_hit_tokens, s.dram_hit_tokens, s.stored_blocks, s.promoted_blocks, s.demoted_blocks, s.evicted_blocks, s.truncated_blocks]
    }

    /// Every cached block in storage order: `(hash, parent or None, position, tier, uses, last)`.
    fn blocks(&self) -> Vec<BlockRow> {
        self.inner.blocks().into_iter().map(|b| (b.hash, b.parent, b.position, b.tier, b.uses, b.last)).collect()
    }

    /// This cache's names for the full blocks of `tokens` (see `crate::block_cache::BlockCache::chain`).
    fn chain<'py>(&self, py: Python<'py>, tokens: &Bound<'py, PyAny>, salt_seed: u64) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let tokens = u32_vec("tokens", tokens)?;
        let inner = &self.inner;
        Ok(py.detach(|| inner.chain(&tokens, salt_seed)).map_err(core_err)?.into_pyarray(py))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockCache>()?;
    m.add_class::<PyCacheEvents>()?;
    Ok(())
}
