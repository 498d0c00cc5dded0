//! `Router`: the edge's per-request call. It holds shared handles to the edge's views (patches
//! applied to a `LudoView` are seen by the next route) and runs the whole lookup-and-score loop
//! in one Rust call.
//!
//! The GIL stays held through a route of a prompt up to 65,536 tokens: the prompt and the worker
//! arrays are read in place, which only the GIL makes safe (released, Python code could write to
//! them meanwhile), and copying the tokens out first was a third of a route's time. Such a route
//! takes tens of microseconds, on the thread that serves the request. A longer prompt is copied
//! and routed with the GIL released: its hashing alone takes long enough to hold other threads
//! up.

use std::sync::{Arc, Mutex, RwLock};

use numpy::PyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::arrays::{ns_bytes, readonly_of, slice_of, u32_vec};
use super::errors::core_err;
use super::index::PyLudoView;
use crate::ludo::view::LudoView;
use crate::score::{route_with, RouteScratch, RouteTable, ScoreParams, WorkerArrays};

struct TableSpec {
    region: u32,
    workers: Vec<u32>,
    shards: std::ops::Range<usize>,
}

#[pyclass(name = "Router", module = "kvcompass._core", frozen)]
pub struct PyRouter {
    plan: Vec<Vec<u32>>,
    tables: Vec<TableSpec>,
    views: Vec<Arc<RwLock<LudoView>>>,
    scratch: Mutex<RouteScratch>,
}

/// The decision for one request plus the evidence behind it. The per-worker figures are kept
/// as vectors and handed out as numpy arrays only when asked for (a fresh array each time):
/// most routes read one worker's figures ([`PyRouteResult::at`]), and three arrays a route
/// were a visible part of a simulated request.
#[pyclass(name = "RouteResult", module = "kvcompass._core", frozen)]
pub struct PyRouteResult {
    #[pyo3(get)]
    winner: usize,
    #[pyo3(get)]
    score: f64,
    pub(crate) matches: Vec<u32>,
    pub(crate) tiers: Vec<u8>,
    pub(crate) scores: Vec<f64>,
    /// The queue estimates the scores used (empty when the caller kept them: [`PyRouter::route`]).
    pub(crate) tq: Vec<f64>,
    /// The beliefs and capacity price the scores used (kept for an `EdgeCore`'s commit only).
    pub(crate) belief: Vec<f64>,
    pub(crate) lam: f64,
    /// Tokens in the prompt.
    pub(crate) prompt_len: usize,
    lengths: Vec<u32>,
    keys: Vec<u64>,
    /// Workers within `tie_ms` of the best score, in index order (empty without `tie_ms`).
    pub(crate) near: Vec<u32>,
    #[pyo3(get)]
    pub(crate) local_match: u32,
}

impl PyRouteResult {
    /// The key this route hashed for plan length `c`, if it hashed one.
    pub(crate) fn key_at(&self, c: u32) -> Option<u64> {
        self.lengths.binary_search(&c).ok().map(|i| self.keys[i])
    }
}

#[pymethods]
impl PyRouteResult {
    /// Per-worker matched prefix length (0 = none), after the closure check.
    #[getter]
    fn matches<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_slice(py, &self.matches)
    }
    /// Per-worker tier of that match: 0 none, 1 VRAM, 2 DRAM.
    #[getter]
    fn tiers<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u8>> {
        PyArray1::from_slice(py, &self.tiers)
    }
    /// Per-worker joint score (ms); the winner has the smallest.
    #[getter]
    fn scores<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        PyArray1::from_slice(py, &self.scores)
    }
    /// The per-worker queue estimates (ms) the scores used, for a route made by an
    /// ``EdgeCore`` (which reads them itself); empty for ``Router.route``, whose caller passed them.
    #[getter]
    fn tq<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        PyArray1::from_slice(py, &self.tq)
    }
    /// Workers whose score is within the route's ``tie_ms`` of the best (``score <= best +
    /// tie_ms``), in index order: the tie-break's candidates without a numpy pass over the
    /// scores. Empty when the route was given no ``tie_ms``.
    #[getter]
    fn near(&self) -> Vec<u32> {
        self.near.clone()
    }
    /// ``(match, tier, score)`` of worker ``w`` as Python numbers (what the edge's commit reads
    /// of its winner, without three numpy scalar reads); IndexError past the workers.
    fn at(&self, w: usize) -> PyResult<(u32, u8, f64)> {
        match (self.matches.get(w), self.tiers.get(w), self.scores.get(w)) {
            (Some(&m), Some(&t), Some(&s)) => Ok((m, t, s)),
            _ => Err(pyo3::exceptions::PyIndexError::new_err(format!("worker {w} out of range ({} workers)", self.scores.len()))),
        }
    }
    /// The keys of the prompt's prefixes of ``lengths`` that this route hashed (every plan
    /// length that fits the prompt), so the caller registers speculative entries and counts
    /// families without hashing the prompt again; ValueError names a length it did not hash.
    fn keys_at(&self, lengths: Vec<u32>) -> PyResult<Vec<u64>> {
        lengths
            .iter()
            .map(|&c| self.key_at(c).ok_or_else(|| PyValueError::new_err(format!("keys_at: this route did not hash length {c} (it hashed {:?})", self.lengths))))
            .collect()
    }
    fn __repr__(&self) -> String {
        format!("RouteResult(winner={}, score={:.3})", self.winner, self.score)
    }
}

