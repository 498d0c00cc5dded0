//! The edge's fold of a remote queue vector into its per-worker estimates
//! (`kvcompass.discovery.queues.QueueEstimates.fold_many` documents the rule): every sample is
//! an EWMA step on the worker's estimate from samples, which then moves its live total (samples
//! plus open charges), its last-heard time and its idle clock.
//!
//! An edge folds one vector per region every broadcast period plus one per piggybacked response,
//! so at simulated scale it folds thousands a second; as a dozen numpy calls on arrays of a few
//! workers each, that was a fifth of a KVCompass run.

use std::collections::VecDeque;

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

/// Every estimate an edge keeps, with its open dispatch charges: the whole of
/// `kvcompass.discovery.queues.QueueEstimates` (whose module docs give the rules), so a route,
/// a live reading or a folded vector is one call with no Python in between. Times are seconds,
/// queues milliseconds.
pub struct QueueState {
    pub tq: Vec<f64>,
    pub obs: Vec<f64>,
    pub pend: Vec<f64>,
    pub at: Vec<f64>,
    pub idle_since: Vec<f64>,
    charges: Vec<VecDeque<(f64, f64)>>,
    /// Every open charge's (time, worker) in issue order, to run the TTL out across workers.
    order: VecDeque<(f64, usize)>,
    pub ttl: f64,
    pub weight: f64,
    pub idle_ms: f64,
    /// Bumped on every change, so readers can cache what they derive from the estimates.
    pub version: u64,
}

/// The most workers one set of estimates covers (2^24: a fleet is thousands). More is a
/// caller's bug, refused before the per-worker arrays are allocated (2^40 of them aborted the
/// process).
pub const MAX_WORKERS: usize = 1 << 24;

