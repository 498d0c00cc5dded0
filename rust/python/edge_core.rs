//! `EdgeCore`: what an edge does for each request around its router, in one call. Drop the
//! speculative entries and dispatch charges whose time ran out, price capacity, route (the
//! `Router`), draw among near-equal winners with the edge's own generator, and commit the winner:
//! its score terms, the dispatch charge, speculative entries at the plan lengths the prompt
//! reaches toward the winner's region, and the prefix family's key.
//!
//! `kvcompass.discovery.edge.Edge` keeps its API and what the design card keeps in Python: the
//! cache belief (passed in as an array), hotness, the migration policy, and the decision record.
//! Why here: the same steps as Python statements around the router's call cost about as much as
//! the route itself (a simulated request's route spent ~45 µs of Python around ~27 µs of Rust),
//! and the services' door runs the same `Edge`.
//!
//! The arithmetic is the Python edge's, operation for operation, so the score terms add up to
//! the route's score bit for bit and a simulated run is unchanged float for float.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyTuple};
use rustc_hash::FxHashMap;

use super::arrays::{ns_bytes, readonly_of, slice_of};
use super::errors::core_err;
use super::index::PyLudoView;
use super::queues::{err as queue_err, PyQueueEstimates};
use super::router::{PyRouteResult, PyRouter};
use crate::ludo::maintenance::{LudoTable, TableConfig};
use crate::ludo::view::LudoView;
use crate::score::{ScoreParams, WorkerArrays};

const VRAM: u8 = 1;
const DRAM: u8 = 2;
const ABSENT: u8 = 0;

/// One registration's expiry: the keys of one (table, field) registered together.
struct Expiry {
    at: f64,
    serial: u64,
    table: u32,
    field: u32,
    keys: Vec<u64>,
}

impl PartialEq for Expiry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Expiry {}
impl PartialOrd for Expiry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Expiry {
    /// Reversed (earliest first from a max-heap): by time, then by registration order.
    fn cmp(&self, other: &Self) -> Ordering {
        other.at.total_cmp(&self.at).then(other.serial.cmp(&self.serial))
    }
}

/// The private writer and follower view of one logical table's speculative entries (the view
/// is one of the router's tables).
struct Spec {
    writer: LudoTable,
    view: Arc<RwLock<LudoView>>,
}

struct State {
    spec: Vec<Spec>,
    /// (table, key, field) -> the expiry of its latest registration.
    expiry: FxHashMap<(u32, u64, u32), f64>,
    heap: BinaryHeap<Expiry>,
    serial: u64,
    registered: u64,
    expired: u64,
    lam: f64,
    lam_version: Option<u64>,
}

/// The edge's parameters the core reads (a dict from Python, by these names).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct Params {
    load_aware: bool,
    lambda_max: f64,
    tau_ms: f64,
    gamma: f64,
    closure: bool,
    tie_ms: f64,
    speculative_ttl_s: f64,
    /// Dispatch charges on (load awareness and a charge TTL).
    charge: bool,
    migration: bool,
    /// The speculative entries' tables.
    value_bits: u8,
    spec_capacity: u64,
    spec_fp_bits: u8,
    /// The engines' KV block size (`ScoreParams::block`; 0: matches not capped).
    block_size: u32,
}

impl Params {
    /// The numbers as `kvcompass.discovery.params.EdgeParams` holds them, each refused by its
    /// name: a negative `tau_ms` once passed here and failed every route naming a lambda.
    fn check(&self) -> PyResult<()> {
        for (name, x) in [("lambda_max", self.lambda_max), ("gamma", self.gamma), ("tie_ms", self.tie_ms), ("speculative_ttl_s", self.speculative_ttl_s)] {
            if !(x.is_finite() && x >= 0.0) {
                return Err(PyValueError::new_err(format!("EdgeCore: {name} = {x} must be finite and >= 0")));
            }
        }
        if !(self.tau_ms.is_finite() && self.tau_ms > 0.0) {
            return Err(PyValueError::new_err(format!("EdgeCore: tau_ms = {} must be finite and > 0", self.tau_ms)));
        }
        Ok(())
    }
}

/// `now` (s) as a time the edge may act at: finite. A NaN one registered speculative entries
/// that never expired and closed dispatch charges without settling them.
fn check_now(now: f64) -> PyResult<()> {
    crate::queues::check_now(now).map_err(queue_err)
}

