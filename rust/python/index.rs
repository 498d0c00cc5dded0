//! `LudoTable` (the writer of one (table, shard)) and `LudoView` (an edge's keyless replica).

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::arrays::{u32_vec, u64_vec, u8_vec};
use super::errors::core_err;
use crate::ludo::maintenance::{LudoTable, Placement, TableConfig};
use crate::ludo::view::LudoView;

fn poisoned() -> PyErr {
    PyRuntimeError::new_err("internal lock poisoned by an earlier panic")
}

/// The writer of one (table, shard): keyed Ludo table plus a mirror of the keyless view.
#[pyclass(name = "LudoTable", module = "kvcompass._core", frozen)]
pub struct PyLudoTable {
    inner: RwLock<LudoTable>,
}

impl PyLudoTable {
    /// Run `f` with the table locked for writing (for callers inside the bindings).
    pub(crate) fn with_table<T>(&self, f: impl FnOnce(&mut LudoTable) -> T) -> PyResult<T> {
        let mut g = self.w()?;
        Ok(f(&mut g))
    }
    fn r(&self) -> PyResult<RwLockReadGuard<'_, LudoTable>> {
        self.inner.read().map_err(|_| poisoned())
    }
    fn w(&self) -> PyResult<RwLockWriteGuard<'_, LudoTable>> {
        self.inner.write().map_err(|_| poisoned())
    }
    /// Run a write that may rebuild the table (a rebuild of millions of keys takes about a
    /// second) with the GIL released. The lock is taken and dropped inside, never held while
    /// the GIL is taken back: a thread holding the GIL and waiting on the lock would deadlock
    /// with this one.
    fn write_detached<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut LudoTable) -> crate::error::Result<T> + Send) -> PyResult<T> {
        py.detach(|| self.with_table(f))?.map_err(core_err)
    }
}

fn placement_str(p: Placement) -> &'static str {
    match p {
        Placement::Bucket { .. } => "bucket",
        Placement::Fallback => "fallback",
        Placement::Updated => "updated",
    }
}

#[allow(clippy::too_many_arguments)]
fn config(table: u32, shard: u32, epoch: u64, capacity: u64, value_bits: u8, fp_bits: u8, seed: u64, max_capacity: u64, fallback_limit: usize) -> TableConfig {
    TableConfig { table, shard, epoch, capacity, value_bits, fp_bits, seed, max_capacity, fallback_limit }
}

#[pymethods]
impl PyLudoTable {
    #[new]
    #[pyo3(signature = (table=0, shard=0, epoch=1, capacity=1024, value_bits=32, fp_bits=0, seed=0, max_capacity=1u64 << 32, fallback_limit=64))]
    #[allow(clippy::too_many_arguments)]
    fn new(table: u32, shard: u32, epoch: u64, capacity: u64, value_bits: u8, fp_bits: u8, seed: u64, max_capacity: u64, fallback_limit: usize) -> PyResult<Self> {
        let t = LudoTable::new(config(table, shard, epoch, capacity, value_bits, fp_bits, seed, max_capacity, fallback_limit)).map_err(core_err)?;
        Ok(PyLudoTable { inner: RwLock::new(t) })
    }

