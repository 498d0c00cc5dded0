//! `AgentForest`: the worker agent's block forest (`crate::agent_forest`), driven by
//! `kvcompass.agent.WorkerAgent`, which decodes and sequences the engine's messages.

use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use super::block_cache::PyCacheEvents;
use super::errors::core_err;
use crate::agent_forest::{BHash, Forest, Removal, Stored, MAX_FIELD};
use crate::block_cache::{Event, DRAM, VRAM};

/// Tokens as the little-endian u32 bytes the forest hashes: on such a host the tokens' own
/// memory, elsewhere a packed copy.
fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: a u32 slice is readable as 4x as many bytes.
        std::borrow::Cow::Borrowed(unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens)) })
    } else {
        std::borrow::Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
    }
}

fn bhash(obj: &Bound<'_, PyAny>) -> PyResult<BHash> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(BHash::Bytes(Box::new(b.as_bytes().into())));
    }
    Ok(BHash::Int(obj.extract::<u64>()?))
}

/// An event's block hashes: a uint64 array (the emulated engine's own, in the simulator: no
/// Python int per block), a tuple, or any sequence of ints or bytes.
fn bhashes(hashes: &Bound<'_, PyAny>) -> PyResult<Vec<BHash>> {
    if let Ok(a) = hashes.cast::<PyArray1<u64>>() {
        let ro = a.try_readonly().map_err(|e| PyValueError::new_err(format!("hashes: {e}")))?;
        return Ok(ro.as_array().iter().map(|&h| BHash::Int(h)).collect());
    }
    if let Ok(t) = hashes.cast::<PyTuple>() {
        return t.iter().map(|h| bhash(&h)).collect();
    }
    hashes.try_iter()?.map(|h| bhash(&h?)).collect()
}

#[pyclass(name = "AgentForest", module = "kvcompass._core")]
pub struct PyForest {
    inner: Forest,
}

#[pymethods]
impl PyForest {
    /// `lengths`: registration lengths; `namespace`: the digest unsalted prompts are keyed under.
    #[new]
    fn new(lengths: Vec<u32>, namespace: &[u8]) -> Self {
        PyForest { inner: Forest::new(lengths, namespace) }
    }

    /// One BlockStored: `medium` normalised (upper case, None read as "GPU"), `tokens` packed
    /// little-endian u32, `extra` one flag per block (None: no extra keys), `salt_root` the
    /// namespace digest the first block's salt names (None: none or not ours).
    #[pyo3(signature = (group, medium, block_size, tokens, lora, parent, hashes, extra, salt_root))]
    #[allow(clippy::too_many_arguments)]
    fn stored(&mut self, group: u32, medium: &str, block_size: u32, tokens: &Bound<'_, PyAny>, lora: bool, parent: Option<Bound<'_, PyAny>>, hashes: &Bound<'_, PyAny>, extra: Option<Vec<bool>>, salt_root: Option<[u8; 32]>) -> PyResult<()> {
        check_fields(group, block_size)?;
        let parent = parent.map(|p| bhash(&p)).transpose()?;
        let hashes = bhashes(hashes)?;
        let extra = extra.unwrap_or_default();
        if !extra.is_empty() && extra.len() != hashes.len() {
            // One flag a block or none (the event decoder holds engines to it; found in review:
            // a direct caller's short list read as "no extra key" for the blocks past it).
            return Err(PyValueError::new_err(format!("extra: {} flags for {} blocks (one a block, or none)", extra.len(), hashes.len())));
        }
        // The forest places each block's tokens by block size: a store must carry exactly
        // `block_size` tokens a block (the event decoder refuses anything else).
        let n_bytes = match tokens.cast::<PyBytes>() {
            Ok(b) => b.as_bytes().len(),
            Err(_) => 4 * tokens.len()?,
        };
        if n_bytes != 4 * hashes.len() * block_size as usize {
            return Err(PyValueError::new_err(format!("tokens: {n_bytes} bytes for {} blocks of {block_size} tokens (4 bytes a token)", hashes.len())));
        }
        if let Ok(b) = tokens.cast::<PyBytes>() {
            return self.inner.stored(&Stored { group, medium, block_size, tokens: b.as_bytes(), lora, parent, hashes, extra, salt_root }).map_err(core_err);
        }
        // A uint32 token array (the simulator hands the emulated engine's array over): read in
        // place when contiguous.
        let a = tokens.cast::<PyArray1<u32>>().map_err(|_| PyValueError::new_err("tokens: expected bytes (little-endian u32) or a 1-D uint32 array"))?;
        let ro = a.try_readonly().map_err(|e| PyValueError::new_err(format!("tokens: {e}")))?;
        let copied: Vec<u32>;
        let toks: &[u32] = match ro.as_slice() {
            Ok(s) => s,
            Err(_) => {
                copied = ro.as_array().iter().copied().collect();
                &copied
            }
        };
        self.inner.stored(&Stored { group, medium, block_size, tokens: &le_bytes(toks), lora, parent, hashes, extra, salt_root }).map_err(core_err)
    }