/// Prompts longer than this are routed with the GIL released (see the module docs).
const DETACH_TOKENS: usize = 1 << 16;

type Routed = (crate::score::RouteWinner, Vec<u32>, Vec<u8>, Vec<f64>, Vec<u32>, Vec<u64>);

impl PyRouter {
    /// [`PyRouter::run`] on the warm scratch when it is free (a concurrent caller gets a fresh
    /// one instead of waiting), and the per-worker results copied out of it.
    /// Errors come back as [`CoreError`](crate::error::CoreError), not `PyErr`: this runs with
    /// the GIL released, and building a `kvcompass.errors` exception takes the GIL back (found in
    /// review: taken while the view read locks were held, it deadlocked against a thread that
    /// held the GIL and waited on a view behind a queued writer).
    fn route_scratched(&self, ns: &[u8; 32], tokens: &[u32], w: &WorkerArrays<'_>, params: &ScoreParams, only: Option<u32>) -> crate::error::Result<Routed> {
        let mut fresh;
        let mut guard = self.scratch.try_lock();
        let scratch: &mut RouteScratch = match guard.as_mut() {
            Ok(g) => g,
            Err(_) => {
                fresh = RouteScratch::new();
                &mut fresh
            }
        };
        let win = self.run(ns, tokens, w, params, scratch, only)?;
        Ok((win, scratch.matches().to_vec(), scratch.tiers().to_vec(), scratch.scores().to_vec(), scratch.lengths().to_vec(), scratch.keys().to_vec()))
    }

    /// The route of [`PyRouter::route`] from slices read under the GIL (its `tq` and `belief`
    /// left empty: an `EdgeCore` moves in the ones it owns).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn route_arrays(&self, py: Python<'_>, ns: &[u8; 32], tokens: &[u32], w: &WorkerArrays<'_>, params: &ScoreParams, only_region: Option<u32>, tie_ms: Option<f64>) -> PyResult<PyRouteResult> {
        // A NaN or negative margin left every worker, the winner too, out of the near-set.
        if let Some(tie) = tie_ms {
            if !(tie.is_finite() && tie >= 0.0) {
                return Err(core_err(crate::error::CoreError::InvalidArgument(format!("tie_ms = {tie} must be finite and >= 0"))));
            }
        }
        let (routed, local_match) = if tokens.len() > DETACH_TOKENS {
            // Hashing a prompt this long takes long enough for other threads to want the GIL:
            // copies (a small cost beside the hashing) and the loop without it. Everything after
            // reads the copies: a caller's array may change once the GIL is released (found in
            // review: local_match read the live region array, so it could contradict matches).
            let (tokens, region, beta, wan, tq, belief) = (tokens.to_vec(), w.region.to_vec(), w.beta.to_vec(), w.wan.to_vec(), w.tq.to_vec(), w.belief.to_vec());
            let routed = py.detach(|| self.route_scratched(ns, &tokens, &WorkerArrays { region: &region, beta: &beta, wan: &wan, tq: &tq, belief: &belief }, params, only_region));
            let routed = routed.map_err(core_err)?;
            let local = local_match_of(&routed.1, &region);
            (routed, local)
        } else {
            let routed = self.route_scratched(ns, tokens, w, params, only_region).map_err(core_err)?;
            let local = local_match_of(&routed.1, w.region);
            (routed, local)
        };
        let (win, m, t, s, lengths, keys) = routed;
        let near = match tie_ms {
            // The same comparison as numpy's `scores <= best + tie_ms` (IEEE, no fused ops).
            Some(tie) => {
                let bar = win.score + tie;
                s.iter().enumerate().filter(|&(_, &x)| x <= bar).map(|(i, _)| i as u32).collect()
            }
            None => Vec::new(),
        };
        Ok(PyRouteResult { winner: win.winner, score: win.score, matches: m, tiers: t, scores: s, tq: Vec::new(), belief: Vec::new(), lam: params.lambda, prompt_len: tokens.len(), lengths, keys, near, local_match })
    }

    /// The route over every view, read-locked for the call. Returns the core's error, never a
    /// `PyErr` (see [`PyRouter::route_scratched`]: callers run it without the GIL).
    pub(crate) fn run(&self, ns: &[u8; 32], tokens: &[u32], wa: &WorkerArrays<'_>, params: &ScoreParams, scratch: &mut RouteScratch, only: Option<u32>) -> crate::error::Result<crate::score::RouteWinner> {
        let mut guards = Vec::with_capacity(self.views.len());
        for v in &self.views {
            guards.push(v.read().map_err(|_| crate::error::CoreError::InvalidArgument("view lock poisoned".into()))?);
        }
        let refs: Vec<&LudoView> = guards.iter().map(|g| &**g).collect();
        let tables: Vec<RouteTable<'_, &LudoView>> = self.tables.iter().map(|t| RouteTable { region: t.region, workers: &t.workers, shards: &refs[t.shards.clone()] }).collect();
        route_with(scratch, ns, tokens, &self.plan, &tables, wa, params, only)
    }
}