/// Per-worker figures in worker order (a dict from Python, by these names).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct Workers {
    /// The worker's region (0: the edge's own), an index into the plan.
    region: Vec<u32>,
    /// Prefill cost, ms a token.
    beta: Vec<f64>,
    /// The WAN term toward the worker, ms.
    wan: Vec<f64>,
    local: Vec<bool>,
    /// May win a route (false: another region's worker with cross-region reuse off).
    eligible: Vec<bool>,
    /// (table id, field) of the worker's tier field.
    fields: Vec<(u32, u32)>,
}

#[pyclass(name = "EdgeCore", module = "kvcompass._core", frozen)]
pub struct PyEdgeCore {
    router: Mutex<Py<PyRouter>>,
    queues: Py<PyQueueEstimates>,
    w: Workers,
    all_eligible: bool,
    plan: Vec<Vec<u32>>,
    family_length: u32,
    p: Params,
    zeros: Vec<f64>,
    state: Mutex<State>,
}

fn poisoned() -> PyErr {
    PyRuntimeError::new_err("edge core lock poisoned")
}

impl PyEdgeCore {
    fn st(&self) -> PyResult<MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| poisoned())
    }

    fn flush(spec: &mut Spec) -> PyResult<()> {
        if let Some(b) = spec.writer.take_batch() {
            spec.view.write().map_err(|_| poisoned())?.apply_batch(&b).map_err(core_err)?;
        }
        Ok(())
    }

    /// Drop the registrations whose TTL ran out by `now` (only a key's latest one counts).
    fn expire_in(st: &mut State, now: f64) -> PyResult<u64> {
        if st.heap.peek().is_none_or(|e| e.at > now) {
            return Ok(0);
        }
        let mut dirty: Vec<u32> = Vec::new();
        let mut gone = 0u64;
        while st.heap.peek().is_some_and(|e| e.at <= now) {
            let e = st.heap.pop().expect("peeked");
            for &k in &e.keys {
                let entry = (e.table, k, e.field);
                if st.expiry.get(&entry) == Some(&e.at) {
                    st.expiry.remove(&entry);
                    st.spec[e.table as usize].writer.set_field(k, e.field, ABSENT).map_err(core_err)?;
                    if !dirty.contains(&e.table) {
                        dirty.push(e.table);
                    }
                    gone += 1;
                }
            }
        }
        dirty.sort_unstable();
        for t in dirty {
            Self::flush(&mut st.spec[t as usize])?;
        }
        st.expired += gone;
        Ok(gone)
    }

    /// lambda = min(lambda_max, min over servable workers of Tq / tau), recomputed only after
    /// the estimates changed; 0 without load awareness.
    fn price(&self, st: &mut State, q: &crate::queues::QueueState) -> f64 {
        if !self.p.load_aware {
            return 0.0;
        }
        if st.lam_version != Some(q.version) {
            let m = if self.all_eligible {
                q.tq.iter().copied().fold(f64::INFINITY, f64::min)
            } else {
                q.tq.iter().zip(&self.w.eligible).filter(|&(_, &e)| e).map(|(&x, _)| x).fold(f64::INFINITY, f64::min)
            };
            let x = m / self.p.tau_ms;
            // Python's min(lambda_max, x): the first unless the second is smaller.
            st.lam = if x < self.p.lambda_max { x } else { self.p.lambda_max };
            st.lam_version = Some(q.version);
        }
        st.lam
    }

    fn score_in(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>, namespace: &Bound<'_, PyAny>, now: f64, belief: &Bound<'_, PyAny>, own_region: bool) -> PyResult<PyRouteResult> {
        let ns = ns_bytes(namespace)?;
        let tok = readonly_of::<u32>("tokens", "uint32", tokens)?;
        let bel = readonly_of::<f64>("belief", "float64", belief)?;
        // The beliefs are copied once, before the route (which may release the GIL for a long
        // prompt, and the caller's array may change then): the scores and the commit's figures
        // read the same values (found in review: the copy was taken after the route).
        let (tokens, belief) = (slice_of("tokens", &tok)?, slice_of("belief", &bel)?.to_vec());
        if belief.len() != self.w.region.len() {
            return Err(PyValueError::new_err(format!("belief: {} values for {} workers", belief.len(), self.w.region.len())));
        }
        check_now(now)?;
        let (lam, tq) = {
            let mut st = self.st()?;
            Self::expire_in(&mut st, now)?;
            let mut q = self.queues.bind(py).try_borrow_mut()?;
            q.state_mut().expire(now).map_err(queue_err)?;
            let lam = self.price(&mut st, q.state());
            (lam, if self.p.load_aware { q.state().tq.clone() } else { self.zeros.clone() })
        };
        let router = self.router.lock().map_err(|_| poisoned())?.clone_ref(py);
        let w = WorkerArrays { region: &self.w.region, beta: &self.w.beta, wan: &self.w.wan, tq: &tq, belief: &belief };
        let params = self.score_params(lam);
        let mut res = router.get().route_arrays(py, &ns, tokens, &w, &params, own_region.then_some(0), Some(self.p.tie_ms))?;
        // The commit reads the estimates and beliefs the scores used: both copies move in.
        res.belief = belief;
        res.tq = tq;
        Ok(res)
    }

    /// The route's score parameters at capacity price `lam`.
    fn score_params(&self, lam: f64) -> ScoreParams {
        ScoreParams { gamma: self.p.gamma, lambda: lam, closure: self.p.closure, block: self.p.block_size }
    }

    /// The side effects of sending the prompt of `res` to worker `w` (none without `effects`)
    /// and the decision's figures, as the tuple `Edge` unpacks. Everything that can be refused
    /// (the worker, `now`, the keys of the speculative entries and of the family) is resolved
    /// before anything changes: a refused commit leaves the charges and the speculative entries
    /// as they were.
    #[allow(clippy::too_many_arguments)]
    fn commit_in<'py>(&self, py: Python<'py>, res: &PyRouteResult, w: usize, n_cand: usize, now: f64, track: bool, effects: bool) -> PyResult<Bound<'py, PyTuple>> {
        if w >= self.w.region.len() || res.scores.len() != self.w.region.len() || res.belief.len() != self.w.region.len() {
            return Err(PyValueError::new_err(format!("commit: worker {w} of {} workers, or a route made by another edge", self.w.region.len())));
        }
        check_now(now)?;
        let (held, tier, score, b, lam) = (res.matches[w], res.tiers[w], res.scores[w], res.belief[w], res.lam);
        let len = res.prompt_len;
        // Claimed (and scored) as what the engine reuses of it; the index's own length decides
        // the speculative entries below.
        let m = held.min(self.score_params(lam).reusable(len));
        let tier = if m == 0 { ABSENT } else { tier };
        // Same operation order as the core's score, so the terms add up to it bit for bit.
        let remaining = len as f64 - b * f64::from(m);
        let prefill = if remaining > 0.0 { (1.0 + lam) * self.w.beta[w] * remaining } else { 0.0 };
        let reload = if tier == DRAM { self.p.gamma * b * f64::from(m) } else { 0.0 };
        let mut spec: &[u32] = &[];
        if effects && self.p.speculative_ttl_s > 0.0 {
            let plan = &self.plan[self.w.region[w] as usize];
            spec = &plan[..plan.partition_point(|&c| c as usize <= len)];
            if spec.last().is_some_and(|&last| held >= last) && tier == VRAM {
                spec = &[]; // already claimed in full (by the index or a live entry): nothing to add
            }
        }
        // The family names the prompt whenever migration is on and the prompt reaches the
        // family length, so a lookup or a hand-off reports the same family as the route would;
        // only a route counts it (``track``: hotness and local misses).
        let named = self.p.migration && len >= self.family_length as usize;
        let key = |c: u32| res.key_at(c).ok_or_else(|| PyValueError::new_err(format!("commit: the route did not hash length {c}")));
        let keys = spec.iter().map(|&c| key(c)).collect::<PyResult<Vec<u64>>>()?;
        let family = if named { Some(key(self.family_length)?) } else { None };
        // Checked: the effects follow.
        if effects && self.p.charge {
            let work = (if remaining > 0.0 { self.w.beta[w] * remaining } else { 0.0 }) + reload;
            self.queues.bind(py).try_borrow_mut()?.state_mut().charge(w as i64, work, now).map_err(queue_err)?;
        }
        if !keys.is_empty() {
            self.speculate(w, keys, now)?;
        }
        let local_miss = track && named && !(self.w.local[w] && m > 0);
        let queue = if res.tq.is_empty() { 0.0 } else { res.tq[w] };
        (w, n_cand, m, tier, score, (self.w.wan[w], queue, prefill, reload, lam, b), len, res.local_match, family, local_miss).into_pyobject(py)
    }

    fn speculate(&self, w: usize, keys: Vec<u64>, now: f64) -> PyResult<()> {
        let (t, f) = self.w.fields[w];
        let expires = now + self.p.speculative_ttl_s;
        let mut st = self.st()?;
        for &k in &keys {
            let entry = (t, k, f);
            if !st.expiry.contains_key(&entry) {
                st.spec[t as usize].writer.set_field(k, f, VRAM).map_err(core_err)?;
                st.registered += 1;
            }
            st.expiry.insert(entry, expires);
        }
        st.serial += 1;
        let serial = st.serial;
        st.heap.push(Expiry { at: expires, serial, table: t, field: f, keys });
        Self::flush(&mut st.spec[t as usize])
    }
}