    /// Blocks named by hash alone copied to `medium` (a token-less, parent-less store); returns
    /// how many could not be placed (see `Forest::copied`).
    fn copied(&mut self, group: u32, medium: &str, hashes: &Bound<'_, PyAny>) -> PyResult<u64> {
        let hashes = bhashes(hashes)?;
        self.inner.copied(group, medium, &hashes).map_err(core_err)
    }

    /// A run of removal events: `(group, medium, hashes)` each, the hashes of one event (a
    /// sequence), taken in order as one run.
    fn removed(&mut self, run: &Bound<'_, PyList>) -> PyResult<()> {
        let mut out: Vec<Removal> = Vec::new();
        for item in run.iter() {
            let (group, medium, hashes): (u32, Bound<'_, pyo3::types::PyString>, Bound<'_, PyAny>) = item.extract()?;
            let m = self.inner.medium(medium.to_str()?).map_err(core_err)?;
            out.extend(bhashes(&hashes)?.into_iter().map(|h| (group, m, h)));
        }
        self.inner.removed(out);
        Ok(())
    }

    /// An emulated cache's events (`CacheEvents`), read in place: what `stored` and `removed`
    /// do for the same events as `kvcompass.agent.events` objects (consecutive removals as one
    /// run, the cache's medium 1 as "GPU" and 2 as "CPU", group 0, no LoRA), without an object
    /// per event. A store whose salt number is `s > 0` carries the salt as its first block's
    /// extra key (vLLM's `cache_salt`), and `roots[s]` is the namespace digest the agent keys
    /// that salt under (None: not a salt it serves, so the chain is not indexed).
    fn cache_events(&mut self, events: &Bound<'_, PyCacheEvents>, roots: &Bound<'_, PyAny>) -> PyResult<()> {
        let ev = events.get();
        let n = ev.block_size;
        check_fields(0, n)?;
        // Every salt's root is read before anything changes: a bad `roots` leaves the forest as
        // it was.
        let mut salt_roots: Vec<(u32, Option<[u8; 32]>)> = Vec::new();
        for e in &ev.events {
            if let Event::Stored { salt, .. } = e {
                if *salt != 0 && !salt_roots.iter().any(|(s, _)| s == salt) {
                    let root = roots.get_item(*salt as usize).map_err(|_| PyValueError::new_err(format!("roots: no entry for salt number {salt}")))?;
                    salt_roots.push((*salt, root.extract::<Option<[u8; 32]>>().map_err(|_| PyValueError::new_err(format!("roots[{salt}]: expected 32 bytes or None")))?));
                }
            }
        }
        let medium_name = |m: u8| if m == VRAM { "GPU" } else { "CPU" };
        let mut run: Vec<Removal> = Vec::new();
        for e in &ev.events {
            match e {
                Event::Stored { medium, hashes, parent, tokens, salt } => {
                    if !run.is_empty() {
                        self.inner.removed(std::mem::take(&mut run));
                    }
                    let (extra, salt_root) = if *salt == 0 {
                        (Vec::new(), None)
                    } else {
                        let mut extra = vec![false; hashes.len()];
                        if let Some(x) = extra.first_mut() {
                            *x = true;
                        }
                        (extra, salt_roots.iter().find(|(s, _)| s == salt).and_then(|(_, r)| *r))
                    };
                    self.inner
                        .stored(&Stored {
                        group: 0,
                        medium: medium_name(*medium),
                        block_size: n,
                        tokens: &le_bytes(tokens),
                        lora: false,
                        parent: parent.map(BHash::Int),
                        hashes: hashes.iter().map(|&h| BHash::Int(h)).collect(),
                        extra,
                        salt_root,
                    })
                        .map_err(core_err)?;
                }
                Event::Removed { medium, hashes } => {
                    debug_assert!(*medium == VRAM || *medium == DRAM);
                    let m = self.inner.medium(medium_name(*medium)).map_err(core_err)?;
                    run.extend(hashes.iter().map(|&h| (0, m, BHash::Int(h))));
                }
            }
        }
        if !run.is_empty() {
            self.inner.removed(run);
        }
        Ok(())
    }

