//! `QueueEstimates`: an edge's per-worker queue estimates and open dispatch charges
//! (`crate::queues::QueueState`), with the Python API `kvcompass.discovery.queues` documents.
//! One call per route, reading or vector: the Python class this replaced spent more time in its
//! own bookkeeping than the fold it called into.

use numpy::{PyArray1, PyReadonlyArray1};

use super::arrays::{readonly_of, slice_of};

/// The array arguments of the vector calls, read in place with the GIL held; errors name the
/// argument and the dtype wanted (found in review: numpy's own conversion said only "type
/// mismatch").
fn i64s<'py>(name: &str, obj: &Bound<'py, PyAny>) -> PyResult<PyReadonlyArray1<'py, i64>> {
    readonly_of::<i64>(name, "int64", obj)
}
fn f64s<'py>(name: &str, obj: &Bound<'py, PyAny>) -> PyResult<PyReadonlyArray1<'py, f64>> {
    readonly_of::<f64>(name, "float64", obj)
}
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::queues::{check_now, first_bad_sample, Before, QueueError, QueueState, MAX_QUEUE_MS, MAX_WORKERS};

pub(crate) fn err(e: QueueError) -> PyErr {
    match e {
        QueueError::Sample(_, x) => PyValueError::new_err(format!("queue estimate {x} ms must be finite and in [0, {MAX_QUEUE_MS}]")),
        QueueError::Index(i) => PyValueError::new_err(format!("worker index {i}: out of range or repeated")),
        QueueError::Time(what, x) => PyValueError::new_err(format!("{what} = {x} s: must be a finite time")),
    }
}

/// Settle times (`settled_before`, or lags behind `now`) with no NaN among them: a NaN one
/// compared as "nothing settled" by accident.
fn check_settle(what: &'static str, xs: &[f64]) -> PyResult<()> {
    match xs.iter().find(|x| x.is_nan()) {
        Some(&x) => Err(err(QueueError::Time(what, x))),
        None => Ok(()),
    }
}

fn sample(x: f64) -> PyResult<f64> {
    if first_bad_sample(&[x]).is_some() {
        return Err(err(QueueError::Sample(0, x)));
    }
    Ok(x)
}

/// Per-worker queue estimates (ms) with their ages, idle clocks and open dispatch charges.
#[pyclass(name = "QueueEstimates", module = "kvcompass._core")]
pub struct PyQueueEstimates {
    q: QueueState,
}

impl PyQueueEstimates {
    /// The estimates themselves, for an `EdgeCore` that routes on them.
    pub(crate) fn state(&self) -> &QueueState {
        &self.q
    }
    pub(crate) fn state_mut(&mut self) -> &mut QueueState {
        &mut self.q
    }

    fn at(&self, index: i64) -> PyResult<usize> {
        if index < 0 || index as usize >= self.q.len() {
            return Err(PyIndexError::new_err(format!("worker index {index} out of 0..{}", self.q.len())));
        }
        Ok(index as usize)
    }

    pub(crate) fn fold_vec(&mut self, indices: &[i64], samples: &[f64], now: f64, weight: f64, before: Before<'_>, n_before: Option<usize>) -> PyResult<()> {
        if indices.len() != samples.len() || n_before.is_some_and(|n| n != indices.len()) {
            return Err(PyValueError::new_err(format!("{} indices, {} samples and the charge times differ in length", indices.len(), samples.len())));
        }
        check_now(now).map_err(err)?;
        match before {
            Before::At(b) => check_settle("settled_before", b)?,
            Before::Lag(l) => check_settle("lag_s", l)?,
            Before::Now => {}
        }
        let ix = self.q.check(indices, samples).map_err(err)?;
        self.q.fold_checked(&ix, samples, now, weight, before);
        Ok(())
    }

    /// `fold_lagged` of one vector with this estimator's own weight.
    pub(crate) fn fold_lagged_slice(&mut self, indices: &[i64], samples: &[f64], now: f64, lag_s: &[f64]) -> PyResult<()> {
        let w = self.q.weight;
        self.fold_vec(indices, samples, now, w, Before::Lag(lag_s), Some(lag_s.len()))
    }

