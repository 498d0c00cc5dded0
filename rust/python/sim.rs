//! `SimEngine`: the simulator's engine (`crate::sim`) driven from `kvcompass.sim.engine`.
//!
//! `run(driver)` turns the engine's steps into calls of the driver's methods (route an
//! arrival, re-place a landing, KV events, responses, queue readings, progress) and calls the
//! driver's scheduled callbacks when they are due. No borrow of the engine is held while
//! Python runs, so the driver and the schemes may read the engine (queues, caches, the run's
//! generator) and schedule callbacks from inside any call.

use std::collections::HashMap;

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::arrays::{f64_vec, u32_vec, u64_vec};
use super::block_cache::{PyBlockCache, PyCacheEvents};
use super::errors::core_err;
use super::queues::PyQueueEstimates;
use crate::block_cache::BlockCache;
use crate::error::CoreError;
use crate::sim::{Baseline, CoordinatorState, DynamoState, SGLangState, Choice, Config, Cost, Engine, History, Out, Pcg64, Policy, RequestSpec, Salts, Step, WorkerCheck, WorkerSetup};

type RngState = (u128, u128, bool, u32);

#[pyclass(name = "SimEngine", module = "kvcompass._core")]
pub struct PySimEngine {
    inner: Engine,
    handles: HashMap<u64, Py<PyAny>>,
    next_handle: u64,
    /// Atomic so that clearing it needs only a shared borrow, which succeeds beside another
    /// thread's (`cached` holds one without the GIL; found in review: the exclusive borrow
    /// failed there and left the engine refusing every later run).
    running: std::sync::atomic::AtomicBool,
    live: Option<LiveSinks>,
    inbox: Option<Inbox>,
}

/// Queue-vector broadcasts in flight between edges (`set_broadcast_edges`), filed under the key
/// their delivery event would have had and folded when the destination edge is next read
/// (`settle_broadcasts`): see `Simulator._settle` for why that is exact.
struct Inbox {
    /// Per edge (by number): its region, its queue estimates, and per source edge the layout
    /// of that source's vectors here (None: never sent here).
    region: Vec<u16>,
    sinks: Vec<Py<PyQueueEstimates>>,
    maps: Vec<Vec<Option<VectorMap>>>,
    heaps: Vec<std::collections::BinaryHeap<std::cmp::Reverse<Post>>>,
}

/// How a source edge's vector lands at a destination: the destination's indices of the kept
/// samples, their positions in the vector (None: all, in order), their settle lags (s).
struct VectorMap {
    ix: Vec<i64>,
    pos: Option<Vec<usize>>,
    lag: Vec<f64>,
}

struct Post {
    t: f64,
    seq: u64,
    sub: u32,
    src: u32,
    vals: std::sync::Arc<Vec<f64>>,
}

impl Post {
    fn key(&self) -> (f64, u64, u32) {
        (self.t, self.seq, self.sub)
    }
}

impl PartialEq for Post {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == std::cmp::Ordering::Equal
    }
}
impl Eq for Post {}
impl PartialOrd for Post {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Post {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.t.total_cmp(&o.t).then(self.seq.cmp(&o.seq)).then(self.sub.cmp(&o.sub))
    }
}

/// `a < b` for (time, seq, sub) keys, as Python compares the tuples.
fn key_before(a: (f64, u64, u32), b: (f64, u64, u32)) -> bool {
    a.0 < b.0 || (a.0 == b.0 && (a.1, a.2) < (b.1, b.2))
}

/// Where the tick's live queue poll writes (`set_live_sinks`): each worker's sink (-1: its
/// region has no edge) and its index at that sink's edge; each sink an edge's queue estimates
/// with the settle lag (s) of each of that edge's workers.
struct LiveSinks {
    of: Vec<(i64, i64)>,
    sinks: Vec<(Py<PyQueueEstimates>, Vec<f64>)>,
}

impl LiveSinks {
    /// Where a reading of `worker` at `now_s` goes: `(sink, index there, settled before)`;
    /// None when no edge reads it.
    fn target(&self, worker: usize, now_s: f64) -> Option<(usize, i64, f64)> {
        let (k, i) = self.of[worker];
        (k >= 0).then(|| (k as usize, i, now_s - self.sinks[k as usize].1[i as usize]))
    }
}

fn bad(msg: String) -> PyErr {
    core_err(CoreError::InvalidArgument(msg))
}

fn u16_of(name: &str, v: Vec<u32>) -> PyResult<Vec<u16>> {
    v.into_iter()
        .map(|x| u16::try_from(x).map_err(|_| bad(format!("{name}: {x} is out of range"))))
        .collect()
}

/// The driver's answer to an arrival or a landing: `(worker, claimed[, delay_ms])`.
fn choice_of(obj: &Bound<'_, PyAny>, with_delay: bool) -> PyResult<Choice> {
    if with_delay {
        let (worker, claimed, delay_ms): (u32, i64, f64) = obj.extract()?;
        Ok(Choice {
            worker,
            claimed,
            delay_ms,
        })
    } else {
        let (worker, claimed): (u32, i64) = obj.extract()?;
        Ok(Choice {
            worker,
            claimed,
            delay_ms: 0.0,
        })
    }
}

impl PySimEngine {
    /// Tell the driver what the engine queued for it, each call under the sequence number it
    /// was queued at.
    fn flush(slf: &Bound<'_, Self>, d: &Driver<'_>) -> PyResult<()> {
        let py = slf.py();
        let out = slf.try_borrow_mut()?.inner.take_out();
        for o in out {
            match o {
                Out::Events {
                    seq,
                    worker,
                    events,
                } => {
                    slf.try_borrow_mut()?.inner.set_context(Some(seq));
                    let batch = PyCacheEvents::new_inner(events, slf.try_borrow()?.inner.block_size() as u32);
                    let r = d.events.call1((worker, batch));
                    slf.try_borrow_mut()?.inner.set_context(None);
                    r?;
                }
                Out::Respond {
                    seq,
                    worker,
                    edge_region,
                    claimed,
                    reused,
                    t,
                } => {
                    slf.try_borrow_mut()?.inner.set_context(Some(seq));
                    let r = d.respond.call1((worker, edge_region, claimed, reused, t));
                    slf.try_borrow_mut()?.inner.set_context(None);
                    r?;
                }
                Out::Response {
                    worker,
                    edge_region,
                    claimed,
                    reused,
                    vector,
                } => {
                    let v = vector.map(|v| v.into_vec().into_pyarray(py));
                    d.response.call1((worker, edge_region, claimed, reused, v))?;
                }
                Out::Queue { worker, queued_ms } => {
                    // A worker an edge reads live: straight into that edge's estimates, as
                    // `Edge.set_local_queue` would (`set_live_sinks`); otherwise the driver.
                    let direct = {
                        let s = slf.try_borrow()?;
                        let now_s = s.inner.now() / 1e3;
                        s.live.as_ref().and_then(|l| l.target(worker as usize, now_s).map(|(k, i, before)| (l.sinks[k].0.clone_ref(py), i, now_s, before)))
                    };
                    match direct {
                        Some((sink, i, now_s, before)) => sink.bind(py).try_borrow_mut()?.fold_vec(&[i], &[queued_ms], now_s, 1.0, crate::queues::Before::At(&[before]), Some(1))?,
                        None => {
                            d.queue.call1((worker, queued_ms))?;
                        }
                    }
                }
                Out::Progress { done } => {
                    if let Some(p) = &d.progress {
                        p.call1((done,))?;
                    }
                }
            }
        }
        Ok(())
    }
}

