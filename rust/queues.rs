//! The edge's fold of a remote queue vector into its per-worker estimates
//! (`kvcompass.discovery.queues.QueueEstimates.fold_many` documents the rule): every sample is
//! an EWMA step on the worker's estimate from samples, which then moves its live total (samples
//! plus open charges), its last-heard time and its idle clock.
//!
//! An edge folds one vector per region every broadcast period plus one per piggybacked response,
//! so at simulated scale it folds thousands a second; as a dozen numpy calls on arrays of a few
//! workers each, that was a fifth of a KVCompass run.

/// The arrays of one edge's estimates, all indexed by worker.
pub struct Estimates<'a> {
    pub obs: &'a mut [f64],
    pub tq: &'a mut [f64],
    pub pend: &'a [f64],
    pub at: &'a mut [f64],
    pub idle_since: &'a mut [f64],
}

/// The first sample that is not finite and >= 0, if any.
pub fn first_bad_sample(samples: &[f64]) -> Option<usize> {
    samples.iter().position(|x| !(x.is_finite() && *x >= 0.0 && *x <= MAX_QUEUE_MS))
}

/// The largest queue estimate (ms) any report may carry: a day. No worker's queue is a day
/// deep; a larger value is a broken or hostile reporter, not a load to steer around.
pub const MAX_QUEUE_MS: f64 = 86_400_000.0;

/// Fold `samples[j]` into worker `indices[j]` (distinct indices, in range, samples checked):
/// the estimate becomes `(1 - w) * old + w * sample` (the sample itself for a worker never
/// heard of, `at = -inf`), the live total that plus the open charges, `at` at least `now`, and
/// the idle clock starts at `now` when the estimate is at most `idle_ms` (and stops otherwise).
pub fn fold(e: &mut Estimates<'_>, indices: &[usize], samples: &[f64], now: f64, weight: f64, idle_ms: f64) {
    for (&i, &s) in indices.iter().zip(samples) {
        let x = if e.at[i] > f64::NEG_INFINITY { (1.0 - weight) * e.obs[i] + weight * s } else { s };
        e.obs[i] = x;
        e.tq[i] = x + e.pend[i];
        if now > e.at[i] {
            e.at[i] = now;
        }
        if x <= idle_ms {
            if e.idle_since[i].is_nan() {
                e.idle_since[i] = now;
            }
        } else {
            e.idle_since[i] = f64::NAN;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ewma_charges_and_idle_clock() {
        let (mut obs, mut tq, pend, mut at, mut idle) = (vec![0.0, 100.0], vec![0.0, 150.0], vec![0.0, 50.0], vec![f64::NEG_INFINITY, 1.0], vec![f64::NAN, f64::NAN]);
        let mut e = Estimates { obs: &mut obs, tq: &mut tq, pend: &pend, at: &mut at, idle_since: &mut idle };
        fold(&mut e, &[0, 1], &[0.0, 200.0], 2.0, 0.5, 1.0);
        assert_eq!((obs[0], obs[1]), (0.0, 150.0)); // first sample taken as is; then EWMA
        assert_eq!(tq[1], 200.0);
        assert_eq!((at[0], at[1]), (2.0, 2.0));
        assert_eq!(idle[0], 2.0);
        assert!(idle[1].is_nan());
        assert_eq!(first_bad_sample(&[1.0, -0.5, f64::NAN]), Some(1));
        assert_eq!(first_bad_sample(&[0.0, 3.0]), None);
        assert_eq!(first_bad_sample(&[0.0, 1e300]), Some(1));
    }
}