    fn one(&mut self, index: i64, tq_ms: f64, now: f64, settled_before: Option<f64>, weight: f64) -> PyResult<f64> {
        let u = self.at(index)?;
        let x = sample(tq_ms)?;
        check_now(now).map_err(err)?;
        let b = [settled_before.unwrap_or(now)];
        check_settle("settled_before", &b)?;
        self.q.fold_checked(&[u], &[x], now, weight, Before::At(&b));
        Ok(self.q.obs[u])
    }
}

#[pymethods]
impl PyQueueEstimates {
    /// At most `MAX_WORKERS` (2^24) workers: more is refused before anything is allocated.
    #[new]
    #[pyo3(signature = (n_workers, weight, idle_threshold_ms, charge_ttl_s = 2.0))]
    fn new(n_workers: usize, weight: f64, idle_threshold_ms: f64, charge_ttl_s: f64) -> PyResult<Self> {
        if n_workers > MAX_WORKERS {
            return Err(PyValueError::new_err(format!("{n_workers} workers: queue estimates cover at most {MAX_WORKERS}")));
        }
        if idle_threshold_ms.is_nan() {
            return Err(PyValueError::new_err("idle threshold NaN ms: must be a number"));
        }
        if !(weight > 0.0 && weight <= 1.0) {
            return Err(PyValueError::new_err(format!("queue weight {weight} must be in (0, 1]")));
        }
        if !(charge_ttl_s.is_finite() && charge_ttl_s >= 0.0) {
            return Err(PyValueError::new_err(format!("charge TTL {charge_ttl_s} s must be finite and >= 0")));
        }
        Ok(PyQueueEstimates { q: QueueState::new(n_workers, weight, idle_threshold_ms, charge_ttl_s) })
    }