struct Driver<'py> {
    choose: Bound<'py, PyAny>,
    handoff: Option<Bound<'py, PyAny>>,
    events: Bound<'py, PyAny>,
    respond: Bound<'py, PyAny>,
    response: Bound<'py, PyAny>,
    queue: Bound<'py, PyAny>,
    progress: Option<Bound<'py, PyAny>>,
}

fn optional<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    let m = obj.getattr(name)?;
    Ok(if m.is_none() { None } else { Some(m) })
}

#[pymethods]
impl PySimEngine {
    /// See `kvcompass.sim.engine.Simulator`, which builds every argument from its topology,
    /// workload, scheme and config. `caches`' blocks move into the engine until
    /// `return_caches`.
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (cost, transfer_gbps, chunked, max_batched_tokens, wan_jitter, segment_steps, indexed, handoff, rtt, has_edge, region_workers, decoders, worker_regions, worker_beta, caches, publish, queue_to_edge, arrival_ms, region, edge_region, input_length, output_length, block_size, salt, salt_seed, ids, id_offsets, id_runs, rng_state, fault_state, progress_every, kv_pool=false))]
    fn new(
        cost: (f64, f64, f64, f64, f64, f64, f64, u64),
        transfer_gbps: f64,
        chunked: bool,
        max_batched_tokens: u64,
        wan_jitter: f64,
        segment_steps: u64,
        indexed: bool,
        handoff: bool,
        rtt: &Bound<'_, PyAny>,
        has_edge: Vec<bool>,
        region_workers: Vec<Vec<u32>>,
        decoders: Vec<Vec<u32>>,
        worker_regions: &Bound<'_, PyAny>,
        worker_beta: &Bound<'_, PyAny>,
        caches: Vec<Bound<'_, PyBlockCache>>,
        publish: Vec<bool>,
        queue_to_edge: Vec<bool>,
        arrival_ms: &Bound<'_, PyAny>,
        region: &Bound<'_, PyAny>,
        edge_region: &Bound<'_, PyAny>,
        input_length: &Bound<'_, PyAny>,
        output_length: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        salt: &Bound<'_, PyAny>,
        salt_seed: &Bound<'_, PyAny>,
        ids: &Bound<'_, PyAny>,
        id_offsets: &Bound<'_, PyAny>,
        id_runs: Vec<bool>,
        rng_state: RngState,
        fault_state: RngState,
        progress_every: u64,
        kv_pool: bool,
    ) -> PyResult<Self> {
        let (a, b, c, d, e, f, g, h) = cost;
        let cost = Cost {
            prefill_ms_per_token: a,
            prefill_base_ms: b,
            reload_ms_per_token: c,
            decode_base_ms: d,
            decode_ms_per_seq: e,
            decode_compute_ms_per_token: f,
            decode_ms_per_context_token: g,
            kv_bytes_per_token: h,
        };
        let cfg = Config {
            cost,
            transfer_gbps,
            chunked,
            max_batched_tokens,
            wan_jitter,
            segment_steps,
            indexed,
            handoff,
            rtt: f64_vec("rtt", rtt)?,
            has_edge,
            region_workers,
            decoders,
            kv_pool,
        };
        let wr = u16_of("worker_regions", u32_vec("worker_regions", worker_regions)?)?;
        let beta = f64_vec("worker_beta", worker_beta)?;
        if caches.len() != wr.len() || publish.len() != wr.len() || queue_to_edge.len() != wr.len() || beta.len() != wr.len()
        {
            return Err(bad(format!(
                "{} workers but {} caches, {} publish and {} queue flags",
                wr.len(),
                caches.len(),
                publish.len(),
                queue_to_edge.len()
            )));
        }
        // Every argument is read and checked before the caches' blocks move into the engine:
        // one refused after the move left the caller's caches empty (found in review).
        let arrival = f64_vec("arrival_ms", arrival_ms)?;
        let region = u16_of("region", u32_vec("region", region)?)?;
        let edge_region = u16_of("edge_region", u32_vec("edge_region", edge_region)?)?;
        let input_length = u64_vec("input_length", input_length)?;
        let output_length = u64_vec("output_length", output_length)?;
        let block_size = u32_vec("block_size", block_size)?;
        let salt = u32_vec("salt", salt)?;
        let salt_seed = u64_vec("salt_seed", salt_seed)?;
        let n = arrival.len();
        if [
            region.len(),
            edge_region.len(),
            input_length.len(),
            output_length.len(),
            block_size.len(),
            salt.len(),
            salt_seed.len(),
            id_runs.len(),
        ]
        .iter()
        .any(|&l| l != n)
        {
            return Err(bad("request columns differ in length".into()));
        }
        let reqs: Vec<RequestSpec> = (0..n)
            .map(|i| RequestSpec {
                arrival_ms: arrival[i],
                region: region[i],
                edge_region: edge_region[i],
                input_length: input_length[i],
                output_length: output_length[i],
                block_size: block_size[i],
                salt: salt[i],
                salt_seed: salt_seed[i],
                runs: id_runs[i],
            })
            .collect();
        let ids = u64_vec("ids", ids)?;
        let offs: Vec<usize> = u64_vec("id_offsets", id_offsets)?
            .into_iter()
            .map(|x| x as usize)
            .collect();
        // Every cache borrowed before any is touched: one in use elsewhere (or given twice) is
        // an error with nothing moved (found in review: `borrow_mut` panicked, after moving the
        // blocks of the caches before it).
        let mut held = Vec::with_capacity(caches.len());
        for (i, c) in caches.iter().enumerate() {
            held.push(c.try_borrow_mut().map_err(|e| bad(format!("caches[{i}]: {e}")))?);
        }
        let checks: Vec<WorkerCheck> = held
            .iter()
            .enumerate()
            .map(|(i, c)| WorkerCheck { region: wr[i], beta: beta[i], block_size: c.inner.block_size(), keep_tokens_ok: c.inner.can_keep_tokens(publish[i]) })
            .collect();
        Engine::check(&cfg, &checks, &reqs, &ids, &offs).map_err(core_err)?;
        let mut workers = Vec::with_capacity(wr.len());
        for (i, c) in held.iter_mut().enumerate() {
            let bs = c.inner.block_size();
            let placeholder = BlockCache::new(bs, 1, 0, false, 0).map_err(core_err)?;
            workers.push(WorkerSetup {
                region: wr[i],
                beta: beta[i],
                cache: std::mem::replace(&mut c.inner, placeholder),
                publish: publish[i],
                queue_to_edge: queue_to_edge[i],
            });
        }
        let rng = Pcg64::from_state(rng_state.0, rng_state.1, rng_state.2, rng_state.3);
        let faults = Pcg64::from_state(fault_state.0, fault_state.1, fault_state.2, fault_state.3);
        let inner = Engine::new(
            cfg,
            workers,
            reqs,
            ids,
            offs,
            rng,
            faults,
            progress_every,
        )
        .map_err(core_err)?;
        Ok(PySimEngine {
            inner,
            handles: HashMap::new(),
            next_handle: 0,
            running: std::sync::atomic::AtomicBool::new(false),
            live: None,
            inbox: None,
        })
    }

    /// Move the caches' blocks back into `caches` (the objects given to the constructor).
    fn return_caches(&mut self, caches: Vec<Bound<'_, PyBlockCache>>) -> PyResult<()> {
        let mut ws = self.inner.take_caches();
        if ws.len() != caches.len() {
            self.inner.put_caches(ws);
            return Err(bad("return_caches needs the constructor's caches".into()));
        }
        let mut held = Vec::with_capacity(caches.len());
        for (i, c) in caches.iter().enumerate() {
            match c.try_borrow_mut() {
                Ok(h) => held.push(h),
                Err(e) => {
                    self.inner.put_caches(ws);
                    return Err(bad(format!("caches[{i}]: {e}")));
                }
            }
        }
        for (c, mine) in held.iter_mut().zip(ws.iter_mut()) {
            std::mem::swap(&mut c.inner, mine);
        }
        self.inner.put_caches(ws);
        Ok(())
    }

    /// Replay to the end. `driver` has `choose(req, tokens) -> (worker, claimed, delay_ms)`,
    /// `handoff` (None, or `(job, req, tokens, worker, region) -> (worker, claimed) | None`),
    /// `events(worker, cache_events)`, `respond(worker, edge_region, claimed, reused, t)` (a
    /// response leaving a worker whose region's edge piggybacks its queue vector: the driver
    /// asks that edge and schedules the delivery), `response(worker, edge_region, claimed,
    /// reused, vector or None)` (a response reaching its edge now, delivered by the engine),
    /// `queue(worker, queued_ms)` and `progress` (None or `(done) -> None`).
    fn run(slf: &Bound<'_, Self>, driver: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        {
            let me = slf.try_borrow()?;
            if me.running.swap(true, std::sync::atomic::Ordering::SeqCst) {
                return Err(bad("the engine is already running".into()));
            }
        }
        let d = Driver {
            choose: driver.getattr("choose")?,
            handoff: optional(driver, "handoff")?,
            events: driver.getattr("events")?,
            respond: driver.getattr("respond")?,
            response: driver.getattr("response")?,
            queue: driver.getattr("queue")?,
            progress: optional(driver, "progress")?,
        };
        let result = (|| -> PyResult<()> {
            loop {
                let step = slf.try_borrow_mut()?.inner.next().map_err(core_err)?;
                let Some(step) = step else { return Ok(()) };
                match step {
                    Step::Out => Self::flush(slf, &d)?,
                    Step::Arrive { req } => {
                        let tokens = slf
                            .try_borrow_mut()?
                            .inner
                            .pending_tokens()
                            .unwrap_or(&[])
                            .to_vec()
                            .into_pyarray(py);
                        let c = choice_of(&d.choose.call1((req, tokens))?, true)?;
                        slf.try_borrow_mut()?.inner.arrive(req, c).map_err(core_err)?;
                    }
                    Step::Land {
                        job,
                        req,
                        worker,
                        region,
                    } => {
                        let c = match &d.handoff {
                            None => None,
                            Some(h) => {
                                let tokens = slf
                                    .try_borrow()?
                                    .inner
                                    .job_tokens(job)
                                    .unwrap_or(&[])
                                    .to_vec()
                                    .into_pyarray(py);
                                let r = h.call1((job, req, tokens, worker, region))?;
                                if r.is_none() {
                                    None
                                } else {
                                    Some(choice_of(&r, false)?)
                                }
                            }
                        };
                        slf.try_borrow_mut()?.inner.land(job, c).map_err(core_err)?;
                    }
                    Step::External(h) => {
                        let f = slf.try_borrow_mut()?.handles.remove(&h);
                        if let Some(f) = f {
                            f.call0(py)?;
                        }
                    }
                }
            }
        })();
        match slf.try_borrow() {
            Ok(me) => me.running.store(false, std::sync::atomic::Ordering::SeqCst),
            Err(e) => return result.and(Err(e.into())),
        }
        result
    }

    /// Route arrivals with the least-loaded worker of a pool (one pool, or one per region for
    /// the request's region) instead of the driver's `choose` (`crate::sim::Policy`).
    /// Random (`round_robin` false) or round-robin dispatch over `pool`.
    fn set_oblivious(&mut self, pool: Vec<u32>, round_robin: bool) -> PyResult<()> {
        self.inner.set_policy(Policy::Oblivious { pool, round_robin, next: 0 }).map_err(core_err)
    }

    fn set_least_loaded(&mut self, pools: Vec<Vec<u32>>, per_region: bool) -> PyResult<()> {
        self.inner.set_policy(Policy::LeastLoaded { pools, per_region }).map_err(core_err)
    }

    /// Content-keyed baselines' salt keys: `_h64("salt", s)` and `repr(s)` per salt number (0: none).
    fn set_salts(&mut self, h64: Vec<u64>, repr: Vec<String>) -> PyResult<()> {
        if h64.len() != repr.len() || h64.is_empty() {
            return Err(bad("set_salts needs one key and one repr per salt number, 0 included".into()));
        }
        self.inner.set_salts(Salts { h64, repr });
        Ok(())
    }

    /// Consistent hashing: a ring `(sorted positions, owner per position)` per level.
    fn set_consistent_hash(&mut self, levels: Vec<u64>, rings: Vec<(Bound<'_, PyAny>, Vec<u32>)>) -> PyResult<()> {
        let mut out = Vec::with_capacity(rings.len());
        for (pos, owner) in rings {
            let pos = u64_vec("ring positions", &pos)?;
            if pos.len() != owner.len() || pos.is_empty() || pos.windows(2).any(|w| w[0] > w[1]) {
                return Err(bad("a ring needs sorted positions and one owner each".into()));
            }
            out.push((pos, owner));
        }
        if out.len() < levels.len().max(1) {
            return Err(bad("one ring per level".into()));
        }
        self.inner.set_policy(Policy::Baseline(Baseline::ConsistentHash { levels, rings: out })).map_err(core_err)
    }

    /// Chord: nodes sorted by id (`ids`, their workers and regions), 64 fingers each, and the
    /// entry node per region (None: the nearest node).
    #[allow(clippy::too_many_arguments)]
    fn set_chord(&mut self, levels: Vec<u64>, ids: Vec<u64>, nodes: Vec<u32>, regions: Vec<u16>, fingers: Vec<Vec<u32>>, entry: Vec<Option<u32>>) -> PyResult<()> {
        let n = ids.len();
        if n == 0 || nodes.len() != n || regions.len() != n || fingers.len() != n || fingers.iter().flatten().any(|&f| f as usize >= n) || entry.iter().flatten().any(|&e| e as usize >= n) {
            return Err(bad("chord tables do not agree".into()));
        }
        self.inner.set_policy(Policy::Baseline(Baseline::Chord { levels, ids, nodes, regions, fingers, entry })).map_err(core_err)
    }

    /// The Central Directory: its routable workers and their prefill rates, every worker's cache
    /// name seed, the coordinator's region and the joint score's constants.
    #[allow(clippy::too_many_arguments)]
    fn set_central_directory(&mut self, workers: Vec<u32>, beta: Vec<f64>, seeds: Vec<u64>, coordinator: u16, wan_fraction: f64, lambda_max: f64, tau_ms: f64, gamma: f64, tie_ms: f64) -> PyResult<()> {
        if workers.is_empty() || beta.len() != workers.len() {
            return Err(bad("one prefill rate per worker".into()));
        }
        if seeds.len() != self.inner.workers() {
            return Err(bad("one cache name seed per worker".into()));
        }
        let c = CoordinatorState::new(workers, beta, seeds, coordinator, wan_fraction, lambda_max, tau_ms, gamma, tie_ms);
        self.inner.set_policy(Policy::Baseline(Baseline::CentralDirectory(Box::new(c)))).map_err(core_err)
    }

    /// Dynamo-style routers: the broadcast period, the indexed workers, every worker's beta and
    /// cache name seed, and for the global router `(regions with workers, their mean beta,
    /// their workers)`.
    #[pyo3(signature = (period_ms, workers, beta, seeds, global_=None))]
    fn set_dynamo(&mut self, period_ms: f64, workers: Vec<u32>, beta: Vec<f64>, seeds: Vec<u64>, global_: Option<(Vec<u16>, Vec<f64>, Vec<Vec<u32>>)>) -> PyResult<()> {
        let n = self.inner.workers();
        if !(period_ms > 0.0) || beta.len() != n || seeds.len() != n || workers.iter().any(|&w| w as usize >= n) {
            return Err(bad("dynamo tables do not match the topology".into()));
        }
        if let Some((regions, rbeta, by_region)) = &global_ {
            if regions.len() != rbeta.len() || regions.len() != by_region.len() || by_region.iter().any(|p| p.is_empty()) || by_region.iter().flatten().any(|&w| w as usize >= n) {
                return Err(bad("dynamo-global tables do not agree".into()));
            }
        }
        let regions = self.inner.regions();
        let st = DynamoState::new(period_ms, workers, beta, seeds, regions, global_);
        self.inner.set_policy(Policy::Baseline(Baseline::Dynamo(Box::new(st)))).map_err(core_err)
    }

    /// Blocks of `tokens` (under `salt_seed`) the installed Dynamo router knows worker `w` holds.
    fn dynamo_exact_blocks(&self, worker: u32, tokens: &Bound<'_, PyAny>, salt_seed: u64) -> PyResult<usize> {
        let tokens = u32_vec("tokens", tokens)?;
        let chain = crate::chunk_hash::block_chain(salt_seed, &tokens, self.inner.block_size()).map_err(core_err)?;
        self.inner.dynamo_exact_blocks(worker, &chain).map_err(core_err)
    }

    /// The installed Chord's lookup of `key` from region `origin`: `(worker, hops, delay_ms)`.
    fn chord_lookup(&self, origin: u16, key: u64) -> PyResult<(u32, u32, f64)> {
        self.inner.chord_lookup(origin, key).map_err(core_err)
    }

    /// PlanetServe: a pool and a routing history of `capacity` prefixes per region.
    fn set_planetserve(&mut self, pools: Vec<Vec<u32>>, capacity: usize) -> PyResult<()> {
        let trees = pools.iter().map(|_| History::new(capacity)).collect();
        self.inner.set_policy(Policy::Baseline(Baseline::PlanetServe { pools, trees })).map_err(core_err)
    }

    /// SkyWalker: pools and histories per region, the remote regions of each in push order,
    /// and every worker's region.
    fn set_skywalker(&mut self, pools: Vec<Vec<u32>>, remote: Vec<Vec<u16>>, region_of: Vec<u16>, capacity: usize) -> PyResult<()> {
        if remote.len() != pools.len() || remote.iter().flatten().any(|&r| r as usize >= pools.len()) || region_of.iter().any(|&r| r as usize >= pools.len()) {
            return Err(bad("skywalker tables do not agree".into()));
        }
        let trees = pools.iter().map(|_| History::new(capacity)).collect();
        self.inner.set_policy(Policy::Baseline(Baseline::SkyWalker { pools, trees, remote, region_of })).map_err(core_err)
    }

    /// SGLang's cache-aware router over `workers`: trees cut back to `max_blocks` every
    /// `interval_ms`; the cache and balance thresholds as SGLang names them.
    #[allow(clippy::too_many_arguments)]
    fn set_sglang(&mut self, workers: Vec<u32>, max_blocks: usize, interval_ms: f64, cache_threshold: f64, balance_abs: u32, balance_rel: f64) -> PyResult<()> {
        if workers.is_empty() || !(interval_ms > 0.0) {
            return Err(bad("sglang needs workers and a positive eviction interval".into()));
        }
        let st = SGLangState::new(workers, max_blocks, interval_ms, cache_threshold, balance_abs, balance_rel);
        self.inner.set_policy(Policy::Baseline(Baseline::SGLang(Box::new(st)))).map_err(core_err)
    }

    /// Schedule every arrival (before anything the driver schedules after this call).
    fn start(&mut self) {
        self.inner.start();
    }

    /// Follow-ups wait for their parents (before `start`): `parents[i]` (uint32, in arrival
    /// order; 2**32 - 1 for none) is the request whose last token must reach the client
    /// before request `i` is sent; it must come before `i`.
    fn set_parents(&mut self, parents: &Bound<'_, PyAny>) -> PyResult<()> {
        let p = u32_vec("parents", parents)?;
        self.inner.set_parents(&p).map_err(core_err)
    }

    /// Run closed loop (before `start`): `outstanding` requests in flight; each completion
    /// issues the next request when its client has the last token.
    fn set_closed_loop(&mut self, outstanding: usize) -> PyResult<()> {
        self.inner.set_closed_loop(outstanding).map_err(core_err)
    }

    /// When each request reached its edge (ms; its arrival time, or in a closed loop when it
    /// was issued); empty before `start`.
    fn issued<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        self.inner.issued().to_vec().into_pyarray(py)
    }

    /// Moving the KV of `tokens` between workers (ms), by the run's cost model and link.
    fn transfer_ms(&self, tokens: u64) -> f64 {
        self.inner.transfer_ms(tokens)
    }

    /// The `(seq, sub)` a callback scheduled now would sort by, taken without scheduling one.
    fn reserve_key(&mut self) -> (u64, u32) {
        self.inner.reserve_key()
    }

    /// `(t, seq, sub)` of the event being processed.
    fn current(&self) -> (f64, u64, u32) {
        self.inner.current()
    }

    /// Call `fn()` at `t` (ms of virtual time).
    fn at(&mut self, t: f64, f: Py<PyAny>) -> PyResult<()> {
        let h = self.next_handle;
        self.next_handle += 1;
        self.inner.at_external(t, h).map_err(core_err)?;
        self.handles.insert(h, f);
        Ok(())
    }

    #[getter]
    fn now(&self) -> f64 {
        self.inner.now()
    }

    /// The next arrival's time (ms; inf when none is left) while nothing is in flight, else
    /// None (the engine's `quiet_until`).
    fn quiet_until(&self) -> Option<f64> {
        self.inner.quiet_until()
    }

    fn queued_ms(&self, worker: u32, now: f64) -> PyResult<f64> {
        self.inner.queued_ms(worker, now).map_err(core_err)
    }

    #[pyo3(signature = (worker, origin=None))]
    fn dispatched_ms(&self, worker: u32, origin: Option<u16>) -> PyResult<f64> {
        self.inner.dispatched_ms(worker, origin).map_err(core_err)
    }

    fn waiting(&self, worker: u32) -> PyResult<usize> {
        self.inner.waiting(worker).map_err(core_err)
    }

    fn pending(&self, worker: u32) -> PyResult<u32> {
        self.inner.pending(worker).map_err(core_err)
    }

    fn cached(
        &self,
        py: Python<'_>,
        worker: u32,
        tokens: &Bound<'_, PyAny>,
        salt_seed: u64,
    ) -> PyResult<(u64, u64)> {
        let tokens = u32_vec("tokens", tokens)?;
        let inner = &self.inner;
        py.detach(|| inner.cached(worker, &tokens, salt_seed))
            .map_err(core_err)
    }

    /// One WAN traversal (ms) from region `a` to `b`, jittered (a draw) when the run asks;
    /// InvalidArgumentError (and no draw) unless both are regions of the topology.
    fn way(&mut self, a: u16, b: u16) -> PyResult<f64> {
        self.inner.checked_way(a, b).map_err(core_err)
    }

    /// The run's generator: `Generator.integers(n)` (numpy's stream, continued).
    fn rng_integers(&mut self, n: u64) -> PyResult<u64> {
        if n == 0 {
            return Err(bad("integers(0): the range is empty".into()));
        }
        Ok(self.inner.rng().integers(n))
    }

    /// The run's generator: `Generator.random()`.
    fn rng_random(&mut self) -> f64 {
        self.inner.rng().random()
    }

    /// The faults' generator: `Generator.random()`.
    fn fault_random(&mut self) -> f64 {
        self.inner.faults().random()
    }

    /// The state of the run's and the faults' generators (numpy's terms).
    fn rng_states(&mut self) -> (RngState, RngState) {
        (self.inner.rng().state(), self.inner.faults().state())
    }

    fn copy_in<'py>(
        &mut self,
        py: Python<'py>,
        worker: u32,
        tokens: &Bound<'py, PyAny>,
        tier: u8,
        salt: u32,
        salt_seed: u64,
    ) -> PyResult<Bound<'py, PyCacheEvents>> {
        let tokens = u32_vec("tokens", tokens)?;
        let ev = self
            .inner
            .copy_in(worker, &tokens, tier, salt, salt_seed)
            .map_err(core_err)?;
        Bound::new(py, PyCacheEvents::new_inner(ev, self.inner.block_size() as u32))
    }

    #[allow(clippy::too_many_arguments)]
    fn migrate_recompute(
        &mut self,
        t: f64,
        worker: u32,
        tokens: &Bound<'_, PyAny>,
        tier: u8,
        region: u16,
        salt: u32,
        salt_seed: u64,
    ) -> PyResult<()> {
        let tokens = u32_vec("tokens", tokens)?;
        self.inner
            .migrate_recompute(t, worker, tokens, tier, region, salt, salt_seed)
            .map_err(core_err)
    }

    /// Where `poll_live` and the engine's queue readings (instead of the driver's `queue`)
    /// write: `sink_of[w]` the sink of worker `w` (-1: no edge reads it),
    /// `index_of[w]` its index at that sink's edge; each sink `(queue_estimates, settle_lag_s)`,
    /// an edge's estimates and the settle lag of each of its workers (`Edge.live_sink`).
    fn set_live_sinks(&mut self, sink_of: Vec<i64>, index_of: Vec<i64>, sinks: Vec<(Py<PyQueueEstimates>, Vec<f64>)>) -> PyResult<()> {
        let n = self.inner.workers();
        if sink_of.len() != n || index_of.len() != n {
            return Err(bad(format!("set_live_sinks: {} sinks and {} indices for {n} workers", sink_of.len(), index_of.len())));
        }
        for (w, (&s, &i)) in sink_of.iter().zip(&index_of).enumerate() {
            if s < -1 || s >= sinks.len() as i64 {
                return Err(bad(format!("set_live_sinks: worker {w} has sink {s}, not in -1..{}", sinks.len())));
            }
            if s >= 0 && (i < 0 || i as usize >= sinks[s as usize].1.len()) {
                return Err(bad(format!("set_live_sinks: worker {w} has index {i} at sink {s} of {} workers", sinks[s as usize].1.len())));
            }
        }
        self.live = Some(LiveSinks { of: sink_of.into_iter().zip(index_of).collect(), sinks });
        Ok(())
    }

    /// The tick's live poll: every busy worker's queue (`busy_queues`) set at its edge as a
    /// live reading at `now_s` (`QueueEstimates.set_live_many` per edge, its workers in worker
    /// order, settled before `now_s` minus each one's lag). Returns how many were read.
    fn poll_live(&mut self, py: Python<'_>, now_s: f64) -> PyResult<usize> {
        let live = self.live.as_ref().ok_or_else(|| bad("poll_live before set_live_sinks".into()))?;
        let busy = self.inner.busy_queues();
        let mut per: Vec<(Vec<i64>, Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new(), Vec::new()); live.sinks.len()];
        for &(w, q) in &busy {
            let Some((s, i, before)) = live.target(w as usize, now_s) else {
                return Err(pyo3::exceptions::PyRuntimeError::new_err("the engine polled the queue of a worker whose region has no edge"));
            };
            let p = &mut per[s];
            p.0.push(i);
            p.1.push(q);
            p.2.push(before);
        }
        for ((ix, qs, before), (sink, _)) in per.iter().zip(&live.sinks) {
            if !ix.is_empty() {
                sink.bind(py).try_borrow_mut()?.fold_vec(ix, qs, now_s, 1.0, crate::queues::Before::At(before), Some(before.len()))?;
            }
        }
        Ok(busy.len())
    }

    /// The edges that broadcast queue vectors to each other: each one's region, queue
    /// estimates, and per source edge `(indices, positions or None, lags)` of that source's
    /// vectors here (`Edge.vector_map`; None where the source never sends here).
    #[allow(clippy::type_complexity)]
    fn set_broadcast_edges(&mut self, regions: Vec<u16>, sinks: Vec<Py<PyQueueEstimates>>, maps: Vec<Vec<Option<(Vec<i64>, Option<Vec<usize>>, Vec<f64>)>>>) -> PyResult<()> {
        let n = regions.len();
        if sinks.len() != n || maps.len() != n || maps.iter().any(|m| m.len() != n) {
            return Err(bad(format!("set_broadcast_edges: {n} regions, {} sinks, {} map rows: need one each and a row of {n} per edge", sinks.len(), maps.len())));
        }
        if let Some(&r) = regions.iter().find(|&&r| r as usize >= self.inner.regions()) {
            return Err(bad(format!("set_broadcast_edges: region {r} out of range")));
        }
        let maps: Vec<Vec<Option<VectorMap>>> = maps
            .into_iter()
            .map(|row| {
                row.into_iter()
                    .map(|m| {
                        m.map(|(ix, pos, lag)| {
                            if ix.len() != lag.len() || pos.as_ref().is_some_and(|p| p.len() != ix.len()) {
                                return Err(bad(format!("set_broadcast_edges: {} indices, {} lags and {:?} positions differ in length", ix.len(), lag.len(), pos.as_ref().map(Vec::len))));
                            }
                            Ok(VectorMap { ix, pos, lag })
                        })
                        .transpose()
                    })
                    .collect::<PyResult<Vec<_>>>()
            })
            .collect::<PyResult<_>>()?;
        self.inbox = Some(Inbox { region: regions, sinks, maps, heaps: (0..n).map(|_| Default::default()).collect() });
        Ok(())
    }

    /// Edge `src` broadcasts `values` (its own workers' estimates) now to each edge of
    /// `targets`, in that order: each copy takes one WAN way (a draw when the run jitters) and
    /// the sequence key of an event scheduled now.
    fn post_broadcast(&mut self, src: usize, targets: Vec<usize>, values: &Bound<'_, PyAny>) -> PyResult<()> {
        let values = super::arrays::readonly_of::<f64>("values", "float64", values)?;
        let now = self.inner.now();
        let inbox = self.inbox.as_mut().ok_or_else(|| bad("post_broadcast before set_broadcast_edges".into()))?;
        let n = inbox.region.len();
        if src >= n {
            return Err(bad(format!("post_broadcast: edge {src} out of 0..{n}")));
        }
        let vals = std::sync::Arc::new(values.as_slice()?.to_vec());
        if let Some(j) = crate::queues::first_bad_sample(&vals) {
            return Err(bad(format!("post_broadcast: value {j} = {} ms is not a queue estimate (finite, in [0, {}])", vals[j], crate::queues::MAX_QUEUE_MS)));
        }
        for &d in &targets {
            let map = inbox.maps.get(d).and_then(|row| row[src].as_ref());
            let Some(map) = map else {
                return Err(bad(format!("post_broadcast: edge {src} does not send to edge {d}")));
            };
            let need = map.pos.as_ref().map_or(map.ix.len(), |p| p.iter().max().map_or(0, |m| m + 1));
            if vals.len() < need || (map.pos.is_none() && vals.len() != map.ix.len()) {
                return Err(bad(format!("post_broadcast: {} values, the vector of edge {src} has {}", vals.len(), map.ix.len())));
            }
        }
        for d in targets {
            let (a, b) = (inbox.region[src], inbox.region[d]);
            let t = now + self.inner.way(a, b);
            let (seq, sub) = self.inner.reserve_key();
            inbox.heaps[d].push(std::cmp::Reverse(Post { t, seq, sub, src: src as u32, vals: vals.clone() }));
        }
        Ok(())
    }

    /// Fold into edge `dst`'s estimates, in (time, seq, sub) order, every broadcast to it that
    /// sorts before `bound` (default: the event being processed). Returns how many.
    #[pyo3(signature = (dst, bound=None))]
    fn settle_broadcasts(&mut self, py: Python<'_>, dst: usize, bound: Option<(f64, u64, u32)>) -> PyResult<usize> {
        let cur = bound.unwrap_or_else(|| self.inner.current());
        let inbox = self.inbox.as_mut().ok_or_else(|| bad("settle_broadcasts before set_broadcast_edges".into()))?;
        let heap = inbox.heaps.get_mut(dst).ok_or_else(|| bad(format!("settle_broadcasts: edge {dst} out of range")))?;
        let mut n = 0;
        if !heap.peek().is_some_and(|p| key_before(p.0.key(), cur)) {
            return Ok(0);
        }
        let mut s = inbox.sinks[dst].bind(py).try_borrow_mut()?;
        let mut picked = Vec::new();
        while heap.peek().is_some_and(|p| key_before(p.0.key(), cur)) {
            let std::cmp::Reverse(p) = heap.pop().expect("peeked");
            let map = inbox.maps[dst][p.src as usize].as_ref().expect("checked when posted");
            let samples: &[f64] = match &map.pos {
                None => &p.vals,
                Some(pos) => {
                    picked.clear();
                    picked.extend(pos.iter().map(|&j| p.vals[j]));
                    &picked
                }
            };
            s.fold_lagged_slice(&map.ix, samples, p.t / 1e3, &map.lag)?;
            n += 1;
        }
        Ok(n)
    }

    /// `(workers, queued_ms)` of the workers running a prefill whose edge reads their queue,
    /// as two arrays (int64, float64) in worker order.
    fn busy_queues<'py>(&self, py: Python<'py>) -> (Bound<'py, numpy::PyArray1<i64>>, Bound<'py, numpy::PyArray1<f64>>) {
        let (w, q): (Vec<i64>, Vec<f64>) = self.inner.busy_queues().into_iter().map(|(w, q)| (w as i64, q)).unzip();
        (w.into_pyarray(py), q.into_pyarray(py))
    }

    #[getter]
    fn completed(&self) -> u64 {
        self.inner.completed()
    }

    #[getter]
    fn handoffs(&self) -> u64 {
        self.inner.handoffs
    }

    /// Requests the shared KV pool held back at least once (`kv_pool=True`): a prefill, or a
    /// handed-off sequence on its decode instance.
    #[getter]
    fn kv_waits(&self) -> u64 {
        self.inner.kv_waits
    }

    #[getter]
    fn events_processed(&self) -> u64 {
        self.inner.events_processed
    }

    /// Bytes held by the engine's memo of prompt runs' block names and partial sums.
    #[getter]
    fn memo_bytes(&self) -> usize {
        self.inner.chain_memo_bytes()
    }

    fn decoded(&self, worker: u32) -> PyResult<u64> {
        self.inner.decoded(worker).map_err(core_err)
    }

    /// The worker's busy intervals `(begin, end)` ms as an (n, 2) array.
    fn busy<'py>(&self, py: Python<'py>, worker: u32) -> PyResult<Bound<'py, PyArray2<f64>>> {
        let b = self.inner.busy(worker).map_err(core_err)?;
        let flat: Vec<f64> = b.iter().flat_map(|&(x, y)| [x, y]).collect();
        Ok(flat.into_pyarray(py).reshape([b.len(), 2])?)
    }

    /// The records: a tuple of arrays `(order, worker, ttft_ms, e2e_ms, queue_ms, vram_hit,
    /// dram_hit, claimed)`, each indexed by request except `order` (completion order).
    fn records<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let r = &self.inner.records;
        PyTuple::new(
            py,
            [
                r.order.clone().into_pyarray(py).into_any(),
                r.worker.clone().into_pyarray(py).into_any(),
                r.ttft_ms.clone().into_pyarray(py).into_any(),
                r.e2e_ms.clone().into_pyarray(py).into_any(),
                r.queue_ms.clone().into_pyarray(py).into_any(),
                r.vram_hit.clone().into_pyarray(py).into_any(),
                r.dram_hit.clone().into_pyarray(py).into_any(),
                r.claimed.clone().into_pyarray(py).into_any(),
            ],
        )
    }

    /// Per cache: `(blocks, block-table slots, VRAM heap entries, DRAM heap entries, heap slots)`.
    fn cache_tables(&self) -> Vec<(usize, usize, usize, usize, usize)> {
        (0..self.inner.workers() as u32)
            .filter_map(|w| self.inner.cache(w).ok())
            .map(|c| {
                let (t, hv, hd) = c.capacities();
                (c.len(), t, c.heap_len(1), c.heap_len(2), hv + hd)
            })
            .collect()
    }

    /// Bytes the engine's caches hold in Rust (while they are in the engine).
    fn cache_memory_bytes(&self) -> usize {
        (0..self.inner.workers() as u32)
            .filter_map(|w| self.inner.cache(w).ok())
            .map(|c| c.memory_bytes())
            .sum()
    }
}