    /// Bulk build from parallel key/value arrays (later duplicates win); emits no patches.
    #[staticmethod]
    #[pyo3(signature = (keys, values, table=0, shard=0, epoch=1, capacity=0, value_bits=32, fp_bits=0, seed=0, max_capacity=1u64 << 32, fallback_limit=64))]
    #[allow(clippy::too_many_arguments)]
    fn build(py: Python<'_>, keys: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>, table: u32, shard: u32, epoch: u64, capacity: u64, value_bits: u8, fp_bits: u8, seed: u64, max_capacity: u64, fallback_limit: usize) -> PyResult<Self> {
        let k = u64_vec("keys", keys)?;
        let v = u64_vec("values", values)?;
        if k.len() != v.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!("{} keys but {} values", k.len(), v.len())));
        }
        let cfg = config(table, shard, epoch, capacity, value_bits, fp_bits, seed, max_capacity, fallback_limit);
        let t = py.detach(|| {
            let entries: Vec<(u64, u64)> = k.into_iter().zip(v).collect();
            LudoTable::build(cfg, &entries)
        });
        Ok(PyLudoTable { inner: RwLock::new(t.map_err(core_err)?) })
    }

    /// Insert a new key (error if present). Returns "bucket" or "fallback". The GIL is
    /// released (the insert may rebuild the table).
    fn insert(&self, py: Python<'_>, key: u64, value: u64) -> PyResult<&'static str> {
        Ok(placement_str(self.write_detached(py, |g| g.insert(key, value))?))
    }
    /// Change an existing key's value (KeyNotFoundError if absent); 0 removes it.
    fn update(&self, py: Python<'_>, key: u64, value: u64) -> PyResult<()> {
        self.write_detached(py, |g| g.update(key, value).map(|_| ()))
    }
    /// Upsert; 0 removes. The GIL is released (the write may rebuild the table).
    fn set(&self, py: Python<'_>, key: u64, value: u64) -> PyResult<&'static str> {
        Ok(placement_str(self.write_detached(py, |g| g.set(key, value))?))
    }
    /// Remove a key; returns its old value or None.
    fn remove(&self, key: u64) -> PyResult<Option<u64>> {
        self.w()?.remove(key).map_err(core_err)
    }
    /// Keyed read (no false hits).
    fn get(&self, key: u64) -> PyResult<Option<u64>> {
        Ok(self.r()?.get(key))
    }
    fn __contains__(&self, key: u64) -> PyResult<bool> {
        Ok(self.r()?.get(key).is_some())
    }
    fn __len__(&self) -> PyResult<usize> {
        Ok(self.r()?.len() as usize)
    }
    /// Set one worker's 2-bit tier field; returns the key's new value. The GIL is released
    /// (the write may rebuild the table).
    fn set_field(&self, py: Python<'_>, key: u64, field: u32, tier: u8) -> PyResult<u64> {
        self.write_detached(py, |g| g.set_field(key, field, tier))
    }
    /// Apply many field ops (validated first, GIL released); returns how many were applied.
    fn apply_field_ops(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, fields: &Bound<'_, PyAny>, tiers: &Bound<'_, PyAny>) -> PyResult<usize> {
        let k = u64_vec("keys", keys)?;
        let f = u32_vec("fields", fields)?;
        let t = u8_vec("tiers", tiers)?;
        py.detach(|| self.with_table(|g| g.apply_field_ops(&k, &f, &t)))?.map_err(core_err)
    }
    /// One agent batch as a maintenance unit takes it (`MaintenanceUnit._apply` holds the
    /// rules and raises the errors), in one call: every op checked (`crate::key_ops::first_bad`),
    /// then coalesced against the sorted keys the worker `owned` (a reset), and when `apply`
    /// (the batch is in sequence and no duplicate), checked against `max_capacity` and written
    /// into the worker's two-bit `field`. Returns `(bad, at, ops, cleared)`: `bad` 0 when the
    /// batch is good (then `ops` coalesced ops, `cleared` of them removals of an owned key);
    /// 1, 2, 3: `keys[at]` is not 63-bit, `keys[at]` belongs to another shard, `tiers[at]` is
    /// above 2 (nothing checked further); 4: the writes would grow the table to `at` keys, past
    /// `max_capacity` (nothing written). The GIL is released around a long batch's writes.
    #[allow(clippy::too_many_arguments)]
    fn apply_agent_ops(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        tiers: &Bound<'_, PyAny>,
        shard: u64,
        shards: u64,
        owned: &Bound<'_, PyAny>,
        field: u32,
        max_capacity: u64,
        apply: bool,
    ) -> PyResult<(u8, u64, usize, usize)> {
        use crate::key_ops::{coalesce, first_bad, BadOp};
        // Copies, checked and used alike: holding the GIL does not freeze a numpy array (its own
        // loops write without the GIL), so checking the caller's array and then reading it again
        // let keys of another shard past the check (found in review); nor may a borrow span the
        // GIL-free write (an array resized meanwhile aborted the process when the borrow ended).
        let (k, t, o) = (u64_vec("keys", keys)?, u8_vec("tiers", tiers)?, u64_vec("owned", owned)?);
        let (k, t, o) = (k.as_slice(), t.as_slice(), o.as_slice());
        if k.len() != t.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!("{} keys but {} tiers", k.len(), t.len())));
        }
        if shards == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err("shards must be >= 1"));
        }
        if shard >= shards {
            return Err(pyo3::exceptions::PyValueError::new_err(format!("shard {shard} of {shards} shards: shards are 0..{shards}")));
        }
        // `owned` is searched by bisection: unsorted, it miscounted the cleared keys.
        if let Some(i) = crate::key_ops::first_unsorted(o) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!("owned must be sorted ascending: owned[{i}] = {} follows {}", o[i], o[i - 1])));
        }
        // The field first: a shift past the value's bits in the capacity check below reported an
        // out-of-range field as a capacity failure (found in review).
        let fields = self.with_table(|g| u32::from(g.value_bits()) / 2)?;
        if field >= fields {
            return Err(core_err(crate::error::CoreError::InvalidField { field, fields }));
        }
        match first_bad(k, t, shard, shards) {
            Some(BadOp::Key(i)) => return Ok((1, i as u64, 0, 0)),
            Some(BadOp::Shard(i)) => return Ok((2, i as u64, 0, 0)),
            Some(BadOp::Tier(i)) => return Ok((3, i as u64, 0, 0)),
            None => {}
        }
        let (ck, ct, cleared) = coalesce(k, t, o);
        if !apply {
            return Ok((0, 0, ck.len(), cleared));
        }
        let write = |g: &mut LudoTable| -> crate::error::Result<(u8, u64)> {
            // The caller's maximum (a unit's budget, at most the table's own) is checked here,
            // with the core's own count of the batch's peak, only near it; the core refuses past
            // the table's maximum before applying anything too. Removals come first, so the
            // table peaks after them.
            let fields = vec![field; ck.len()];
            if g.len() + ck.len() as u64 > max_capacity {
                let needed = g.peak_len(&ck, &fields, &ct);
                // A table already past the budget (a unit restored under a lower --max-keys)
                // still takes a batch that does not grow it: removals and tier changes must go
                // on (found in review: every batch was refused, so it could never shrink).
                if needed > max_capacity && needed > g.len() {
                    return Ok((4, needed));
                }
            }
            g.apply_field_ops(&ck, &fields, &ct)?;
            Ok((0, 0))
        };
        // The GIL is released around every write: any batch, however small, may rebuild the
        // table (about a second at millions of keys), which a 256-op threshold did not see.
        let (bad, at) = self.write_detached(py, write)?;
        Ok((bad, at, ck.len(), cleared))
    }

    /// Close the pending edits into the next sequenced batch; None when nothing changed.
    fn take_batch<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        Ok(self.w()?.take_batch().map(|b| PyBytes::new(py, &b)))
    }
    /// A snapshot batch at the last emitted seq (refused while edits are pending).
    fn export_snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        // Never hold the lock across re-taking the GIL: a writer holding the GIL would wait on
        // the lock while this thread waits on the GIL.
        let b = py.detach(|| self.r().map(|g| g.export_snapshot()))?.map_err(core_err)?;
        Ok(PyBytes::new(py, &b))
    }
    /// Begin a new epoch (a restarted writer); seq restarts at 0.
    fn start_epoch(&self, epoch: u64) -> PyResult<()> {
        self.w()?.start_epoch(epoch).map_err(core_err)
    }
    /// Rebuild now (new seed, same or given capacity); the next batch carries a snapshot. The
    /// GIL is released meanwhile.
    #[pyo3(signature = (capacity=None))]
    fn rebuild(&self, py: Python<'_>, capacity: Option<u64>) -> PyResult<()> {
        self.write_detached(py, |g| {
            let cap = capacity.unwrap_or_else(|| g.reseed_capacity()); // the current capacity, within the maximum
            let seed = g.geometry().seed.wrapping_add(1);
            g.rebuild(cap, seed)
        })
    }
    /// Keyless lookup through the writer's mirror view (what an edge would answer).
    fn view_lookup(&self, key: u64) -> PyResult<u64> {
        Ok(self.r()?.view().lookup(key))
    }
    /// The mirror view's canonical state bytes.
    fn view_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.r()?.view().state_bytes()))
    }
    /// SHA-256 of the mirror view's state: equal digests mean identical views.
    fn digest<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.r()?.view().digest()))
    }
    /// All live (keys, values) as two uint64 arrays.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<u64>>)> {
        let e = self.r()?.entries();
        let (k, v): (Vec<u64>, Vec<u64>) = e.into_iter().unzip();
        Ok((k.into_pyarray(py), v.into_pyarray(py)))
    }
    /// Check every key resolves through the keyless mirror to its own value.
    fn verify(&self) -> PyResult<()> {
        self.r()?.verify().map_err(core_err)
    }
    #[getter]
    fn table(&self) -> PyResult<u32> {
        Ok(self.r()?.config().table)
    }
    #[getter]
    fn shard(&self) -> PyResult<u32> {
        Ok(self.r()?.config().shard)
    }
    #[getter]
    fn epoch(&self) -> PyResult<u64> {
        Ok(self.r()?.epoch())
    }
    #[getter]
    fn seq(&self) -> PyResult<u64> {
        Ok(self.r()?.seq())
    }
    #[getter]
    fn capacity(&self) -> PyResult<u64> {
        Ok(self.r()?.capacity())
    }
    #[getter]
    fn value_bits(&self) -> PyResult<u8> {
        Ok(self.r()?.value_bits())
    }
    #[getter]
    fn fp_bits(&self) -> PyResult<u8> {
        Ok(self.r()?.geometry().fp_bits)
    }
    #[getter]
    fn fallback_len(&self) -> PyResult<usize> {
        Ok(self.r()?.fallback_len())
    }
    #[getter]
    fn rebuilds(&self) -> PyResult<u64> {
        Ok(self.r()?.rebuilds())
    }
    #[getter]
    fn pending_ops(&self) -> PyResult<u32> {
        Ok(self.r()?.pending_ops())
    }
    /// Bytes held by the writer (keys, Othello forest, mirror view with the values, scratch).
    #[getter]
    fn memory_bytes(&self) -> PyResult<usize> {
        Ok(self.r()?.memory_bytes())
    }
    /// Bytes a replica of this table's view holds.
    #[getter]
    fn view_memory_bytes(&self) -> PyResult<usize> {
        Ok(self.r()?.view().memory_bytes())
    }
    /// `memory_bytes` by part (keys, meta, view, forest_nodes, forest_lists, scratch, pending).
    #[getter]
    fn memory_breakdown<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, bytes) in self.r()?.memory_parts() {
            d.set_item(name, bytes)?;
        }
        Ok(d)
    }
    /// Insert and Othello-walk counters since the table was created: `inserts_by_moves` (a list:
    /// inserts that needed k cuckoo moves, k = 0..), `fallback_inserts`, `joins`/`join_nodes`
    /// (cycle checks of new keys and the forest nodes they visited), `toggles`/`toggle_nodes`/
    /// `toggle_flips` (moved keys' class-bit changes, nodes visited, cells flipped).
    fn write_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (w, f) = self.r()?.write_stats();
        let d = PyDict::new(py);
        d.set_item("inserts_by_moves", w.inserts_by_moves.to_vec())?;
        d.set_item("fallback_inserts", w.fallback_inserts)?;
        d.set_item("joins", f.joins)?;
        d.set_item("join_nodes", f.join_nodes)?;
        d.set_item("toggles", f.toggles)?;
        d.set_item("toggle_nodes", f.toggle_nodes)?;
        d.set_item("toggle_flips", f.toggle_flips)?;
        Ok(d)
    }
    fn __repr__(&self) -> PyResult<String> {
        let g = self.r()?;
        Ok(format!("LudoTable(table={}, shard={}, epoch={}, seq={}, len={}, capacity={}, value_bits={}, fp_bits={})", g.config().table, g.config().shard, g.epoch(), g.seq(), g.len(), g.capacity(), g.value_bits(), g.geometry().fp_bits))
    }
}