#[pymethods]
impl PyEdgeCore {
    /// `workers` and `params`: dicts of [`Workers`]' and [`Params`]' fields; `plan[r]`: the
    /// lengths toward region r; `spec_views[t]`: the view of table t's speculative entries that
    /// `router` reads (filled here from a fresh writer's snapshot).
    #[new]
    fn new(router: Py<PyRouter>, queues: Py<PyQueueEstimates>, workers: Workers, plan: Vec<Vec<u32>>, family_length: u32, spec_views: Vec<PyRef<'_, PyLudoView>>, params: Params) -> PyResult<Self> {
        let w = &workers;
        let n = w.region.len();
        if [w.beta.len(), w.wan.len(), w.local.len(), w.eligible.len(), w.fields.len()].iter().any(|&x| x != n) {
            return Err(PyValueError::new_err(format!("EdgeCore: every per-worker list must have {n} entries")));
        }
        if let Some(r) = w.region.iter().find(|&&r| r as usize >= plan.len()) {
            return Err(PyValueError::new_err(format!("EdgeCore: region {r} has no plan ({} regions)", plan.len())));
        }
        if let Some(&(t, _)) = w.fields.iter().find(|&&(t, _)| t as usize >= spec_views.len()) {
            return Err(PyValueError::new_err(format!("EdgeCore: table {t} has no speculative view ({} tables)", spec_views.len())));
        }
        params.check()?;
        // Every writer is made, every field checked against the value width and every view's
        // snapshot prepared before any view changes: a refused constructor leaves the caller's
        // views as they were (found in review: a bad second view after the first was wiped).
        let mut writers = Vec::with_capacity(spec_views.len());
        for t in 0..spec_views.len() {
            let cfg = TableConfig { table: t as u32, shard: 0, epoch: 1, capacity: params.spec_capacity, value_bits: params.value_bits, fp_bits: params.spec_fp_bits, seed: 0, max_capacity: 1u64 << 32, fallback_limit: 64 };
            writers.push(LudoTable::new(cfg).map_err(core_err)?);
        }
        let fields = u32::from(params.value_bits) / 2;
        if let Some(&(_, field)) = w.fields.iter().find(|&&(_, f)| f >= fields) {
            return Err(core_err(crate::error::CoreError::InvalidField { field, fields }));
        }
        let mut fresh = Vec::with_capacity(spec_views.len());
        for (writer, v) in writers.iter().zip(&spec_views) {
            let snap = writer.export_snapshot().map_err(core_err)?;
            let batch = crate::patch::decode_batch(&snap).map_err(core_err)?;
            fresh.push(v.inner.read().map_err(|_| poisoned())?.with_snapshot(&batch).map_err(core_err)?);
        }
        let mut spec = Vec::with_capacity(spec_views.len());
        for ((writer, v), view) in writers.into_iter().zip(&spec_views).zip(fresh) {
            *v.inner.write().map_err(|_| poisoned())? = view;
            spec.push(Spec { writer, view: v.inner.clone() });
        }
        let all_eligible = w.eligible.iter().all(|&e| e);
        Ok(PyEdgeCore {
            router: Mutex::new(router),
            queues,
            zeros: vec![0.0; n],
            w: workers,
            all_eligible,
            plan,
            family_length,
            p: params,
            state: Mutex::new(State { spec, expiry: FxHashMap::default(), heap: BinaryHeap::new(), serial: 0, registered: 0, expired: 0, lam: 0.0, lam_version: None }),
        })
    }