type CostArgs = (f64, f64, f64, f64, f64, f64, f64, u64);

fn cost_of(c: CostArgs) -> Cost {
    let (a, b, cc, d, e, f, g, h) = c;
    Cost { prefill_ms_per_token: a, prefill_base_ms: b, reload_ms_per_token: cc, decode_base_ms: d, decode_ms_per_seq: e, decode_compute_ms_per_token: f, decode_ms_per_context_token: g, kv_bytes_per_token: h }
}

/// The cost model's forms (`crate::sim::Cost`), for `kvcompass.engine.costs.CostModel`: the one
/// implementation the simulator's engine and the services' emulated workers share.
#[pyfunction]
fn cost_prefill_ms(cost: CostArgs, uncached: u64) -> f64 {
    cost_of(cost).prefill_ms(uncached)
}

#[pyfunction]
fn cost_reload_ms(cost: CostArgs, dram: u64) -> f64 {
    cost_of(cost).reload_ms(dram)
}

#[pyfunction]
fn cost_decode_step_ms(cost: CostArgs, batch: u64, context: u64) -> f64 {
    cost_of(cost).decode_step_ms(batch, context)
}

#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cost_estimate_ms(cost: CostArgs, length: u64, vram_hit: u64, dram_hit: u64, batch: u64, context: u64, max_batched_tokens: u64, chunked: bool) -> f64 {
    cost_of(cost).estimate_ms(length, vram_hit, dram_hit, batch, context, max_batched_tokens, chunked)
}

