//! `ByteLevelBpe`: the fast path of `kvcompass.engine.tokenizer.Tokenizer` (`crate::bpe` says
//! why, for which text and what it must match).

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

    /// Token ids of `text` as a uint32 array, or None when `text` holds a character the fast
    /// path does not classify (the caller's HF tokenizer encodes it). The GIL is released while
    /// encoding a long text.
    fn encode<'py>(&self, py: Python<'py>, text: &str) -> Option<Bound<'py, PyArray1<u32>>> {
        let ids = if text.len() < 4096 { self.inner.encode(text) } else { py.detach(|| self.inner.encode(text)) };
        ids.map(|v| v.into_pyarray(py))
    }

    /// The pre-tokenizer's pieces of `text` as (start, end) character offsets, or None when
    /// it holds a character the fast path does not classify (for tests against HF's
    /// ``pre_tokenize_str``, which gives character offsets too).
    #[staticmethod]
    fn pieces(text: &str) -> Option<Vec<(usize, usize)>> {
        let bytes = crate::bpe::pieces(text)?;
        // Byte offsets to character offsets.
        let mut chars = vec![0usize; text.len() + 1];
        let mut n = 0;
        for (at, _) in text.char_indices() {
            chars[at] = n;
            n += 1;
        }
        chars[text.len()] = n;
        Some(bytes.into_iter().map(|(a, b)| (chars[a], chars[b])).collect())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyByteLevelBpe>()
}