    /// The router to route with from now on (the edge rebuilt it over other views).
    fn set_router(&self, router: Py<PyRouter>) -> PyResult<()> {
        *self.router.lock().map_err(|_| poisoned())? = router;
        Ok(())
    }

    /// Every worker's score for the prompt as of `now` (expired speculative entries and charges
    /// dropped first); with `own_region` only region 0's workers are scored.
    #[pyo3(signature = (tokens, namespace, now, belief, own_region=false))]
    fn score(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>, namespace: &Bound<'_, PyAny>, now: f64, belief: &Bound<'_, PyAny>, own_region: bool) -> PyResult<PyRouteResult> {
        self.score_in(py, tokens, namespace, now, belief, own_region)
    }

    /// Send the prompt of `res` to worker `w`, one of `n_cand` near-best: the tuple
    /// `(w, n_cand, match, tier, score, (wan, queue, prefill, reload, lam, belief),
    /// prompt_tokens, local_match, family, local_miss)`.
    #[pyo3(signature = (res, w, n_cand, now, track, effects=true))]
    #[allow(clippy::too_many_arguments)]
    fn commit<'py>(&self, py: Python<'py>, res: PyRef<'_, PyRouteResult>, w: usize, n_cand: usize, now: f64, track: bool, effects: bool) -> PyResult<Bound<'py, PyTuple>> {
        self.commit_in(py, &res, w, n_cand, now, track, effects)
    }