/// A queue report the estimates refuse.
#[derive(Debug, Clone, PartialEq)]
pub enum QueueError {
    /// A sample (or charge) not finite and in [0, MAX_QUEUE_MS]: its position and value.
    Sample(usize, f64),
    /// A worker index out of range, or repeated within one vector.
    Index(i64),
    /// A time (s) that is not finite, or a settle time that is NaN: which argument, its value.
    Time(&'static str, f64),
}

/// `now` as a time the estimates may be changed at: finite (a NaN `now` closed charges without
/// settling them, an infinite one every charge at once).
pub fn check_now(now: f64) -> Result<(), QueueError> {
    if now.is_finite() {
        Ok(())
    } else {
        Err(QueueError::Time("now", now))
    }
}

impl QueueState {
    pub fn new(n: usize, weight: f64, idle_ms: f64, ttl: f64) -> Self {
        QueueState {
            tq: vec![0.0; n],
            obs: vec![0.0; n],
            pend: vec![0.0; n],
            at: vec![f64::NEG_INFINITY; n],
            idle_since: vec![f64::NAN; n],
            charges: (0..n).map(|_| VecDeque::new()).collect(),
            order: VecDeque::new(),
            ttl,
            weight,
            idle_ms,
            version: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.tq.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tq.is_empty()
    }

    pub fn has_open_charges(&self) -> bool {
        !self.order.is_empty()
    }

    fn index(&self, i: i64) -> Result<usize, QueueError> {
        if i < 0 || i as usize >= self.tq.len() {
            return Err(QueueError::Index(i));
        }
        Ok(i as usize)
    }

    /// The distinct, in-range indices of a vector, and its samples checked, before anything
    /// changes (a bad vector changes nothing).
    pub fn check(&self, indices: &[i64], samples: &[f64]) -> Result<Vec<usize>, QueueError> {
        let mut seen = vec![false; self.tq.len()];
        let mut ix = Vec::with_capacity(indices.len());
        for &i in indices {
            let u = self.index(i)?;
            if std::mem::replace(&mut seen[u], true) {
                return Err(QueueError::Index(i));
            }
            ix.push(u);
        }
        if let Some(j) = first_bad_sample(samples) {
            return Err(QueueError::Sample(j, samples[j]));
        }
        Ok(ix)
    }

    /// This edge just sent `work_ms` of prefill to worker `i` at `now` (finite: checked, with
    /// the work, before anything changes).
    pub fn charge(&mut self, i: i64, work_ms: f64, now: f64) -> Result<(), QueueError> {
        let u = self.index(i)?;
        if first_bad_sample(&[work_ms]).is_some() {
            return Err(QueueError::Sample(0, work_ms));
        }
        self.expire(now)?;
        if work_ms > 0.0 {
            self.charges[u].push_back((now, work_ms));
            self.order.push_back((now, u));
            self.pend[u] += work_ms;
            self.tq[u] += work_ms;
            // Work this edge just sent means the worker's estimate is not zero: its idle clock
            // stops, and restarts at the next reading of an empty queue (found in review: a
            // worker this edge had just loaded still counted as persistently idle for
            // migration, against the paper's rule that the estimate stayed at zero).
            self.idle_since[u] = f64::NAN;
            self.version += 1;
        }
        Ok(())
    }

    /// Close every charge older than the TTL; a `now` that is not finite is refused and
    /// changes nothing.
    pub fn expire(&mut self, now: f64) -> Result<(), QueueError> {
        check_now(now)?;
        let before = now - self.ttl;
        while let Some(&(t, u)) = self.order.front() {
            if t > before {
                break;
            }
            self.order.pop_front();
            self.settle(u, before);
        }
        Ok(())
    }

    /// Close worker `u`'s charges made at or before `before`.
    fn settle(&mut self, u: usize, before: f64) {
        let q = &mut self.charges[u];
        match q.front() {
            Some(&(t, _)) if t <= before => {}
            _ => return,
        }
        while let Some(&(t, x)) = q.front() {
            if t > before {
                break;
            }
            q.pop_front();
            self.pend[u] -= x;
        }
        if q.is_empty() || self.pend[u] < 0.0 {
            // No float residue once nothing is open, and none below zero while something is:
            // a charge far smaller than the running total is lost to rounding when added and
            // then subtracted whole, which left a worker's estimate at -6e-14 and every route
            // refusing it until the last open charge expired (found in review).
            self.pend[u] = 0.0;
        }
        self.tq[u] = self.obs[u] + self.pend[u];
        self.version += 1;
    }

    /// Fold `samples[j]` into worker `ix[j]` (checked by [`Self::check`]) with `weight`; the
    /// charges each sample must include (made at or before `before[j]`, or at or before
    /// `now - lag[j]`) close, at most the TTL back.
    pub fn fold_checked(&mut self, ix: &[usize], samples: &[f64], now: f64, weight: f64, before: Before<'_>) {
        let mut est = Estimates { obs: &mut self.obs, tq: &mut self.tq, pend: &self.pend, at: &mut self.at, idle_since: &mut self.idle_since };
        fold(&mut est, ix, samples, now, weight, self.idle_ms);
        if !self.order.is_empty() {
            let floor = now - self.ttl;
            for (j, &u) in ix.iter().enumerate() {
                if !self.charges[u].is_empty() {
                    let b = match before {
                        Before::At(b) => b[j],
                        Before::Lag(l) => now - l[j],
                        Before::Now => now,
                    };
                    self.settle(u, b.max(floor));
                }
            }
        }
        self.version += ix.len() as u64;
    }
}

/// Which charges a sample includes: those made at or before a time per sample, `now` minus a
/// lag per sample, or `now` (all of them).
#[derive(Clone, Copy)]
pub enum Before<'a> {
    At(&'a [f64]),
    Lag(&'a [f64]),
    Now,
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

    #[test]
    fn charges_close_by_sample_or_ttl() {
        let mut q = QueueState::new(2, 0.5, 1.0, 2.0);
        q.charge(0, 30.0, 1.0).unwrap();
        q.charge(0, 10.0, 1.5).unwrap();
        assert_eq!((q.tq[0], q.pend[0]), (40.0, 40.0));
        // A live reading that includes the first charge only.
        let ix = q.check(&[0], &[5.0]).unwrap();
        q.fold_checked(&ix, &[5.0], 1.6, 1.0, Before::At(&[1.2]));
        assert_eq!((q.obs[0], q.pend[0], q.tq[0]), (5.0, 10.0, 15.0));
        q.expire(3.6).unwrap(); // the second one runs out at 1.5 + 2
        assert_eq!((q.pend[0], q.tq[0]), (0.0, 5.0));
        assert!(!q.has_open_charges());
        assert_eq!(q.charge(5, 1.0, 0.0), Err(QueueError::Index(5)));
        assert_eq!(q.charge(0, -1.0, 0.0), Err(QueueError::Sample(0, -1.0)));
        assert_eq!(q.check(&[1, 1], &[0.0, 0.0]), Err(QueueError::Index(1)));
    }

    #[test]
    fn a_time_that_is_not_finite_changes_nothing() {
        let mut q = QueueState::new(2, 0.5, 1.0, 2.0);
        q.charge(1, 10.0, 1.0).unwrap();
        let v = q.version;
        assert!(matches!(q.charge(0, 5.0, f64::NAN), Err(QueueError::Time(..))));
        assert!(matches!(q.expire(f64::NAN), Err(QueueError::Time(..))));
        assert!(matches!(q.expire(f64::INFINITY), Err(QueueError::Time(..))));
        assert_eq!((q.pend[1], q.version), (10.0, v));
        q.expire(1e6).unwrap();
        assert_eq!(q.pend[1], 0.0);
    }
}
