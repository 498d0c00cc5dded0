//! numpy in, borrowed slices or owned Rust values out, with errors that name the argument and
//! what was wrong.

use numpy::{Element, PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

fn describe(obj: &Bound<'_, PyAny>) -> String {
    match (obj.getattr("dtype"), obj.getattr("ndim")) {
        (Ok(d), Ok(n)) => format!("a {n}-D array of {d}"),
        _ => format!("{}", obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())),
    }
}

/// Borrow a 1-D contiguous numpy array of exactly dtype `T` for reading in place (no silent
/// casts: a float or int64 array is a caller bug worth surfacing, not something to truncate).
/// Read it with the GIL held: with the GIL released, Python code could write to it meanwhile.
pub fn readonly_of<'py, T: Element + Copy>(name: &str, dtype: &str, obj: &Bound<'py, PyAny>) -> PyResult<PyReadonlyArray1<'py, T>> {
    let arr = obj.cast::<PyArray1<T>>().map_err(|_| PyValueError::new_err(format!("{name}: expected a 1-D numpy array of {dtype}, got {}", describe(obj))))?;
    if !arr.is_contiguous() {
        return Err(PyValueError::new_err(format!("{name}: array must be C-contiguous (use numpy.ascontiguousarray)")));
    }
    arr.try_readonly().map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
}

/// [`readonly_of`]'s array as a slice (it is contiguous, so this cannot fail in practice).
pub fn slice_of<'a, T: Element + Copy>(name: &str, ro: &'a PyReadonlyArray1<'_, T>) -> PyResult<&'a [T]> {
    ro.as_slice().map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
}

/// Copy a 1-D contiguous numpy array of exactly dtype `T` (see [`readonly_of`]), for work done
/// with the GIL released.
pub fn vec_of<T: Element + Copy>(name: &str, dtype: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<T>> {
    let ro = readonly_of::<T>(name, dtype, obj)?;
    Ok(slice_of(name, &ro)?.to_vec())
}

pub fn u32_vec(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    vec_of::<u32>(name, "uint32", obj)
}
pub fn u64_vec(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    vec_of::<u64>(name, "uint64", obj)
}
pub fn u8_vec(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    vec_of::<u8>(name, "uint8", obj)
}
pub fn f64_vec(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<f64>> {
    vec_of::<f64>(name, "float64", obj)
}

/// A 32-byte namespace digest.
pub fn ns_bytes(obj: &Bound<'_, PyAny>) -> PyResult<[u8; 32]> {
    let b = obj.cast::<PyBytes>().map_err(|_| PyValueError::new_err(format!("namespace: expected 32 bytes from namespace_digest(), got {}", describe(obj))))?;
    b.as_bytes().try_into().map_err(|_| PyValueError::new_err(format!("namespace: expected 32 bytes, got {}", b.as_bytes().len())))
}