    /// [`score`](Self::score), the winner drawn uniformly among the near-best with `draw()` (a
    /// float in [0, 1), called only when there are several), and [`commit`](Self::commit):
    /// `(result, commit tuple)`. For an edge whose every worker may win.
    #[pyo3(signature = (tokens, namespace, now, belief, draw, track=true, effects=true))]
    #[allow(clippy::too_many_arguments)]
    fn route<'py>(&self, py: Python<'py>, tokens: &Bound<'_, PyAny>, namespace: &Bound<'_, PyAny>, now: f64, belief: &Bound<'_, PyAny>, draw: &Bound<'_, PyAny>, track: bool, effects: bool) -> PyResult<(Py<PyRouteResult>, Bound<'py, PyTuple>)> {
        if !self.all_eligible {
            return Err(PyValueError::new_err("EdgeCore.route: some workers may not win here; score, choose and commit instead"));
        }
        let res = self.score_in(py, tokens, namespace, now, belief, false)?;
        let n = res.near.len();
        let w = match n {
            0 => return Err(PyValueError::new_err("EdgeCore.route: no worker scored finite")),
            1 => res.near[0] as usize,
            _ => {
                let u: f64 = draw.call0()?.extract()?;
                if !(0.0..1.0).contains(&u) {
                    // Found in review: a draw of 1.0 indexed past the candidates (a panic).
                    return Err(PyValueError::new_err(format!("EdgeCore.route: draw() must return a number in [0, 1), got {u}")));
                }
                res.near[(u * n as f64) as usize] as usize
            }
        };
        let c = self.commit_in(py, &res, w, n, now, track, effects)?;
        Ok((Py::new(py, res)?, c))
    }

    /// Drop the speculative entries whose TTL ran out by `now` (finite); returns how many.
    fn expire(&self, now: f64) -> PyResult<u64> {
        check_now(now)?;
        Self::expire_in(&mut *self.st()?, now)
    }

    /// The capacity price as the next route will use it.
    fn capacity_price(&self, py: Python<'_>) -> PyResult<f64> {
        let q = self.queues.bind(py).try_borrow()?;
        Ok(self.price(&mut *self.st()?, q.state()))
    }

    /// Live (table, key, field) speculative entries.
    #[getter]
    fn speculative_entries(&self) -> PyResult<usize> {
        Ok(self.st()?.expiry.len())
    }

    /// ``(registered, expired)`` speculative entries since the start.
    #[getter]
    fn speculative_counts(&self) -> PyResult<(u64, u64)> {
        let st = self.st()?;
        Ok((st.registered, st.expired))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEdgeCore>()
}