#[pyfunction]
fn cost_chunk_step(cost: CostArgs, left: u64, extra_ms: f64, batch: u64, context: u64, max_batched_tokens: u64) -> (u64, f64, f64) {
    cost_of(cost).chunk_step(left, extra_ms, batch, context, max_batched_tokens)
}

/// `(prefill_ms, mixed_decode_ms, batched_decode_ms, handed_decode_ms)` a saturated worker (or
/// decode instance) spends per request of `(inputs, outputs)` with nothing reused
/// (`crate::sim::Cost::saturated_ms`).
#[pyfunction]
#[pyo3(signature = (cost, inputs, outputs, max_batched_tokens, pool_tokens = 0))]
fn cost_saturated_ms(py: Python<'_>, cost: CostArgs, inputs: &Bound<'_, PyAny>, outputs: &Bound<'_, PyAny>, max_batched_tokens: u64, pool_tokens: u64) -> PyResult<(f64, f64, f64, f64)> {
    let (i, o) = (u64_vec("inputs", inputs)?, u64_vec("outputs", outputs)?);
    if i.len() != o.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!("inputs and outputs differ in length ({} vs {})", i.len(), o.len())));
    }
    let prompts: Vec<(u64, u64)> = i.iter().copied().zip(o.iter().copied()).collect();
    let c = cost_of(cost);
    Ok(py.detach(|| c.saturated_ms(&prompts, max_batched_tokens, pool_tokens)))
}

