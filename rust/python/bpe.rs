//! `ByteLevelBpe`: the fast path of `kvcompass.engine.tokenizer.Tokenizer` for ASCII text
//! (`crate::bpe` says why and what it must match).

use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::bpe::ByteLevelBpe;

#[pyclass(name = "ByteLevelBpe", module = "kvcompass._core", frozen)]
pub struct PyByteLevelBpe {
    inner: ByteLevelBpe,
}

#[pymethods]
impl PyByteLevelBpe {
    /// `byte_ids[b]`: the id of byte `b`'s token (256 of them); `merges`: `(left, right,
    /// merged)` ids in rank order.
    #[new]
    fn new(byte_ids: Vec<u32>, merges: Vec<(u32, u32, u32)>) -> PyResult<Self> {
        let byte_id: [u32; 256] = byte_ids.try_into().map_err(|v: Vec<u32>| PyValueError::new_err(format!("byte_ids must hold 256 ids, got {}", v.len())))?;
        Ok(PyByteLevelBpe { inner: ByteLevelBpe::new(byte_id, &merges) })
    }

    /// Token ids of `text` as a uint32 array, or None when `text` is not ASCII (the caller's
    /// HF tokenizer encodes it). The GIL is released while encoding.
    fn encode<'py>(&self, py: Python<'py>, text: &str) -> Option<Bound<'py, PyArray1<u32>>> {
        let ids = if text.len() < 4096 { self.inner.encode(text.as_bytes()) } else { py.detach(|| self.inner.encode(text.as_bytes())) };
        ids.map(|v| v.into_pyarray(py))
    }

    /// The pre-tokenizer's pieces of ASCII `text` as (start, end) character offsets, or None
    /// when `text` is not ASCII (for tests against HF's ``pre_tokenize_str``).
    #[staticmethod]
    fn pieces(text: &str) -> Option<Vec<(usize, usize)>> {
        text.is_ascii().then(|| crate::bpe::pieces(text.as_bytes()))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyByteLevelBpe>()
}