    /// Samples plus open charges, per worker (a copy: the route reads it once).
    #[getter]
    fn values<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        PyArray1::from_slice(py, &self.q.tq)
    }

    /// The smallest estimate (samples plus open charges) over every worker: what the capacity
    /// price reads per change of the estimates, without copying them into an array first.
    fn minimum(&self) -> f64 {
        self.q.tq.iter().copied().fold(f64::INFINITY, f64::min)
    }

    /// Bumped on every change, so readers can cache what they derive from the estimates.
    #[getter]
    fn version(&self) -> u64 {
        self.q.version
    }

    fn __len__(&self) -> usize {
        self.q.len()
    }

    fn __getitem__(&self, index: i64) -> PyResult<f64> {
        Ok(self.q.tq[self.at(index)?])
    }

    /// The estimate from samples alone, without open charges.
    fn observed(&self, index: i64) -> PyResult<f64> {
        Ok(self.q.obs[self.at(index)?])
    }

    /// Open charges (ms) of work dispatched to this worker that no sample reflects yet.
    fn pending(&self, index: i64) -> PyResult<f64> {
        Ok(self.q.pend[self.at(index)?])
    }

    /// Whether any sample for this worker has arrived.
    fn known(&self, index: i64) -> PyResult<bool> {
        Ok(self.q.at[self.at(index)?] > f64::NEG_INFINITY)
    }

    /// Seconds since this worker's last sample (inf if none ever arrived).
    fn age(&self, index: i64, now: f64) -> PyResult<f64> {
        Ok(now - self.q.at[self.at(index)?])
    }

    /// This edge just sent `work_ms` of prefill to the worker (ValueError, and nothing
    /// changes, for a `work_ms` out of range or a `now` that is not finite).
    fn charge(&mut self, index: i64, work_ms: f64, now: f64) -> PyResult<()> {
        self.at(index)?;
        self.q.charge(index, work_ms, now).map_err(err)
    }

    /// Close every charge older than the TTL (ValueError, and nothing changes, for a `now`
    /// that is not finite).
    fn expire(&mut self, now: f64) -> PyResult<()> {
        self.q.expire(now).map_err(err)
    }

    /// A live reading (own region): replaces the estimate; charges made at or before
    /// `settled_before` (default: all) are in the reading and close.
    #[pyo3(signature = (index, tq_ms, now, settled_before = None))]
    fn set_live(&mut self, index: i64, tq_ms: f64, now: f64, settled_before: Option<f64>) -> PyResult<()> {
        self.one(index, tq_ms, now, settled_before, 1.0).map(|_| ())
    }

    /// A remote sample: EWMA with weight `w`; returns the estimate from samples.
    #[pyo3(signature = (index, tq_ms, now, settled_before = None))]
    fn fold(&mut self, index: i64, tq_ms: f64, now: f64, settled_before: Option<f64>) -> PyResult<f64> {
        let w = self.q.weight;
        self.one(index, tq_ms, now, settled_before, w)
    }

    /// `set_live` for every `(indices[j], tq_ms[j])` at once (distinct indices).
    fn set_live_many(&mut self, indices: &Bound<'_, PyAny>, tq_ms: &Bound<'_, PyAny>, now: f64, settled_before: &Bound<'_, PyAny>) -> PyResult<()> {
        let (i, q, b) = (i64s("indices", indices)?, f64s("tq_ms", tq_ms)?, f64s("settled_before", settled_before)?);
        let b = slice_of("settled_before", &b)?;
        self.fold_vec(slice_of("indices", &i)?, slice_of("tq_ms", &q)?, now, 1.0, Before::At(b), Some(b.len()))
    }

    /// `fold` of a whole vector (distinct indices; a bad sample changes nothing).
    fn fold_many(&mut self, indices: &Bound<'_, PyAny>, tq_ms: &Bound<'_, PyAny>, now: f64, settled_before: &Bound<'_, PyAny>) -> PyResult<()> {
        let (i, q, b) = (i64s("indices", indices)?, f64s("tq_ms", tq_ms)?, f64s("settled_before", settled_before)?);
        let b = slice_of("settled_before", &b)?;
        let w = self.q.weight;
        self.fold_vec(slice_of("indices", &i)?, slice_of("tq_ms", &q)?, now, w, Before::At(b), Some(b.len()))
    }

    /// `fold_many` with `settled_before = now - lag_s`.
    fn fold_lagged(&mut self, indices: &Bound<'_, PyAny>, tq_ms: &Bound<'_, PyAny>, now: f64, lag_s: &Bound<'_, PyAny>) -> PyResult<()> {
        let (i, q, l) = (i64s("indices", indices)?, f64s("tq_ms", tq_ms)?, f64s("lag_s", lag_s)?);
        let l = slice_of("lag_s", &l)?;
        let w = self.q.weight;
        self.fold_vec(slice_of("indices", &i)?, slice_of("tq_ms", &q)?, now, w, Before::Lag(l), Some(l.len()))
    }

    /// How long the estimate has been at zero (0 when it is not).
    fn idle_for(&self, index: i64, now: f64) -> PyResult<f64> {
        let since = self.q.idle_since[self.at(index)?];
        Ok(if since.is_nan() { 0.0 } else { (now - since).max(0.0) })
    }

    /// At zero for at least `window_s` (a worker never reported is unknown, not idle).
    fn persistently_idle(&self, index: i64, now: f64, window_s: f64) -> PyResult<bool> {
        let since = self.q.idle_since[self.at(index)?];
        Ok(!since.is_nan() && now - since >= window_s)
    }

    /// The workers of `indices` that are persistently idle, in that order.
    fn idle_among(&self, indices: &Bound<'_, PyAny>, now: f64, window_s: f64) -> PyResult<Vec<i64>> {
        let ix = i64s("indices", indices)?;
        let mut out = Vec::new();
        for &i in slice_of("indices", &ix)? {
            let since = self.q.idle_since[self.at(i)?];
            if !since.is_nan() && now - since >= window_s {
                out.push(i);
            }
        }
        Ok(out)
    }

    /// `{ids[j]: estimate of indices[j]}`: a region's queue vector to send (ValueError when
    /// the two differ in length).
    fn vector<'py>(&self, py: Python<'py>, indices: Vec<i64>, ids: Vec<String>) -> PyResult<Bound<'py, PyDict>> {
        if indices.len() != ids.len() {
            return Err(PyValueError::new_err(format!("vector: {} indices but {} ids", indices.len(), ids.len())));
        }
        let d = PyDict::new(py);
        for (i, w) in indices.into_iter().zip(ids) {
            d.set_item(w, self.q.tq[self.at(i)?])?;
        }
        Ok(d)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyQueueEstimates>()
}