/// Outcome of applying a batch to a view.
#[pyclass(name = "ApplyResult", module = "kvcompass._core", frozen, get_all)]
pub struct PyApplyResult {
    epoch: u64,
    seq: u64,
    ops: u32,
    snapshot: bool,
}

#[pymethods]
impl PyApplyResult {
    fn __repr__(&self) -> String {
        format!("ApplyResult(epoch={}, seq={}, ops={}, snapshot={})", self.epoch, self.seq, self.ops, if self.snapshot { "True" } else { "False" })
    }
}

/// An edge's keyless replica of one (table, shard). Shared (not copied) with Routers.
#[pyclass(name = "LudoView", module = "kvcompass._core", frozen)]
pub struct PyLudoView {
    pub(crate) inner: Arc<RwLock<LudoView>>,
}

impl PyLudoView {
    fn r(&self) -> PyResult<RwLockReadGuard<'_, LudoView>> {
        self.inner.read().map_err(|_| poisoned())
    }
}

#[pymethods]
impl PyLudoView {
    #[new]
    fn new(table: u32, shard: u32) -> Self {
        PyLudoView { inner: Arc::new(RwLock::new(LudoView::new(table, shard))) }
    }

    /// Apply one encoded batch: only the next seq of the current epoch, or a snapshot not older
    /// than the view. Raises a PatchError subclass and leaves the view unchanged otherwise.
    fn apply_batch(&self, py: Python<'_>, batch: &[u8]) -> PyResult<PyApplyResult> {
        let bytes = batch.to_vec();
        let inner = self.inner.clone();
        let a = py
            .detach(move || {
                let mut g = inner.write().map_err(|_| crate::error::CoreError::InvalidArgument("lock poisoned".into()))?;
                g.apply_batch(&bytes)
            })
            .map_err(core_err)?;
        Ok(PyApplyResult { epoch: a.epoch, seq: a.seq, ops: a.ops, snapshot: a.snapshot })
    }
    /// The value under `key` (0 = no holder; may be a structural false hit without fingerprints).
    fn lookup(&self, key: u64) -> PyResult<u64> {
        Ok(self.r()?.lookup(key))
    }
    /// Batch lookup with prefetching (GIL released); uint64 in, uint64 out.
    fn lookup_batch<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let k = u64_vec("keys", keys)?;
        // The read lock is taken and dropped inside the GIL-free section (see export_snapshot).
        let out = py.detach(|| {
            self.r().map(|g| {
                let mut out = vec![0u64; k.len()];
                g.lookup_batch(&k, &mut out);
                out
            })
        })?;
        Ok(out.into_pyarray(py))
    }
    fn state_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.r()?.state_bytes()))
    }
    fn digest<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.r()?.digest()))
    }
    /// Occupied slots plus fallback entries (a full scan).
    fn count_entries(&self) -> PyResult<u64> {
        Ok(self.r()?.count_entries())
    }
    /// Shape of the view as a dict, or None before the first snapshot.
    fn geometry<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(g) = self.r()?.geometry() else { return Ok(None) };
        let d = PyDict::new(py);
        d.set_item("value_bits", g.value_bits)?;
        d.set_item("fp_bits", g.fp_bits)?;
        d.set_item("seed", g.seed)?;
        d.set_item("n_buckets", g.n_buckets)?;
        d.set_item("ma", g.ma)?;
        d.set_item("mb", g.mb)?;
        d.set_item("capacity", g.capacity())?;
        Ok(Some(d))
    }
    #[getter]
    fn table(&self) -> PyResult<u32> {
        Ok(self.r()?.table())
    }
    #[getter]
    fn shard(&self) -> PyResult<u32> {
        Ok(self.r()?.shard())
    }
    #[getter]
    fn epoch(&self) -> PyResult<u64> {
        Ok(self.r()?.epoch())
    }
    #[getter]
    fn seq(&self) -> PyResult<u64> {
        Ok(self.r()?.seq())
    }
    #[getter]
    fn initialised(&self) -> PyResult<bool> {
        Ok(self.r()?.is_initialised())
    }
    #[getter]
    fn fallback_len(&self) -> PyResult<usize> {
        Ok(self.r()?.fallback_len())
    }
    #[getter]
    fn memory_bytes(&self) -> PyResult<usize> {
        Ok(self.r()?.memory_bytes())
    }
    fn __repr__(&self) -> PyResult<String> {
        let g = self.r()?;
        Ok(format!("LudoView(table={}, shard={}, epoch={}, seq={}, initialised={})", g.table(), g.shard(), g.epoch(), g.seq(), if g.is_initialised() { "True" } else { "False" }))
    }
}