/// Busy time per (worker, window) before division by the windows' widths, and each worker's
/// total busy time (`crate::sim::busy`): `intervals[w]` is worker `w`'s flattened
/// `(begin, end)` pairs (float64), `edges` the window edges built from `start` and `window`.
#[pyfunction]
fn busy_windows<'py>(py: Python<'py>, intervals: Vec<Bound<'py, PyAny>>, start: f64, window: f64, edges: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyArray2<f64>>, Bound<'py, PyArray1<f64>>)> {
    if !(window > 0.0) {
        return Err(pyo3::exceptions::PyValueError::new_err(format!("window must be > 0, got {window}")));
    }
    let edges = f64_vec("edges", edges)?;
    if edges.len() < 2 {
        return Err(pyo3::exceptions::PyValueError::new_err("edges: at least two (one window)"));
    }
    // Found in review: NaN or descending edges were taken and gave meaningless windows.
    if !start.is_finite() || edges.iter().any(|e| !e.is_finite()) || edges.windows(2).any(|w| w[1] < w[0]) {
        return Err(pyo3::exceptions::PyValueError::new_err("start and edges must be finite, the edges ascending"));
    }
    let mut flat = Vec::with_capacity(intervals.len());
    for (w, iv) in intervals.iter().enumerate() {
        let v = f64_vec(&format!("intervals[{w}]"), iv)?;
        if v.len() % 2 != 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!("intervals[{w}]: (begin, end) pairs, got {} values", v.len())));
        }
        flat.push(v);
    }
    let n = edges.len() - 1;
    let (out, totals) = py.detach(|| {
        let views: Vec<&[f64]> = flat.iter().map(|v| v.as_slice()).collect();
        crate::sim::busy::busy_windows(&views, start, window, &edges)
    });
    let arr = numpy::ndarray::Array2::from_shape_vec((flat.len(), n), out).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    Ok((arr.into_pyarray(py), totals.into_pyarray(py)))
}

