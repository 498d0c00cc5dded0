//! Busy time per window, for the run summary's utilisation and peak load factor.
//!
//! `kvcompass/sim/summary.py` documents both figures; this is their arithmetic, in the order the
//! summary's Python loop did it (interval by interval, window by window, Python's floor
//! division for the first and last window), so a summary is the same float for float. It moved
//! here because a 20,000-request run has tens of thousands of busy intervals and the loop was a
//! tenth of a baseline scheme's whole run.

use super::engine::py_floordiv;

/// Busy time of each worker in each window `[edges[k], edges[k + 1])` (not yet divided by the
/// windows' widths), and each worker's total busy time. `intervals[w]` is worker `w`'s
/// `(begin, end)` pairs, flattened; `start` and `window` are those the edges were built from.
pub fn busy_windows(intervals: &[&[f64]], start: f64, window: f64, edges: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let n = edges.len().saturating_sub(1).max(1);
    let mut out = vec![0.0f64; intervals.len() * n];
    let mut totals = vec![0.0f64; intervals.len()];
    for (w, ivs) in intervals.iter().enumerate() {
        let row = &mut out[w * n..(w + 1) * n];
        let mut total = 0.0f64;
        for pair in ivs.chunks_exact(2) {
            let (b, e) = (pair[0], pair[1]);
            // max(0.0, e - b), as Python's max keeps its first argument unless the second is larger
            let d = e - b;
            total += if d > 0.0 { d } else { 0.0 };
            if e <= b {
                continue;
            }
            let k0 = (py_floordiv(b - start, window) as i64).max(0);
            let k1 = (py_floordiv(e - start, window) as i64).min(n as i64 - 1);
            let mut k = k0;
            while k <= k1 {
                let ku = k as usize;
                let hi = if edges[ku + 1] < e { edges[ku + 1] } else { e }; // min(e, edges[k + 1])
                let lo = if edges[ku] > b { edges[ku] } else { b }; // max(b, edges[k])
                let x = hi - lo;
                row[ku] += if x > 0.0 { x } else { 0.0 };
                k += 1;
            }
        }
        totals[w] = total;
    }
    (out, totals)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_split_an_interval_and_totals_add_up() {
        let edges = [0.0, 10.0, 20.0, 25.0];
        let a = [5.0, 15.0, 18.0, 24.0, 30.0, 30.0];
        let b = [-4.0, 1.0];
        let (out, totals) = busy_windows(&[&a, &b], 0.0, 10.0, &edges);
        assert_eq!(out, vec![5.0, 7.0, 4.0, 1.0, 0.0, 0.0]);
        assert_eq!(totals, vec![16.0, 5.0]);
    }
}