/// Decode a batch's header (checks framing and checksum) without applying it.
#[pyfunction]
fn decode_batch_header<'py>(py: Python<'py>, batch: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let h = crate::patch::decode_header(batch).map_err(core_err)?;
    let d = PyDict::new(py);
    d.set_item("table", h.table)?;
    d.set_item("shard", h.shard)?;
    d.set_item("epoch", h.epoch)?;
    d.set_item("seq", h.seq)?;
    d.set_item("n_ops", h.n_ops)?;
    Ok(d)
}

/// Apply `batches` in order to the views they name (`views`: (table, shard) -> LudoView), as
/// `LudoView.apply_batch` each, until one does not apply (a malformed header, a view this dict
/// lacks, or any refusal), which is left unapplied with every later one; returns how many
/// applied and how many of those were snapshots. The caller handles the rest one by one (an
/// edge delivering a round of patches: most rounds apply whole, in one call).
#[pyfunction]
fn apply_view_batches(py: Python<'_>, views: &Bound<'_, PyDict>, batches: Vec<Vec<u8>>) -> PyResult<(usize, usize)> {
    let mut targets: Vec<Arc<RwLock<LudoView>>> = Vec::with_capacity(batches.len());
    for b in &batches {
        let Ok(h) = crate::patch::decode_header(b) else { break };
        let Some(v) = views.get_item((h.table, h.shard))? else { break };
        let Ok(v) = v.cast::<PyLudoView>() else { break };
        targets.push(v.borrow().inner.clone());
    }
    Ok(py.detach(move || {
        let (mut applied, mut snapshots) = (0, 0);
        for (b, v) in batches.iter().zip(&targets) {
            let Ok(mut g) = v.write() else { break };
            match g.apply_batch(b) {
                Ok(a) => {
                    applied += 1;
                    snapshots += usize::from(a.snapshot);
                }
                Err(_) => break,
            }
        }
        (applied, snapshots)
    }))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLudoTable>()?;
    m.add_class::<PyLudoView>()?;
    m.add_class::<PyApplyResult>()?;
    m.add_function(wrap_pyfunction!(decode_batch_header, m)?)?;
    m.add_function(wrap_pyfunction!(apply_view_batches, m)?)?;
    Ok(())
}
