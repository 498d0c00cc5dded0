//! `Router`: the edge's per-request call. It holds shared handles to the edge's views (patches
//! applied to a `LudoView` are seen by the next route) and runs the whole lookup-and-score loop
//! in one Rust call with the GIL released.

use std::sync::{Arc, Mutex, RwLock};

use numpy::{IntoPyArray, PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use super::arrays::{f64_vec, ns_bytes, u32_vec};
use super::errors::core_err;
use super::index::PyLudoView;
use crate::ludo::view::LudoView;
use crate::score::{route_with, RouteScratch, RouteTable, ScoreParams, WorkerArrays};

struct TableSpec {
    region: u32,
    workers: Vec<u32>,
    shards: std::ops::Range<usize>,
}

/// Owned copies of one request's worker arrays, so the loop can run without the GIL.
pub(crate) struct Workers {
    pub region: Vec<u32>,
    pub beta: Vec<f64>,
    pub wan: Vec<f64>,
    pub tq: Vec<f64>,
    pub belief: Vec<f64>,
}

#[pyclass(name = "Router", module = "kvcompass._core", frozen)]
pub struct PyRouter {
    plan: Vec<Vec<u32>>,
    tables: Vec<TableSpec>,
    views: Vec<Arc<RwLock<LudoView>>>,
    scratch: Mutex<RouteScratch>,
}

/// The decision for one request plus the evidence behind it.
#[pyclass(name = "RouteResult", module = "kvcompass._core", frozen)]
pub struct PyRouteResult {
    #[pyo3(get)]
    winner: usize,
    #[pyo3(get)]
    score: f64,
    matches: Py<PyArray1<u32>>,
    tiers: Py<PyArray1<u8>>,
    scores: Py<PyArray1<f64>>,
    lengths: Vec<u32>,
    keys: Vec<u64>,
    /// Workers within `tie_ms` of the best score, in index order (empty without `tie_ms`).
    near: Vec<u32>,
    #[pyo3(get)]
    local_match: u32,
}

#[pymethods]
impl PyRouteResult {
    /// Per-worker matched prefix length (0 = none), after the closure check.
    #[getter]
    fn matches(&self, py: Python<'_>) -> Py<PyArray1<u32>> {
        self.matches.clone_ref(py)
    }
    /// Per-worker tier of that match: 0 none, 1 VRAM, 2 DRAM.
    #[getter]
    fn tiers(&self, py: Python<'_>) -> Py<PyArray1<u8>> {
        self.tiers.clone_ref(py)
    }
    /// Per-worker joint score (ms); the winner has the smallest.
    #[getter]
    fn scores(&self, py: Python<'_>) -> Py<PyArray1<f64>> {
        self.scores.clone_ref(py)
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
    fn at(&self, py: Python<'_>, w: usize) -> PyResult<(u32, u8, f64)> {
        let (m, t, s) = (self.matches.bind(py), self.tiers.bind(py), self.scores.bind(py));
        match (m.get_owned([w]), t.get_owned([w]), s.get_owned([w])) {
            (Some(m), Some(t), Some(s)) => Ok((m, t, s)),
            _ => Err(pyo3::exceptions::PyIndexError::new_err(format!("worker {w} out of range ({} workers)", s.len()))),
        }
    }
    /// The keys of the prompt's prefixes of ``lengths`` that this route hashed (every plan
    /// length that fits the prompt), so the caller registers speculative entries and counts
    /// families without hashing the prompt again; ValueError names a length it did not hash.
    fn keys_at(&self, lengths: Vec<u32>) -> PyResult<Vec<u64>> {
        lengths
            .iter()
            .map(|c| match self.lengths.binary_search(c) {
                Ok(i) => Ok(self.keys[i]),
                Err(_) => Err(PyValueError::new_err(format!("keys_at: this route did not hash length {c} (it hashed {:?})", self.lengths))),
            })
            .collect()
    }
    fn __repr__(&self) -> String {
        format!("RouteResult(winner={}, score={:.3})", self.winner, self.score)
    }
}

impl PyRouter {
    pub(crate) fn run(&self, ns: &[u8; 32], tokens: &[u32], w: &Workers, params: &ScoreParams, scratch: &mut RouteScratch, only: Option<u32>) -> PyResult<crate::score::RouteWinner> {
        let mut guards = Vec::with_capacity(self.views.len());
        for v in &self.views {
            guards.push(v.read().map_err(|_| PyRuntimeError::new_err("view lock poisoned"))?);
        }
        let refs: Vec<&LudoView> = guards.iter().map(|g| &**g).collect();
        let tables: Vec<RouteTable<'_, &LudoView>> = self.tables.iter().map(|t| RouteTable { region: t.region, workers: &t.workers, shards: &refs[t.shards.clone()] }).collect();
        let wa = WorkerArrays { region: &w.region, beta: &w.beta, wan: &w.wan, tq: &w.tq, belief: &w.belief };
        route_with(scratch, ns, tokens, &self.plan, &tables, &wa, params, only).map_err(core_err)
    }
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
    /// check, score every worker. GIL released for the whole loop. With `only_region` only
    /// that region's plan and tables are read and every other worker scores infinity (its own
    /// workers' figures are the full route's).
    /// With `tie_ms` the result also lists the workers within `tie_ms` of the best
    /// ([`PyRouteResult::near`]). `local_match` is the longest match among region 0's workers
    /// (an edge passes its own region as 0).
    #[pyo3(signature = (tokens, namespace, region, beta, wan, tq, belief, gamma=0.005, lam=0.0, closure=true, only_region=None, tie_ms=None))]
    #[allow(clippy::too_many_arguments)]
    fn route(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>, namespace: &Bound<'_, PyAny>, region: &Bound<'_, PyAny>, beta: &Bound<'_, PyAny>, wan: &Bound<'_, PyAny>, tq: &Bound<'_, PyAny>, belief: &Bound<'_, PyAny>, gamma: f64, lam: f64, closure: bool, only_region: Option<u32>, tie_ms: Option<f64>) -> PyResult<PyRouteResult> {
        let ns = ns_bytes(namespace)?;
        let tokens = u32_vec("tokens", tokens)?;
        let w = Workers { region: u32_vec("region", region)?, beta: f64_vec("beta", beta)?, wan: f64_vec("wan", wan)?, tq: f64_vec("tq", tq)?, belief: f64_vec("belief", belief)? };
        let params = ScoreParams { gamma, lambda: lam, closure };
        let (win, m, t, s, lengths, keys) = py.detach(|| {
            // Reuse the warm scratch when free; a concurrent caller gets a fresh one instead of
            // waiting.
            let mut fresh;
            let mut guard = self.scratch.try_lock();
            let scratch: &mut RouteScratch = match guard.as_mut() {
                Ok(g) => g,
                Err(_) => {
                    fresh = RouteScratch::new();
                    &mut fresh
                }
            };
            let win = self.run(&ns, &tokens, &w, &params, scratch, only_region)?;
            Ok::<_, PyErr>((win, scratch.matches().to_vec(), scratch.tiers().to_vec(), scratch.scores().to_vec(), scratch.lengths().to_vec(), scratch.keys().to_vec()))
        })?;
        let near = match tie_ms {
            // The same comparison as numpy's `scores <= best + tie_ms` (IEEE, no fused ops).
            Some(tie) => {
                let bar = win.score + tie;
                s.iter().enumerate().filter(|&(_, &x)| x <= bar).map(|(i, _)| i as u32).collect()
            }
            None => Vec::new(),
        };
        let local_match = m.iter().zip(&w.region).filter(|&(_, &r)| r == 0).map(|(&x, _)| x).max().unwrap_or(0);
        Ok(PyRouteResult {
            winner: win.winner,
            score: win.score,
            matches: m.into_pyarray(py).unbind(),
            tiers: t.into_pyarray(py).unbind(),
            scores: s.into_pyarray(py).unbind(),
            lengths,
            keys,
            near,
            local_match,
        })
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRouter>()?;
    m.add_class::<PyRouteResult>()?;
    Ok(())
}