    fn clear(&mut self) {
        self.inner.clear();
    }

    fn forget_changes(&mut self) {
        self.inner.forget_changes();
    }

    /// `[(shard, keys, tiers)]`: the key ops since the last flush (see `Forest::flush`);
    /// InvalidArgumentError, and nothing changes, for `shards == 0` or a reset shard not below it.
    #[allow(clippy::type_complexity)]
    fn flush<'py>(&mut self, py: Python<'py>, shards: u32, reset: Vec<u32>) -> PyResult<Vec<(u32, Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<u8>>)>> {
        Ok(self.inner.flush(shards, &reset).map_err(core_err)?.into_iter().map(|(s, k, t)| (s, k.into_pyarray(py), t.into_pyarray(py))).collect())
    }

    /// `(keys, tiers)` of every key held now.
    fn held<'py>(&self, py: Python<'py>) -> (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<u8>>) {
        let (k, t): (Vec<u64>, Vec<u8>) = self.inner.held().into_iter().unzip();
        (k.into_pyarray(py), t.into_pyarray(py))
    }

    fn digest<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.digest())
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Bytes the forest holds on the heap (blocks, their side tables, indexes, the key
    /// counts): what a Python heap profiler cannot see.
    fn memory_bytes(&self) -> usize {
        self.inner.memory_bytes()
    }

    /// `memory_bytes` by part (blocks, fingerprints, key_counts, children, other).
    fn memory_breakdown(&self) -> std::collections::BTreeMap<&'static str, usize> {
        self.inner.memory_breakdown().into_iter().collect()
    }

    /// blocks_stored, blocks_removed, orphans, adopted, unindexed, unknown_removals, conflicts,
    /// ambiguous_parents, ambiguous_removals.
    fn stats(&self) -> [u64; 9] {
        let s = self.inner.stats;
        [s.blocks_stored, s.blocks_removed, s.orphans, s.adopted, s.unindexed, s.unknown_removals, s.conflicts, s.ambiguous_parents, s.ambiguous_removals]
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyForest>()?;
    Ok(())
}

/// A block's KV group and token count fit the forest's 16 bits ([`MAX_FIELD`]; the event
/// decoder refuses larger ones first), and a block holds at least one token.
fn check_fields(group: u32, block_size: u32) -> PyResult<()> {
    if group > MAX_FIELD || block_size > MAX_FIELD {
        return Err(PyValueError::new_err(format!("group {group} / block size {block_size}: a block forest keeps each below {}", MAX_FIELD + 1)));
    }
    if block_size == 0 {
        return Err(PyValueError::new_err("block size 0: a block holds at least one token"));
    }
    Ok(())
}
