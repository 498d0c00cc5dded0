//! The one place core errors become Python exceptions (classes defined in kvcompass/errors.py,
//! so they have a public import path and carry the structured fields as attributes).

use pyo3::exceptions::{PyMemoryError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::CoreError;

fn build(py: Python<'_>, class: &str, msg: String, attrs: &[(&str, u64)]) -> PyResult<PyErr> {
    let module = py.import("kvcompass.errors")?;
    let cls = module.getattr(class)?;
    let kw = PyDict::new(py);
    for (k, v) in attrs {
        kw.set_item(*k, *v)?;
    }
    let exc = cls.call((msg,), Some(&kw))?;
    Ok(PyErr::from_value(exc))
}

pub fn core_err(e: CoreError) -> PyErr {
    Python::attach(|py| {
        let msg = e.to_string();
        let made = match &e {
            CoreError::SequenceGap { epoch, expected, got } => build(py, "SequenceGapError", msg, &[("epoch", *epoch), ("expected", *expected), ("got", *got)]),
            CoreError::StalePatch { epoch, seq, got_epoch, got_seq } => build(py, "StalePatchError", msg, &[("epoch", *epoch), ("seq", *seq), ("got_epoch", *got_epoch), ("got_seq", *got_seq)]),
            CoreError::EpochChanged { epoch, got_epoch } => build(py, "EpochChangedError", msg, &[("epoch", *epoch), ("got_epoch", *got_epoch)]),
            CoreError::WrongTable { table, shard, got_table, got_shard } => build(py, "WrongTableError", msg, &[("table", *table as u64), ("shard", *shard as u64), ("got_table", *got_table as u64), ("got_shard", *got_shard as u64)]),
            CoreError::MalformedPatch(_) => build(py, "MalformedPatchError", msg, &[]),
            CoreError::Uninitialised => build(py, "UninitialisedViewError", msg, &[]),
            CoreError::Capacity { needed, max } => build(py, "CapacityError", msg, &[("needed", *needed), ("max", *max)]),
            CoreError::InvalidKey(k) => build(py, "InvalidKeyError", msg, &[("key", *k)]),
            CoreError::ValueTooWide { value, bits } => build(py, "InvalidValueError", msg, &[("value", *value), ("bits", *bits as u64)]),
            CoreError::InvalidTier(t) => build(py, "InvalidTierError", msg, &[("tier", *t as u64)]),
            CoreError::InvalidField { field, fields } => build(py, "InvalidFieldError", msg, &[("field", *field as u64), ("fields", *fields as u64)]),
            CoreError::KeyNotFound(k) => build(py, "KeyNotFoundError", msg, &[("key", *k)]),
            CoreError::InvalidArgument(_) => build(py, "InvalidArgumentError", msg, &[]),
            // The allocator refused: Python's own MemoryError, as a failed allocation there is.
            CoreError::OutOfMemory { .. } => Ok(PyMemoryError::new_err(msg)),
        };
        made.unwrap_or_else(|err| PyRuntimeError::new_err(format!("{e} (and kvcompass.errors could not be loaded: {err})")))
    })
}