/// The longest match among region 0's workers (an edge passes its own region as 0).
fn local_match_of(matches: &[u32], region: &[u32]) -> u32 {
    matches.iter().zip(region).filter(|&(_, &r)| r == 0).map(|(&x, _)| x).max().unwrap_or(0)
}

#[pymethods]
impl PyRouter {
    /// plan[r]: ascending prefix lengths this edge queries toward region r.
    /// tables: (region, workers: uint32 array of global worker indices per field, [LudoView per shard]).
    #[new]
    fn new(plan: Vec<Vec<u32>>, tables: Vec<(u32, Bound<'_, PyAny>, Vec<PyRef<'_, PyLudoView>>)>) -> PyResult<Self> {
        for (r, lengths) in plan.iter().enumerate() {
            if lengths.first() == Some(&0) || lengths.windows(2).any(|w| w[0] >= w[1]) {
                return Err(PyValueError::new_err(format!("plan[{r}] must be strictly ascending lengths >= 1, got {lengths:?}")));
            }
        }
        let mut specs = Vec::with_capacity(tables.len());
        let mut views = Vec::new();
        for (i, (region, workers, shards)) in tables.into_iter().enumerate() {
            if region as usize >= plan.len() {
                return Err(PyValueError::new_err(format!("tables[{i}]: region {region} has no plan (plan covers {} regions)", plan.len())));
            }
            if shards.is_empty() {
                return Err(PyValueError::new_err(format!("tables[{i}]: needs at least one shard view")));
            }
            let workers = u32_vec(&format!("tables[{i}].workers"), &workers)?;
            let start = views.len();
            for s in shards {
                views.push(s.inner.clone());
            }
            specs.push(TableSpec { region, workers, shards: start..views.len() });
        }
        Ok(PyRouter { plan, tables: specs, views, scratch: Mutex::new(RouteScratch::new()) })
    }

    /// Route one prompt: hash every plan length once, read every table, apply the closure
    /// check, score every worker (the GIL held for prompts up to 65,536 tokens: see the module
    /// docs). With `only_region` only that region's plan and tables are read and every other
    /// worker scores infinity (its own workers' figures are the full route's).
    /// With `tie_ms` (finite, >= 0: InvalidArgumentError otherwise) the result also lists the
    /// workers within `tie_ms` of the best ([`PyRouteResult::near`]). `local_match` is the longest match among region 0's workers
    /// (an edge passes its own region as 0).
    #[pyo3(signature = (tokens, namespace, region, beta, wan, tq, belief, gamma=0.005, lam=0.0, closure=true, only_region=None, tie_ms=None))]
    #[allow(clippy::too_many_arguments)]
    fn route(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>, namespace: &Bound<'_, PyAny>, region: &Bound<'_, PyAny>, beta: &Bound<'_, PyAny>, wan: &Bound<'_, PyAny>, tq: &Bound<'_, PyAny>, belief: &Bound<'_, PyAny>, gamma: f64, lam: f64, closure: bool, only_region: Option<u32>, tie_ms: Option<f64>) -> PyResult<PyRouteResult> {
        let ns = ns_bytes(namespace)?;
        let (tok, reg) = (readonly_of::<u32>("tokens", "uint32", tokens)?, readonly_of::<u32>("region", "uint32", region)?);
        let (b, wn) = (readonly_of::<f64>("beta", "float64", beta)?, readonly_of::<f64>("wan", "float64", wan)?);
        let (q, bel) = (readonly_of::<f64>("tq", "float64", tq)?, readonly_of::<f64>("belief", "float64", belief)?);
        let tokens = slice_of("tokens", &tok)?;
        let w = WorkerArrays { region: slice_of("region", &reg)?, beta: slice_of("beta", &b)?, wan: slice_of("wan", &wn)?, tq: slice_of("tq", &q)?, belief: slice_of("belief", &bel)? };
        let params = ScoreParams { gamma, lambda: lam, closure, block: 0 };
        self.route_arrays(py, &ns, tokens, &w, &params, only_region, tie_ms)
    }

    /// Number of tables this router reads.
    #[getter]
    fn n_tables(&self) -> usize {
        self.tables.len()
    }
    #[getter]
    fn plan(&self) -> Vec<Vec<u32>> {
        self.plan.clone()
    }
    fn __repr__(&self) -> String {
        format!("Router(regions={}, tables={}, views={})", self.plan.len(), self.tables.len(), self.views.len())
    }
}

/// ``(hits, misses)`` of the process's prefix memo (``rust/prefix_memo.rs``): plan lengths a
/// route found hashed before, and lengths it hashed. For the operators' metrics and the tests.
#[pyfunction]
fn prefix_memo_stats() -> (u64, u64) {
    let s = crate::prefix_memo::stats();
    (s.hits, s.misses)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(prefix_memo_stats, m)?)?;
    m.add_class::<PyRouter>()?;
    m.add_class::<PyRouteResult>()?;
    Ok(())
}