/// One worker's KV pool (`rust/sim/kv_pool.rs`): the VRAM its running sequences and its prefix
/// cache share, for the emulated workers of the services (the simulator's engine holds its own).
#[pyclass(name = "KvPool", module = "kvcompass._core")]
pub struct PyKvPool {
    inner: crate::sim::kv_pool::KvPool,
}

#[pymethods]
impl PyKvPool {
    #[new]
    fn new(blocks: u64) -> PyResult<Self> {
        if blocks == 0 {
            return Err(bad("a KV pool needs at least one block".into()));
        }
        Ok(PyKvPool { inner: crate::sim::kv_pool::KvPool::new(blocks) })
    }
    /// Whether a sequence of these full prompt blocks (a cache's chain) and `extra` reserved
    /// blocks fits beside the held ones (true when none are held).
    fn fits(&mut self, chain: &Bound<'_, PyAny>, extra: u64) -> PyResult<bool> {
        let chain = u64_vec("chain", chain)?;
        Ok(self.inner.fits(&chain, extra))
    }
    /// Hold the chain and reserve `extra` blocks: the handle `release` takes.
    fn hold(&mut self, chain: &Bound<'_, PyAny>, extra: u64) -> PyResult<u32> {
        Ok(self.inner.hold(u64_vec("chain", chain)?, extra))
    }
    /// Let go of what `handle` holds (InvalidArgumentError for a handle that holds nothing);
    /// with `cache`, give it its room back at once (only grows it: `fit_cache`'s rule).
    #[pyo3(signature = (handle, cache=None, events=true))]
    fn release(&mut self, handle: u32, cache: Option<PyRefMut<'_, PyBlockCache>>, events: bool) -> PyResult<()> {
        match cache {
            Some(mut c) => self.inner.release_into(handle, &mut c.inner, events),
            None => self.inner.release(handle),
        }
        .map_err(core_err)
    }
    /// `cache` keeps what the reservations leave of the pool, as a prefill lands; what no
    /// longer fits is demoted (its events returned, empty unless `events`).
    #[pyo3(signature = (cache, events=true))]
    fn fit_cache<'py>(&self, py: Python<'py>, mut cache: PyRefMut<'py, PyBlockCache>, events: bool) -> PyResult<Bound<'py, pyo3::types::PyList>> {
        let out = self.inner.fit_cache(&mut cache.inner, events).map_err(core_err)?;
        super::block_cache::events_out(py, out)
    }
    /// Blocks a sequence reserves beyond its prompt's full blocks: the partial last block and
    /// `sequences` answers of `answer` tokens, each but its last token (the simulator's rule).
    #[staticmethod]
    fn extra_blocks(prompt_len: u64, answer: u64, sequences: u64, block_size: u64) -> PyResult<u64> {
        if block_size == 0 {
            return Err(bad("block_size must be >= 1".into()));
        }
        Ok(crate::sim::kv_pool::KvPool::extra_blocks(prompt_len, answer, sequences, block_size))
    }
    /// Blocks the prefix cache keeps: the pool less the reservations, at least one.
    #[getter]
    fn cache_blocks(&self) -> usize {
        self.inner.cache_blocks()
    }
    #[getter]
    fn held(&self) -> usize {
        self.inner.held()
    }
    #[getter]
    fn reserved(&self) -> u64 {
        self.inner.reserved()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvPool>()?;
    m.add_function(wrap_pyfunction!(cost_prefill_ms, m)?)?;
    m.add_function(wrap_pyfunction!(cost_reload_ms, m)?)?;
    m.add_function(wrap_pyfunction!(cost_decode_step_ms, m)?)?;
    m.add_function(wrap_pyfunction!(cost_estimate_ms, m)?)?;
    m.add_function(wrap_pyfunction!(cost_chunk_step, m)?)?;
    m.add_function(wrap_pyfunction!(cost_saturated_ms, m)?)?;
    m.add_function(wrap_pyfunction!(busy_windows, m)?)?;
    m.add_class::<PySimEngine>()?;
    Ok(())
}
