//! The event loop and the worker model (see the module notes of [`crate::sim`] and
//! `kvcompass/sim/engine.py`, which documents every rule implemented here).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use super::rng::Pcg64;
pub use policy::{Baseline, CoordinatorState, DynamoState, History, SGLangState, Salts};

#[path = "policy.rs"]
mod policy;
pub(crate) use policy::py_floordiv;
use crate::block_cache::{reusable_blocks, BlockCache, Event, TokenSource, DRAM, VRAM};
use super::kv_pool::KvPool;
use crate::error::{CoreError, Result, MAX_ELEMENTS};
use crate::chunk_hash::{block_chain, block_chain_extend, block_chain_root};
use crate::token_ids::{chain_block_ids, expand_blocks};

/// The calibrated cost model (`kvcompass.engine.costs.CostModel`), float for float.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    pub prefill_ms_per_token: f64,
    pub prefill_base_ms: f64,
    pub reload_ms_per_token: f64,
    pub decode_base_ms: f64,
    pub decode_ms_per_seq: f64,
    pub decode_compute_ms_per_token: f64,
    pub decode_ms_per_context_token: f64,
    pub kv_bytes_per_token: u64,
}

impl Cost {
    #[inline]
    pub fn prefill_ms(&self, uncached: u64) -> f64 {
        if uncached == 0 {
            0.0
        } else {
            self.prefill_base_ms + self.prefill_ms_per_token * uncached as f64
        }
    }
    #[inline]
    pub fn reload_ms(&self, dram: u64) -> f64 {
        self.reload_ms_per_token * dram as f64
    }
    #[inline]
    fn linear(&self, batch: u64) -> f64 {
        (self.decode_base_ms + self.decode_ms_per_seq * batch as f64)
            .max(self.decode_compute_ms_per_token * batch as f64)
    }
    /// One decode step of `batch` sequences holding `context` tokens (0 for an empty batch).
    #[inline]
    pub fn decode_step_ms(&self, batch: u64, context: u64) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        self.linear(batch) + self.decode_ms_per_context_token * context as f64
    }
    /// A prompt of `length` tokens with `v` VRAM and `d` DRAM hit tokens: the uncached rest
    /// computed, the DRAM part reloaded (separate lanes: the whole prefill at once). Hits past
    /// the prompt (even past 2^64 together) leave nothing to compute.
    #[inline]
    pub fn prefill_with_reuse_ms(&self, length: u64, v: u64, d: u64) -> f64 {
        self.prefill_ms(length - length.min(v.saturating_add(d))) + self.reload_ms(d)
    }

    /// A worker's estimate of a waiting prompt's prefill: [`Self::prefill_with_reuse_ms`] and,
    /// with chunked sharing, one decode step of the batch it runs now (`batch` sequences of
    /// `context` tokens) per chunk, as a vLLM worker that knows its running batch can tell.
    #[allow(clippy::too_many_arguments)]
    pub fn estimate_ms(&self, length: u64, v: u64, d: u64, batch: u64, context: u64, max_batched_tokens: u64, chunked: bool) -> f64 {
        let ms = self.prefill_with_reuse_ms(length, v, d);
        let uncached = length - length.min(v.saturating_add(d));
        if !chunked || uncached == 0 || batch == 0 {
            return ms;
        }
        let room = max_batched_tokens.saturating_sub(batch).max(1);
        ms + uncached.div_ceil(room) as f64 * self.decode_step_ms(batch, context)
    }

    /// One vLLM step under chunked sharing with `left` prompt tokens still to compute (and
    /// `extra_ms` of fixed cost and reload paid with the first chunk): every running sequence's
    /// next token first, the prompt fills the rest of the token budget. `(chunk tokens, the
    /// chunk's compute ms, the decode step ms)`; the step takes their sum.
    #[inline]
    pub fn chunk_step(&self, left: u64, extra_ms: f64, batch: u64, context: u64, max_batched_tokens: u64) -> (u64, f64, f64) {
        let room = max_batched_tokens.saturating_sub(batch).max(1);
        let chunk = left.min(room);
        let compute = self.prefill_ms_per_token * chunk as f64 + extra_ms;
        let decode = if batch != 0 { self.decode_step_ms(batch, context) } else { 0.0 };
        (chunk, compute, decode)
    }

    /// What a saturated worker spends per request when nothing is reused, under this step
    /// model: the mean-field fixed point of a worker that always has a prompt waiting.
    /// `(prefill_ms, mixed_decode_ms, batched_decode_ms, handed_decode_ms)`, means over the
    /// prompts `(input, output)`:
    ///
    /// * `prefill_ms`: `beta * L` plus the fixed cost of every prompt that computes a token.
    /// * `mixed_decode_ms` (chunked sharing, every step a mixed one): each step carries one
    ///   prompt's next chunk of at most `M - B` tokens and advances the `B` running sequences
    ///   one token. A prompt of `L` tokens takes `ceil(L / (M - B))` steps, so a request brings
    ///   `n = E[ceil(L / (M - B))]` steps and `E[O - 1]` sequence-steps (its first token is the
    ///   prefill's), and in steady state `B = E[O - 1] / n`. Per request the steps cost
    ///   `n * max(t0 + a B, c B) + b * E[(O - 1) L + O (O - 1) / 2]` (each decode step reads the
    ///   sequence's context, `L + 1` and growing by one); below one running sequence on
    ///   average only a share `B` of the steps pays the floor `t0`.
    /// * `batched_decode_ms` (a decode lane or a decode instance, whose batch grows with load,
    ///   so the step floor `t0` vanishes per token): `max(a, c) * E[O - 1]` plus the same
    ///   context term.
    /// * `handed_decode_ms` (a decode instance of a disaggregated fleet): as `batched`, but a
    ///   sequence holds its pool only for its `O - 1` decode steps (the prefill instance held
    ///   it before), so with a pool the batch is at most `E[O - 1] * P / E[(L + O - 1) (O - 1)]`
    ///   and each token pays `t0` over that batch. (The engine holds the room from the
    ///   hand-off's admission, a transfer earlier: about 1 % more here, left out.)
    ///
    /// With a KV pool of `pool_tokens` (0: unbounded), the batch is at most what the pool
    /// holds: a sequence holds its prompt and its reserved answer, `L + O - 1` tokens, from its
    /// prefill's first step to its last token, `ceil(L / (M - B)) + O - 1` steps, so by Little's
    /// law `B <= E[O - 1] * P / E[(L + O - 1) (ceil(L / (M - B)) + O - 1)]` (at least one: a
    /// sequence larger than the pool runs alone). A batch held below `B` leaves steps without a
    /// chunk: a request brings `E[O - 1] / B` steps, each paying the floor `t0`, and a decode
    /// lane pays `t0 / B` a token too. Why: the engine's pool holds prompts back when it is
    /// full, so a capacity that ignored it put load 1.0 above what the fleet can serve (0.81x
    /// on the testbed with 2-8k-token prompts and 100-500-token answers).
    ///
    /// The capacity of a worker is `1000 / (prefill + mixed)` req/s with chunked sharing,
    /// `1000 / max(prefill, batched)` with lanes; `kvcompass.sim.capacity` sums the fleet.
    pub fn saturated_ms(&self, prompts: &[(u64, u64)], max_batched_tokens: u64, pool_tokens: u64) -> (f64, f64, f64, f64) {
        if prompts.is_empty() {
            return (0.0, 0.0, 0.0, 0.0);
        }
        let n = prompts.len() as f64;
        let mut prefill = 0.0;
        let mut seq_steps = 0.0;
        let mut context = 0.0;
        for &(l, o) in prompts {
            prefill += self.prefill_ms(l);
            let d = o.saturating_sub(1) as f64;
            seq_steps += d;
            context += d * l as f64 + d * (d + 1.0) / 2.0;
        }
        let (prefill, seq_steps, context) = (prefill / n, seq_steps / n, context / n);
        let steps_per_request = |room: u64| prompts.iter().map(|&(l, _)| l.div_ceil(room).max(1) as f64).sum::<f64>() / n;
        // B = E[O - 1] / E[ceil(L / (M - B))]: start from an empty batch; a handful of rounds
        // settle it (B only shrinks the room; room is clamped to one token).
        let mut batch = 0.0f64;
        let mut steps = steps_per_request(max_batched_tokens.max(1));
        for _ in 0..32 {
            let room = max_batched_tokens.saturating_sub(batch.round() as u64).max(1);
            steps = steps_per_request(room);
            let next = seq_steps / steps;
            if (next - batch).abs() < 1e-9 {
                break;
            }
            batch = next;
        }
        let ctx = self.decode_ms_per_context_token * context;
        // Little's law over the pool: a sequence holds `L + O - 1` tokens for `steps(L, O - 1)`
        // steps, so the batch is at most `E[O - 1] P / E[(L + O - 1) steps]` (at least one).
        let bounded = pool_tokens > 0 && seq_steps > 0.0;
        let little = |steps: &dyn Fn(u64, f64) -> f64| {
            let held = prompts.iter().map(|&(l, o)| {
                let d = o.saturating_sub(1) as f64;
                (l as f64 + d) * steps(l, d)
            });
            (seq_steps * pool_tokens as f64 / (held.sum::<f64>() / n)).max(1.0)
        };
        // The pool's bound on the batch: a few rounds, as the room it leaves changes the
        // prefill's steps (a smaller batch leaves more room a step).
        let mut cap = f64::INFINITY;
        if bounded {
            for _ in 0..8 {
                let room = max_batched_tokens.saturating_sub(batch.min(cap).round() as u64).max(1);
                let next = little(&|l, d| l.div_ceil(room).max(1) as f64 + d);
                if (next - cap).abs() < 1e-9 {
                    break;
                }
                cap = next;
            }
        }
        // A step with an empty batch pays no decode at all: with fewer than one running
        // sequence on average, only that share of the steps pays the floor.
        let floor = if batch > cap { seq_steps / cap * self.decode_base_ms } else { steps * batch.min(1.0) * self.decode_base_ms };
        let mixed = (floor + self.decode_ms_per_seq * seq_steps).max(self.decode_compute_ms_per_token * seq_steps) + ctx;
        let per_token = |cap: f64| {
            let floor = if cap.is_finite() { self.decode_base_ms / cap } else { 0.0 };
            (floor + self.decode_ms_per_seq).max(self.decode_compute_ms_per_token) * seq_steps + ctx
        };
        // A decode instance holds a sequence only for its decode steps.
        let handed_cap = if bounded { little(&|_, d| d) } else { f64::INFINITY };
        (prefill, mixed, per_token(cap), per_token(handed_cap))
    }

    /// Moving the KV of `tokens` over a `gbps` link. The bits are counted in 128 bits (they
    /// wrapped in 64, so a larger transfer could take less time) and saturate there: the same
    /// value wherever 64 bits held them.
    #[inline]
    pub fn transfer_ms(&self, tokens: u64, gbps: f64) -> f64 {
        let bits = (u128::from(self.kv_bytes_per_token) * u128::from(tokens)).saturating_mul(8);
        bits as f64 / (gbps * 1e9) * 1e3
    }
}

/// A run's knobs (`kvcompass.sim.engine.SimConfig` plus what the driver derives from the
/// topology and the scheme).
#[derive(Clone, Debug)]
pub struct Config {
    pub cost: Cost,
    pub transfer_gbps: f64,
    pub chunked: bool,
    pub max_batched_tokens: u64,
    pub wan_jitter: f64,
    pub segment_steps: u64,
    /// The scheme reads the discovery plane: responses and queue readings go to the driver.
    pub indexed: bool,
    /// The scheme re-places forwarded requests on landing ([`Step::Land`]).
    pub handoff: bool,
    /// Regions × regions RTT (ms), row-major.
    pub rtt: Vec<f64>,
    /// Per region: whether an edge runs there.
    pub has_edge: Vec<bool>,
    /// Per region: its workers (all roles), in topology order.
    pub region_workers: Vec<Vec<u32>>,
    /// Per region: the decode instances its prefill hands off to (empty: not disaggregated).
    pub decoders: Vec<Vec<u32>>,
    /// A worker's running sequences and its prefix cache share its VRAM ([`Engine::kv_fits`]):
    /// a prompt starts its prefill only when its KV fits beside theirs, and the cache keeps
    /// what their reservations leave. Off: every prompt starts at once and the cache keeps all
    /// of VRAM (the model before the twenty-seventh session).
    pub kv_pool: bool,
}

/// Who routes arrivals: the driver ([`Step::Arrive`]), or a baseline implemented here.
#[derive(Clone, Debug, Default)]
pub enum Policy {
    #[default]
    Driver,
    /// The worker with the least queued plus dispatched prefill work among a pool, ties drawn
    /// from the run's generator (`kvcompass.sim.schemes`: `oracle` with one pool of every
    /// server and the dispatched work of every origin; `local-least-loaded` with one pool per
    /// region, the request's region's, and that region's own dispatched share).
    LeastLoaded { pools: Vec<Vec<u32>>, per_region: bool },
    /// Blind to load and caches: a uniform draw from `pool` (the run's generator), or the next
    /// worker of `pool` in turn (`kvcompass.sim.schemes`: `random`, `round-robin`).
    Oblivious { pool: Vec<u32>, round_robin: bool, next: usize },
    /// A content-keyed or exact-state baseline ([`Baseline`]).
    Baseline(Baseline),
}

/// One emulated worker as the driver builds it.
pub struct WorkerSetup {
    pub region: u16,
    /// Its prefill rate (ms per uncached token; the topology's `beta_ms_per_token`), which
    /// replaces the run's cost model's for this worker.
    pub beta: f64,
    pub cache: BlockCache,
    /// Its cache calls build KV events (someone reads them).
    pub publish: bool,
    /// Its queue readings go to its region's edge.
    pub queue_to_edge: bool,
}

impl WorkerSetup {
    /// What [`Engine::check`] reads of this setup.
    pub fn check(&self) -> WorkerCheck {
        WorkerCheck { region: self.region, beta: self.beta, block_size: self.cache.block_size(), keep_tokens_ok: self.cache.can_keep_tokens(self.publish) }
    }
}

/// What [`Engine::check`] reads of a worker's setup, without its cache.
#[derive(Clone, Copy, Debug)]
pub struct WorkerCheck {
    pub region: u16,
    pub beta: f64,
    /// Its cache's block size.
    pub block_size: usize,
    /// Its cache can keep tokens exactly when it publishes ([`BlockCache::can_keep_tokens`]).
    pub keep_tokens_ok: bool,
}

/// One request of the workload: its block ids expand to its tokens at arrival.
#[derive(Clone, Copy, Debug)]
pub struct RequestSpec {
    pub arrival_ms: f64,
    pub region: u16,
    pub edge_region: u16,
    pub input_length: u64,
    pub output_length: u64,
    pub block_size: u32,
    pub salt: u32,
    pub salt_seed: u64,
    /// Its slice of the block ids is runs `(chain, count)` of synthetic ids
    /// ([`crate::token_ids::chain_block_ids`]), not the ids themselves.
    pub runs: bool,
}

/// The workload's requests and their block ids (`ids[id_offs[i]..id_offs[i + 1]]` for request
/// `i`): everything a prompt's tokens are expanded from.
struct Prompts {
    reqs: Vec<RequestSpec>,
    ids: Vec<u64>,
    id_offs: Vec<usize>,
}

impl Prompts {
    /// The block ids of request `req`'s prompt (its runs' ids, or its plain ids as they are).
    fn block_ids(&self, req: u32) -> std::borrow::Cow<'_, [u64]> {
        let slice = &self.ids[self.id_offs[req as usize]..self.id_offs[req as usize + 1]];
        if self.reqs[req as usize].runs {
            let chains: Vec<u64> = slice.iter().step_by(2).copied().collect();
            let counts: Vec<u64> = slice.iter().skip(1).step_by(2).copied().collect();
            std::borrow::Cow::Owned(chain_block_ids(&chains, &counts).expect("a request's runs are checked when the engine is built"))
        } else {
            std::borrow::Cow::Borrowed(slice)
        }
    }

    /// The first `n` tokens of request `req`'s prompt (all of them when `n` is larger).
    fn tokens_upto(&self, req: u32, n: usize) -> Vec<u32> {
        let r = self.reqs[req as usize];
        expand_blocks(&self.block_ids(req), n.min(r.input_length as usize), r.block_size as usize)
    }

    /// The seed-free block chain of request `req`'s prompt under its salt's seed: what
    /// [`block_chain`] of its tokens gives, value for value (tested), computed without the
    /// tokens where `memo` has them.
    ///
    /// Why: a prompt's chain needs its tokens, and expanding a 5,000-token prompt from its block
    /// ids is ~10 µs here, more than the rest of what a cache-blind scheme does per request. But a
    /// synthetic prompt is a few runs of ids, most of them shared with earlier prompts (a
    /// system prompt, a document, a conversation so far), and the names of a run's blocks depend
    /// only on the name before the run and the run's ids ([`Self::run_values`]). Prompts given
    /// as plain ids (trace files) are hashed from their tokens every time.
    fn chain(&self, req: u32, block_size: usize, memo: &mut ChainMemo) -> Vec<u64> {
        let r = self.reqs[req as usize];
        let n = r.input_length as usize / block_size;
        let root = block_chain_root(r.salt_seed);
        if !r.runs || r.block_size as usize != block_size {
            let mut out = Vec::with_capacity(n);
            block_chain_extend(root, &self.tokens_upto(req, n * block_size), block_size, &mut out);
            return out;
        }
        let before = |at: usize, names: &[u64]| if at == 0 { root } else { names[at - 1] };
        self.run_values(req, n, block_size, memo, before, |_, h, toks, out| block_chain_extend(h, toks, block_size, out))
    }

    /// [`policy::prefix_sum`] of request `req`'s first `n` tokens (`block` tokens a block),
    /// where `chain` is its chain ([`Self::chain`]): the same value, from `memo`'s per-block
    /// terms of the runs seen before (keyed like the chain's names: by the name before the run,
    /// which also fixes where the run starts) instead of from the tokens.
    fn prefix_sum(&self, req: u32, n: usize, block: usize, chain: &[u64], memo: &mut ChainMemo) -> Option<u64> {
        let r = self.reqs[req as usize];
        let nb = n.min(r.input_length as usize) / block;
        if nb == 0 {
            return None;
        }
        if !r.runs || r.block_size as usize != block || chain.len() < nb {
            return policy::prefix_sum(&self.tokens_upto(req, n), block);
        }
        let root = block_chain_root(r.salt_seed);
        let coef = policy::prefix_coef(block);
        let terms = self.run_values(req, nb, block, memo, |at, _| if at == 0 { root } else { chain[at - 1] }, |at, _, toks, out| {
            out.extend(toks.chunks_exact(block).enumerate().map(|(j, row)| policy::prefix_term(row, (at + j) as u64, &coef)));
        });
        Some(terms.iter().fold(0u64, |acc, &t| acc.wrapping_add(t)))
    }

    /// One value a block for the first `nb` blocks of request `req`, a prompt given as runs of
    /// ids (`block` tokens a block), run by run: a run's values depend only on the name of the
    /// block before it (`before(at, values so far)` for a run starting at block `at`) and its
    /// ids, so they come from `memo` when that run followed that name before, and otherwise
    /// `fill(at, name before, the run's tokens, out)` appends them and `memo` keeps them.
    fn run_values(&self, req: u32, nb: usize, block: usize, memo: &mut ChainMemo, before: impl Fn(usize, &[u64]) -> u64, mut fill: impl FnMut(usize, u64, &[u32], &mut Vec<u64>)) -> Vec<u64> {
        let slice = &self.ids[self.id_offs[req as usize]..self.id_offs[req as usize + 1]];
        let mut out = Vec::with_capacity(nb);
        for run in slice.chunks_exact(2) {
            let at = out.len();
            if at >= nb {
                break;
            }
            let (id, need) = (run[0], (run[1] as usize).min(nb - at));
            let b = before(at, &out);
            if let Some(values) = memo.get(b, id, need) {
                out.extend_from_slice(values);
            } else {
                let ids = chain_block_ids(&[id], &[need as u64]).expect("at most the prompt's blocks");
                fill(at, b, &expand_blocks(&ids, need * block, block), &mut out);
                memo.put(b, id, &out[at..]);
            }
        }
        out
    }
}

impl TokenSource for Prompts {
    fn tokens(&self, req: u32) -> Vec<u32> {
        self.tokens_upto(req, usize::MAX)
    }

    /// Only the blocks asked for are expanded (a block's tokens depend on its id alone): a
    /// demotion's event under cache churn takes a few blocks of a 5,000-token prompt, and
    /// expanding the whole prompt for them was a tenth of a paper-scale KVCompass run.
    fn block_tokens(&self, req: u32, first: usize, n: usize, block_size: usize) -> Vec<u32> {
        let r = self.reqs[req as usize];
        let (lo, hi) = (first * block_size, (first + n) * block_size);
        if r.block_size as usize != block_size || hi > r.input_length as usize {
            return self.tokens(req)[lo..hi].to_vec();
        }
        expand_blocks(&self.block_ids(req)[first..first + n], hi - lo, block_size)
    }
}

/// Per-block values of runs of synthetic ids (the blocks' names, or prefix-sum terms), by (name
/// of the block before the run, the run's chain id): see [`Prompts::run_values`]. Bounded: when
/// the values it holds reach [`MEMO_NAMES`], it starts over (the runs still in use come back at
/// the next miss).
#[derive(Default)]
struct ChainMemo {
    at: rustc_hash::FxHashMap<(u64, u64), (u32, u32)>,
    names: Vec<u64>,
}

/// 32 MB of names: a few thousand prompts' worth of runs.
const MEMO_NAMES: usize = 1 << 22;

impl ChainMemo {
    /// The first `need` names of the run, if it is held with at least that many.
    #[inline]
    fn get(&self, before: u64, chain: u64, need: usize) -> Option<&[u64]> {
        let &(start, len) = self.at.get(&(before, chain))?;
        (len as usize >= need).then(|| &self.names[start as usize..start as usize + need])
    }

    fn put(&mut self, before: u64, chain: u64, names: &[u64]) {
        if self.names.len() + names.len() > MEMO_NAMES {
            self.at.clear();
            self.names.clear();
            if names.len() > MEMO_NAMES {
                return;
            }
        }
        let start = self.names.len() as u32;
        self.names.extend_from_slice(names);
        self.at.insert((before, chain), (start, names.len() as u32));
    }

    fn bytes(&self) -> usize {
        self.names.capacity() * 8 + self.at.capacity() * 32
    }
}

/// A routing decision: worker index, claimed tokens, lookup delay beyond the edge.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    pub worker: u32,
    pub claimed: i64,
    pub delay_ms: f64,
}

/// What the driver must do next.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Step {
    /// Tell the driver what [`Engine::take_out`] holds, then call [`Engine::next`] again.
    Out,
    /// Route request `req` (its tokens: [`Engine::pending_tokens`]), then [`Engine::arrive`].
    Arrive { req: u32 },
    /// Job `job` (request `req`) reached `worker` in `region`, another edge's region: the
    /// scheme may re-place it, then [`Engine::land`].
    Land {
        job: u32,
        req: u32,
        worker: u32,
        region: u16,
    },
    /// A driver event scheduled with [`Engine::at_external`] is due.
    External(u64),
}

/// What the driver is told, in the model's order. `seq`: where whatever it schedules in reply sorts.
#[derive(Clone, Debug, PartialEq)]
pub enum Out {
    /// A worker's KV events (to its agent and to a scheme that follows them).
    Events {
        seq: u64,
        worker: u32,
        events: Vec<Event>,
    },
    /// The first token leaves `worker`, of another region that runs an edge, for the edge of
    /// `edge_region`, arriving at `t`: the driver asks the worker's own edge for the queue
    /// vector it piggybacks, and schedules the delivery ([`Out::Response`] otherwise).
    Respond {
        seq: u64,
        worker: u32,
        edge_region: u16,
        claimed: i64,
        reused: u64,
        t: f64,
    },
    /// The first token from `worker` reaches the edge of `edge_region` now: the reuse report,
    /// and for a worker of a region without an edge, that region's queue vector as it stood
    /// when the token left.
    Response {
        worker: u32,
        edge_region: u16,
        claimed: i64,
        reused: u64,
        vector: Option<Box<[f64]>>,
    },
    /// A worker's queued prefill work changed: its region's edge reads it live.
    Queue { worker: u32, queued_ms: f64 },
    /// `done` requests have completed.
    Progress { done: u64 },
}

#[derive(Clone, Copy, Debug)]
enum Ev {
    Arrive(u32),
    Land(u32),
    Enqueue { w: u32, job: u32 },
    EndPrefill { w: u32, job: u32 },
    EndSegment { w: u32, gen: u64 },
    EndMixed { w: u32, job: u32, chunk: u64 },
    Join { w: u32, job: u32 },
    /// `vector`: an index into `Engine::in_flight_vectors`, or [`NO_VECTOR`].
    Response { worker: u32, edge_region: u16, claimed: i64, reused: u64, vector: u32 },
    External(u64),
}

struct Entry {
    t: f64,
    seq: u64,
    sub: u32,
    ev: Ev,
}

crate::ord_from_cmp!(Entry);
impl Ord for Entry {
    /// Reversed: the heap pops the earliest `(t, seq, sub)`, floats compared as Python does.
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.partial_cmp(&self.t)
            .unwrap_or(Ordering::Equal)
            .then(o.seq.cmp(&self.seq))
            .then(o.sub.cmp(&self.sub))
    }
}

const NO_REQ: u32 = u32::MAX;
/// `Ev::Response` without a queue vector.
const NO_VECTOR: u32 = u32::MAX;

/// Jobs a queue keeps whole; those behind them are stripped ([`Engine::strip`]).
const KEEP_AHEAD: usize = 16;

struct Job {
    /// Unique in the run (a job's id is reused once it finishes; this is not).
    serial: u64,
    req: u32,
    tokens: Vec<u32>,
    /// The seed-free block chain of `tokens` (hashed once; every cache names it its own way).
    chain: Vec<u64>,
    /// Tokens and chain dropped while it waits deep in a queue.
    stripped: bool,
    worker: u32,
    claimed: i64,
    edge_region: u16,
    origin: u16,
    one_way_ms: f64,
    at_worker_ms: f64,
    estimate_ms: f64,
    start_ms: f64,
    vram_hit: u64,
    dram_hit: u64,
    ttft_ms: f64,
    dispatched_ms: f64,
    remaining: u64,
    context: u64,
    migration_tier: u8,
    back_ms: f64,
    left: u64,
    extra_ms: f64,
    salt: u32,
    input_length: u64,
    output_length: u64,
    arrival_ms: f64,
    /// The KV it holds in its worker's pool ([`Engine::kv_hold`]): the worker (`NO_WORKER`:
    /// none) and its handle there.
    kv_at: u32,
    kv_handle: u32,
    /// The pool held it back at least once.
    kv_waited: bool,
    /// Disaggregated: its KV's way to its decode instance (wire and transfer), drawn when its
    /// prefill ends and taken once the instance has room for it ([`Engine::admit_handed`]).
    hand_ms: f64,
    /// The room its decode instance set aside for it while its KV travels
    /// ([`Engine::handed_over`] makes it the job's once the prefill instance lets go).
    hand_handle: u32,
}

/// [`Job::kv_at`] of a job that holds no KV.
const NO_WORKER: u32 = u32::MAX;

impl Job {
    /// A job that has not reached its worker yet.
    #[allow(clippy::too_many_arguments)]
    fn fresh(req: u32, tokens: Vec<u32>, chain: Vec<u64>, worker: u32, (edge_region, origin): (u16, u16), salt: u32, (input_length, output_length): (u64, u64), arrival_ms: f64) -> Self {
        Job {
            serial: 0,
            req,
            tokens,
            chain,
            stripped: false,
            worker,
            claimed: 0,
            edge_region,
            origin,
            one_way_ms: 0.0,
            at_worker_ms: 0.0,
            estimate_ms: 0.0,
            start_ms: 0.0,
            vram_hit: 0,
            dram_hit: 0,
            ttft_ms: 0.0,
            dispatched_ms: 0.0,
            remaining: 0,
            context: 0,
            migration_tier: 0,
            back_ms: -1.0,
            left: 0,
            extra_ms: 0.0,
            salt,
            input_length,
            output_length,
            arrival_ms,
            kv_at: NO_WORKER,
            kv_handle: 0,
            kv_waited: false,
            hand_ms: 0.0,
            hand_handle: 0,
        }
    }
}

struct Worker {
    region: u16,
    /// The run's cost model at this worker's prefill rate.
    cost: Cost,
    cache: BlockCache,
    publish: bool,
    queue_to_edge: bool,
    waiting: VecDeque<u32>,
    waiting_ms: f64,
    dispatched: Vec<(u16, f64)>,
    /// Requests routed here whose prefill has not ended (on the way, waiting or prefilling):
    /// what a router that counts its own outstanding requests sees.
    pending: u32,
    current: Option<u32>,
    busy_until: f64,
    busy: Vec<(f64, f64)>,
    running: Vec<u32>,
    joining: Vec<u32>,
    /// Sequences whose prefills ended and that wait for room in this decode instance's pool,
    /// in that order ([`Engine::admit_handed`]).
    handed: VecDeque<u32>,
    stepping: bool,
    seg_start: f64,
    seg_batch: u64,
    seg_context: u64,
    seg_linear: f64,
    seg_steps: u64,
    seg_gen: u64,
    seg_mixed: bool,
    seg_cut: bool,
    step_end: f64,
    rest_ms: f64,
    /// The serial of the job whose prefill chunk made the last busy interval (its next chunk
    /// extends that interval).
    busy_job: Option<u64>,
    decoded: u64,
    /// Its VRAM: the KV pool its sequences and its prefix cache share ([`Config::kv_pool`]).
    kv: KvPool,
}

/// Blocks a sequence reserves beyond its prompt's full blocks ([`KvPool::extra_blocks`]): its
/// answer only when `answer` (it decodes where it prefills; a migration's replica has none).
fn kv_extra(j: &Job, block_size: usize, answer: bool) -> u64 {
    KvPool::extra_blocks(j.input_length, j.output_length, u64::from(answer), block_size as u64)
}

/// Blocks a handed-off sequence holds on its decode instance: its prompt's full blocks and
/// what [`kv_extra`] reserves with its answer.
fn handed_blocks(j: &Job, block_size: usize) -> u64 {
    j.input_length / block_size as u64 + kv_extra(j, block_size, true)
}

/// `max(0.0, x)` as Python evaluates it.
#[inline]
fn pos(x: f64) -> f64 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

/// The per-request records, as columns indexed by request (completion order in `order`).
#[derive(Default)]
pub struct Records {
    pub order: Vec<u32>,
    pub worker: Vec<u32>,
    pub ttft_ms: Vec<f64>,
    pub e2e_ms: Vec<f64>,
    pub queue_ms: Vec<f64>,
    pub vram_hit: Vec<u64>,
    pub dram_hit: Vec<u64>,
    pub claimed: Vec<i64>,
}

pub struct Engine {
    cfg: Config,
    policy: Policy,
    scratch: Vec<f64>,
    cand: Vec<u32>,
    block_size: usize,
    regions: usize,
    workers: Vec<Worker>,
    /// The workload, shared with the caches that publish events (they find a stored prompt's
    /// tokens here again instead of keeping them).
    prompts: Arc<Prompts>,
    jobs: Vec<Job>,
    /// Ids of finished jobs, reused by the next ones ([`Engine::new_job`]).
    free_jobs: Vec<u32>,
    job_serial: u64,
    heap: BinaryHeap<Entry>,
    /// Entries of `heap` that are not arrivals: none, and nothing for the driver in `out`, is a
    /// fleet with nothing in flight ([`Engine::quiet_until`]).
    busy_entries: u64,
    seq: u64,
    ctx: Option<(u64, u32)>,
    /// The queue vectors of responses on their way (`Ev::Response`), and the free slots.
    in_flight_vectors: Vec<Vec<f64>>,
    free_vectors: Vec<u32>,
    cur: (f64, u64, u32),
    now: f64,
    rng: Pcg64,
    faults: Pcg64,
    out: Vec<Out>,
    /// The arrival being routed: its request, its tokens once someone asked for them
    /// ([`Engine::pending_tokens`]), its chain.
    pending: Option<(u32, Option<Vec<u32>>, Vec<u64>)>,
    chain_memo: ChainMemo,
    /// Per-block terms of content-keyed schemes' prefix hashes ([`Prompts::prefix_sum`]).
    sum_memo: ChainMemo,
    salts: Salts,
    pub records: Records,
    done: u64,
    progress_every: u64,
    pub handoffs: u64,
    /// Requests the KV pool held back at least once ([`Config::kv_pool`]): a prefill, or a
    /// handed-off sequence on its decode instance ([`Engine::admit_handed`]).
    pub kv_waits: u64,
    pub events_processed: u64,
    started: bool,
    /// Closed loop: at most this many requests outstanding (0: open loop, every request at
    /// its own arrival time).
    closed: usize,
    /// Closed loop: the next request to issue when one completes.
    next_issue: usize,
    /// When each request reached its edge: the latest of its arrival time (or in a closed
    /// loop the time its client saw the previous request's last token) and, for a follow-up
    /// that waits ([`Self::set_parents`]), when its parent's last token reached the client.
    issued: Vec<f64>,
    /// Follow-ups that wait for their parents: request -> parent (`NO_PARENT`: none).
    parent: Vec<u32>,
    /// Each request's waiting follow-ups, `child[child_offs[i]..child_offs[i + 1]]`.
    child_offs: Vec<u32>,
    child: Vec<u32>,
    /// Conditions a request still waits on before it arrives: issued (its time or its turn in
    /// a closed loop) and, for a waiting follow-up, its parent done.
    gate: Vec<u8>,
    /// A waiting follow-up's place among the arrivals scheduled at start (0: none): released
    /// at its own time, it sorts there, not after every arrival of that instant.
    arrive_seq: Vec<u64>,
}

/// [`Engine::set_parents`]: a request that waits for no one.
pub const NO_PARENT: u32 = u32::MAX;

impl Engine {
    /// Everything [`Self::new`] checks, from what the workers' setups say (their caches'
    /// block sizes and whether each may switch to keeping tokens), so a caller can check before
    /// it hands its caches over: an engine refused after that took the caches with it.
    pub fn check(cfg: &Config, workers: &[WorkerCheck], reqs: &[RequestSpec], ids: &[u64], id_offs: &[usize]) -> Result<()> {
        let regions = cfg.has_edge.len();
        let bad = |m: String| Err(CoreError::InvalidArgument(m));
        if cfg.rtt.len() != regions * regions
            || cfg.region_workers.len() != regions
            || cfg.decoders.len() != regions
        {
            return bad(format!("topology arrays do not agree on {regions} regions"));
        }
        if id_offs.len() != reqs.len() + 1
            || id_offs.last().copied() != Some(ids.len())
            || id_offs.windows(2).any(|w| w[0] > w[1])
        {
            return bad("block id offsets do not cover the requests".into());
        }
        for (i, r) in reqs.iter().enumerate() {
            if r.region as usize >= regions || r.edge_region as usize >= regions {
                return bad(format!("request {i}: region out of range"));
            }
            // A prompt's tokens are built in one array: at most MAX_ELEMENTS of them.
            if r.input_length > MAX_ELEMENTS {
                return bad(format!("request {i}: input_length {} is more than {MAX_ELEMENTS} tokens", r.input_length));
            }
            let slice = &ids[id_offs[i]..id_offs[i + 1]];
            let n = if r.runs {
                if slice.len() % 2 != 0 {
                    return bad(format!("request {i}: block runs come in (chain, count) pairs"));
                }
                // Checked: a sum that wrapped could pass the cover check below.
                match slice.chunks_exact(2).try_fold(0u64, |s, p| s.checked_add(p[1])) {
                    Some(n) => n,
                    None => return bad(format!("request {i}: its block runs' counts overflow 64 bits")),
                }
            } else {
                slice.len() as u64
            };
            if r.block_size == 0 || n != r.input_length.div_ceil(r.block_size as u64) {
                return bad(format!(
                    "request {i}: {n} block ids cannot cover input_length {} at block_size {}",
                    r.input_length, r.block_size
                ));
            }
            if i > 0 && !(reqs[i - 1].arrival_ms <= r.arrival_ms) {
                return bad(format!("request {i}: arrivals are not in order"));
            }
        }
        for w in workers {
            if w.region as usize >= regions {
                return bad("worker region out of range".into());
            }
            if !(w.beta.is_finite() && w.beta > 0.0) {
                return bad(format!("a worker's prefill rate must be a positive number of ms per token, got {}", w.beta));
            }
        }
        let n = workers.len() as u32;
        if cfg
            .region_workers
            .iter()
            .chain(&cfg.decoders)
            .flatten()
            .any(|&w| w >= n)
        {
            return bad("worker index out of range".into());
        }
        if cfg.segment_steps == 0 || cfg.max_batched_tokens == 0 || !(cfg.transfer_gbps > 0.0) {
            return bad(
                "segment_steps, max_batched_tokens and transfer_gbps must be positive".into(),
            );
        }
        let block_size = workers.first().map_or(1, |w| w.block_size);
        if workers.iter().any(|w| w.block_size != block_size) {
            return bad("every worker's cache must have the same block size".into());
        }
        if !workers.iter().all(|w| w.keep_tokens_ok) {
            return bad("keep_tokens can change only while the cache is empty".into());
        }
        Ok(())
    }

    /// `ids` holds every request's block ids back to back, `id_offs[i]..id_offs[i+1]` for
    /// request `i`; requests in arrival order. Checks everything ([`Self::check`]) before it
    /// changes any worker's cache.
    pub fn new(
        cfg: Config,
        workers: Vec<WorkerSetup>,
        reqs: Vec<RequestSpec>,
        ids: Vec<u64>,
        id_offs: Vec<usize>,
        rng: Pcg64,
        faults: Pcg64,
        progress_every: u64,
    ) -> Result<Self> {
        let checks: Vec<WorkerCheck> = workers.iter().map(WorkerSetup::check).collect();
        Self::check(&cfg, &checks, &reqs, &ids, &id_offs)?;
        let regions = cfg.has_edge.len();
        let block_size = workers.first().map_or(1, |w| w.cache.block_size());
        let mut workers = workers;
        let prompts = Arc::new(Prompts { reqs, ids, id_offs });
        for w in &mut workers {
            w.cache.set_keep_tokens(w.publish)?;
            if w.publish {
                w.cache.set_token_source(Some(prompts.clone()));
            }
        }
        let workers = workers
            .into_iter()
            .map(|s| {
                let kv = KvPool::new(s.cache.capacity(VRAM) as u64);
                Worker {
                region: s.region,
                cost: Cost { prefill_ms_per_token: s.beta, ..cfg.cost },
                cache: s.cache,
                publish: s.publish,
                queue_to_edge: s.queue_to_edge,
                waiting: VecDeque::new(),
                waiting_ms: 0.0,
                dispatched: Vec::new(),
                pending: 0,
                current: None,
                busy_until: 0.0,
                busy: Vec::new(),
                running: Vec::new(),
                joining: Vec::new(),
                handed: VecDeque::new(),
                stepping: false,
                seg_start: 0.0,
                seg_batch: 0,
                seg_context: 0,
                seg_linear: 0.0,
                seg_steps: 0,
                seg_gen: 0,
                seg_mixed: false,
                seg_cut: false,
                step_end: 0.0,
                rest_ms: 0.0,
                busy_job: None,
                decoded: 0,
                kv,
                }
            })
            .collect();
        let n_req = prompts.reqs.len();
        Ok(Engine {
            cfg,
            policy: Policy::Driver,
            scratch: Vec::new(),
            cand: Vec::new(),
            block_size,
            regions,
            workers,
            prompts,
            jobs: Vec::new(),
            free_jobs: Vec::new(),
            job_serial: 0,
            heap: BinaryHeap::new(),
            busy_entries: 0,
            seq: 0,
            ctx: None,
            in_flight_vectors: Vec::new(),
            free_vectors: Vec::new(),
            cur: (0.0, 0, 0),
            now: 0.0,
            rng,
            faults,
            out: Vec::new(),
            pending: None,
            chain_memo: ChainMemo::default(),
            sum_memo: ChainMemo::default(),
            salts: Salts::default(),
            records: Records {
                order: Vec::with_capacity(n_req),
                worker: vec![u32::MAX; n_req],
                ttft_ms: vec![0.0; n_req],
                e2e_ms: vec![0.0; n_req],
                queue_ms: vec![0.0; n_req],
                vram_hit: vec![0; n_req],
                dram_hit: vec![0; n_req],
                claimed: vec![0; n_req],
            },
            done: 0,
            progress_every: progress_every.max(1),
            handoffs: 0,
            kv_waits: 0,
            events_processed: 0,
            started: false,
            closed: 0,
            next_issue: 0,
            issued: Vec::new(),
            parent: Vec::new(),
            child_offs: Vec::new(),
            child: Vec::new(),
            gate: Vec::new(),
            arrive_seq: Vec::new(),
        })
    }

    /// Follow-ups wait for their parents (before [`Self::start`]): request `i` (in arrival
    /// order) reaches its edge no earlier than when the last token of request `parents[i]`
    /// reached that request's client ([`NO_PARENT`]: it waits for no one). A follow-up's
    /// prompt holds its parent's answer, so no client can send it before that answer exists;
    /// open loop, it arrives at the later of its own time and that moment. A parent must come
    /// earlier in arrival order (so every wait ends).
    pub fn set_parents(&mut self, parents: &[u32]) -> Result<()> {
        if self.started {
            return Err(CoreError::InvalidArgument("set_parents must come before start".into()));
        }
        let n = self.prompts.reqs.len();
        if parents.len() != n {
            return Err(CoreError::InvalidArgument(format!("set_parents: {} parents for {n} requests", parents.len())));
        }
        let mut counts = vec![0u32; n + 1];
        for (i, &p) in parents.iter().enumerate() {
            if p != NO_PARENT {
                if p as usize >= i {
                    return Err(CoreError::InvalidArgument(format!("set_parents: request {i}'s parent {p} does not come before it")));
                }
                counts[p as usize + 1] += 1;
            }
        }
        for i in 0..n {
            counts[i + 1] += counts[i];
        }
        let mut child = vec![0u32; counts[n] as usize];
        let mut fill = counts.clone();
        for (i, &p) in parents.iter().enumerate() {
            if p != NO_PARENT {
                child[fill[p as usize] as usize] = i as u32;
                fill[p as usize] += 1;
            }
        }
        self.parent = parents.to_vec();
        self.child_offs = counts;
        self.child = child;
        Ok(())
    }

    /// One of request `req`'s conditions is met at `t`: it arrives at the latest such time
    /// once none is left.
    fn release(&mut self, req: usize, t: f64) {
        if t > self.issued[req] {
            self.issued[req] = t;
        }
        self.gate[req] -= 1;
        if self.gate[req] == 0 {
            let at = self.issued[req];
            let seq = self.arrive_seq.get(req).copied().unwrap_or(0);
            if seq != 0 && at == self.prompts.reqs[req].arrival_ms {
                // Its parent answered before its own time: it arrives where it would have
                // without waiting (found in review: pushed now, it sorted after every arrival
                // of its instant, so ties lost their trace order).
                self.heap.push(Entry { t: at, seq, sub: 0, ev: Ev::Arrive(req as u32) });
            } else {
                self.push(at, Ev::Arrive(req as u32));
            }
        }
    }

    /// Run closed loop (before [`Self::start`]): `outstanding` requests in flight at any time;
    /// the first `outstanding` arrive at their own times, and each completion issues the next
    /// request in order at its edge when the client has the last token (no think time), so
    /// throughput is what the fleet sustains under the scheme, not the offered rate.
    pub fn set_closed_loop(&mut self, outstanding: usize) -> Result<()> {
        if self.started {
            return Err(CoreError::InvalidArgument("set_closed_loop must come before start".into()));
        }
        if outstanding == 0 {
            return Err(CoreError::InvalidArgument("a closed loop needs at least one outstanding request".into()));
        }
        self.closed = outstanding;
        Ok(())
    }

    /// When each request reached its edge (see [`Self::set_closed_loop`]).
    pub fn issued(&self) -> &[f64] {
        &self.issued
    }

    /// Route arrivals with `policy` (before [`Self::start`]).
    pub fn set_policy(&mut self, policy: Policy) -> Result<()> {
        let n = self.workers.len() as u32;
        let pools_ok = |pools: &Vec<Vec<u32>>| pools.len() == self.regions && !pools.iter().flatten().any(|&w| w >= n);
        match &policy {
            Policy::Baseline(Baseline::PlanetServe { pools, .. }) if !pools_ok(pools) => return Err(CoreError::InvalidArgument("planetserve pools do not match the topology".into())),
            Policy::Baseline(Baseline::SkyWalker { pools, region_of, .. }) if !pools_ok(pools) || region_of.len() != n as usize => return Err(CoreError::InvalidArgument("skywalker pools do not match the topology".into())),
            Policy::Baseline(Baseline::ConsistentHash { rings, .. }) if rings.iter().flat_map(|r| &r.1).any(|&w| w >= n) => return Err(CoreError::InvalidArgument("a ring owner is not a worker".into())),
            Policy::Baseline(Baseline::Chord { nodes, regions, .. }) if nodes.iter().any(|&w| w >= n) || regions.iter().any(|&r| r as usize >= self.regions) => return Err(CoreError::InvalidArgument("a chord node is not a worker".into())),
            // The lookup reads the entry of the origin's region: one per region, none past the nodes.
            Policy::Baseline(Baseline::Chord { ids, entry, .. }) if entry.len() != self.regions || entry.iter().flatten().any(|&e| e as usize >= ids.len()) => {
                return Err(CoreError::InvalidArgument(format!("chord: {} entry nodes for {} regions (one per region, each a node or None)", entry.len(), self.regions)))
            }
            Policy::Baseline(Baseline::CentralDirectory(c)) if c.workers.iter().any(|&w| w >= n) || c.coordinator as usize >= self.regions => return Err(CoreError::InvalidArgument("central directory workers do not match the topology".into())),
            _ => {}
        }
        if self.salts.h64.is_empty() {
            let salts = self.prompts.reqs.iter().map(|r| r.salt).max().unwrap_or(0) as usize;
            if salts > 0 && matches!(policy, Policy::Baseline(_)) {
                return Err(CoreError::InvalidArgument("set the salts' keys before a content-keyed baseline".into()));
            }
            self.salts = Salts { h64: vec![0], repr: vec!["None".into()] };
        }
        if self.prompts.reqs.iter().any(|r| r.salt as usize >= self.salts.h64.len()) {
            return Err(CoreError::InvalidArgument("a request's salt has no key".into()));
        }
        if let Policy::LeastLoaded { pools, per_region } = &policy {
            if pools.iter().flatten().any(|&w| w >= n) || (*per_region && pools.len() != self.regions) || (!*per_region && pools.len() != 1) {
                return Err(CoreError::InvalidArgument("least-loaded pools do not match the topology".into()));
            }
            if let Some(i) = self.prompts.reqs.iter().position(|r| pools[if *per_region { r.region as usize } else { 0 }].is_empty()) {
                return Err(CoreError::InvalidArgument(format!("request {i} (in arrival order) has no worker to go to")));
            }
        }
        if let Policy::Oblivious { pool, .. } = &policy {
            if pool.is_empty() || pool.iter().any(|&w| w >= n) {
                return Err(CoreError::InvalidArgument("an oblivious policy needs a non-empty pool of the topology's workers".into()));
            }
        }
        // These read the caches' events natively, by block hash: their workers' events need no
        // tokens, so no prompt is expanded for them (caches handed in warm keep theirs).
        if matches!(policy, Policy::Baseline(Baseline::Dynamo(_) | Baseline::CentralDirectory(_))) {
            for x in self.workers.iter_mut().filter(|x| x.publish && x.cache.is_empty()) {
                x.cache.set_token_free_events(true)?;
            }
        }
        self.policy = policy;
        Ok(())
    }

    /// The salts' keys for content-keyed baselines (`_h64("salt", s)` and `repr(s)` per salt number).
    pub fn set_salts(&mut self, salts: Salts) {
        self.salts = salts;
    }

    /// A native policy's choice for the pending request (None: the driver decides).
    fn choose_native(&mut self) -> Result<Option<Choice>> {
        let mut policy = std::mem::take(&mut self.policy);
        let out = match &mut policy {
            Policy::Driver => Ok(None),
            Policy::LeastLoaded { pools, per_region } => {
                let (req, _, _) = self.pending.as_ref().expect("an arrival is pending");
                let r = self.prompts.reqs[*req as usize];
                let (pool, origin) = if *per_region { (&pools[r.region as usize], Some(r.region)) } else { (&pools[0], None) };
                Ok(Some(Choice { worker: self.least_loaded(pool, origin), claimed: 0, delay_ms: 0.0 }))
            }
            Policy::Oblivious { pool, round_robin, next } => {
                let i = if *round_robin {
                    let i = *next;
                    *next = (i + 1) % pool.len();
                    i
                } else {
                    self.rng.integers(pool.len() as u64) as usize
                };
                Ok(Some(Choice { worker: pool[i], claimed: 0, delay_ms: 0.0 }))
            }
            Policy::Baseline(b) => {
                let (req, tokens, chain) = self.pending.take().expect("an arrival is pending");
                let c = self.choose_baseline(b, req, &chain);
                self.pending = Some((req, tokens, chain));
                c.map(Some)
            }
        };
        self.policy = policy;
        out
    }

    /// The installed Dynamo router's exact view of worker `w`: blocks of the seed-free chain
    /// `chain` it knows the worker holds, from the root.
    pub fn dynamo_exact_blocks(&self, w: u32, chain: &[u64]) -> Result<usize> {
        match &self.policy {
            Policy::Baseline(Baseline::Dynamo(s)) => s.exact_blocks(w, chain),
            _ => Err(CoreError::InvalidArgument("dynamo_exact_blocks needs a dynamo policy".into())),
        }
    }

    /// The installed Chord's lookup of `key` from region `origin`: `(owner worker, hops, delay_ms)`.
    pub fn chord_lookup(&self, origin: u16, key: u64) -> Result<(u32, u32, f64)> {
        match &self.policy {
            Policy::Baseline(b @ Baseline::Chord { nodes, .. }) if (origin as usize) < self.regions => {
                let (owner, hops, delay) = self.chord_route(b, origin, key);
                Ok((nodes[owner], hops, delay))
            }
            _ => Err(CoreError::InvalidArgument("chord_lookup needs the chord policy and a known region".into())),
        }
    }

    // ---- the clock ---------------------------------------------------------------------------

    pub fn now(&self) -> f64 {
        self.now
    }

    fn push(&mut self, t: f64, ev: Ev) {
        let (seq, sub) = match &mut self.ctx {
            Some((s, sub)) => {
                *sub += 1;
                (*s, *sub)
            }
            None => {
                self.seq += 1;
                (self.seq, 0)
            }
        };
        if !matches!(ev, Ev::Arrive(_)) {
            self.busy_entries += 1;
        }
        self.heap.push(Entry { t, seq, sub, ev });
    }

    /// When the fleet is quiet (nothing in flight: no prefill, decode, hand-off, response or
    /// driver callback pending, nothing for the driver to take), the time of the next arrival
    /// (infinity when none is left); `None` otherwise. A driver with periodic work of its own
    /// (the simulator's tick) may then skip ahead instead of ticking through idle hours.
    pub fn quiet_until(&self) -> Option<f64> {
        if self.busy_entries != 0 || !self.out.is_empty() {
            return None;
        }
        Some(self.heap.peek().map_or(f64::INFINITY, |e| e.t))
    }

    /// A sequence number for something the driver is told now (what it schedules in reply
    /// sorts here).
    fn reserve(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// What the driver schedules while it handles an [`Out`] carrying `seq` sorts at `seq`
    /// (in the order scheduled); `None` after.
    pub fn set_context(&mut self, seq: Option<u64>) {
        self.ctx = seq.map(|s| (s, 0));
    }

    /// The `(seq, sub)` an event scheduled now would get, taken without scheduling one: the
    /// driver files something it delivers lazily (queue-vector broadcasts) under it, and
    /// applies it before anything that sorts after it reads the same state ([`Self::current`]).
    pub fn reserve_key(&mut self) -> (u64, u32) {
        match &mut self.ctx {
            Some((s, sub)) => {
                *sub += 1;
                (*s, *sub)
            }
            None => {
                self.seq += 1;
                (self.seq, 0)
            }
        }
    }

    /// `(t, seq, sub)` of the event being processed.
    pub fn current(&self) -> (f64, u64, u32) {
        self.cur
    }

    /// Schedule driver event `handle` at `t` (ms).
    pub fn at_external(&mut self, t: f64, handle: u64) -> Result<()> {
        if !t.is_finite() {
            return Err(CoreError::InvalidArgument(format!(
                "event time must be finite, got {t}"
            )));
        }
        self.push(t, Ev::External(handle));
        Ok(())
    }

    /// Schedule every arrival (before anything else, so equal times keep arrival order).
    pub fn start(&mut self) {
        if self.started {
            return;
        }
        self.started = true;
        let total = self.prompts.reqs.len();
        self.issued = vec![f64::NEG_INFINITY; total];
        self.gate = if self.parent.is_empty() { vec![1; total] } else { self.parent.iter().map(|&p| 1 + u8::from(p != NO_PARENT)).collect() };
        let n = if self.closed > 0 { self.closed.min(total) } else { total };
        if !self.parent.is_empty() {
            self.arrive_seq = vec![0; total];
        }
        for i in 0..n {
            let t = self.prompts.reqs[i].arrival_ms;
            if self.gate[i] > 1 {
                self.seq += 1;
                self.arrive_seq[i] = self.seq;
            }
            self.release(i, t);
        }
        self.next_issue = n;
    }

    /// The engine's own events up to the next thing the driver must do; `None` at the end.
    pub fn next(&mut self) -> Result<Option<Step>> {
        loop {
            if !self.out.is_empty() {
                return Ok(Some(Step::Out));
            }
            let Some(e) = self.heap.pop() else {
                if !self.parent.is_empty() && self.gate.iter().any(|&g| g != 0) {
                    return Err(CoreError::InvalidArgument("the run ended with follow-ups still waiting for their parents".into()));
                }
                return Ok(None);
            };
            self.now = e.t;
            self.cur = (e.t, e.seq, e.sub);
            self.events_processed += 1;
            if !matches!(e.ev, Ev::Arrive(_)) {
                self.busy_entries -= 1;
            }
            match e.ev {
                Ev::Arrive(req) => {
                    let chain = self.prompts.chain(req, self.block_size, &mut self.chain_memo);
                    self.pending = Some((req, None, chain));
                    match self.choose_native()? {
                        Some(c) => self.arrive(req, c)?,
                        None => return Ok(Some(Step::Arrive { req })),
                    }
                }
                Ev::Land(job) => {
                    let j = &self.jobs[job as usize];
                    let w = j.worker;
                    let region = self.workers[w as usize].region;
                    if !self.cfg.handoff || region == j.edge_region {
                        self.enqueue(w, job)?;
                    } else {
                        return Ok(Some(Step::Land {
                            job,
                            req: j.req,
                            worker: w,
                            region,
                        }));
                    }
                }
                Ev::Enqueue { w, job } => self.enqueue(w, job)?,
                Ev::EndPrefill { w, job } => self.end_prefill(w, job)?,
                Ev::EndSegment { w, gen } => self.end_segment(w, gen)?,
                Ev::EndMixed { w, job, chunk } => self.end_mixed(w, job, chunk)?,
                Ev::Join { w, job } => self.handed_over(w, job)?,
                Ev::Response { worker, edge_region, claimed, reused, vector } => {
                    let vector = (vector != NO_VECTOR).then(|| {
                        self.free_vectors.push(vector);
                        std::mem::take(&mut self.in_flight_vectors[vector as usize]).into_boxed_slice()
                    });
                    self.out.push(Out::Response { worker, edge_region, claimed, reused, vector });
                }
                Ev::External(h) => return Ok(Some(Step::External(h))),
            }
        }
    }

    pub fn take_out(&mut self) -> Vec<Out> {
        std::mem::take(&mut self.out)
    }

    /// The tokens of the request [`Step::Arrive`] named.
    /// Expanded on the first call (a scheme that routes by chain never needs them).
    pub fn pending_tokens(&mut self) -> Option<&[u32]> {
        let prompts = &self.prompts;
        self.pending.as_mut().map(|(req, t, _)| t.get_or_insert_with(|| prompts.tokens(*req)).as_slice())
    }

    /// Bytes held by the chain memo ([`Prompts::chain`]).
    pub fn chain_memo_bytes(&self) -> usize {
        self.chain_memo.bytes() + self.sum_memo.bytes()
    }

    pub fn job_tokens(&self, job: u32) -> Option<&[u32]> {
        self.jobs.get(job as usize).map(|j| j.tokens.as_slice())
    }

    // ---- what schemes and the driver read ------------------------------------------------------

    pub fn regions(&self) -> usize {
        self.regions
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn workers(&self) -> usize {
        self.workers.len()
    }
    pub fn requests(&self) -> usize {
        self.prompts.reqs.len()
    }
    pub fn completed(&self) -> u64 {
        self.done
    }

    fn worker(&self, w: u32) -> Result<&Worker> {
        self.workers
            .get(w as usize)
            .ok_or_else(|| CoreError::InvalidArgument(format!("unknown worker index {w}")))
    }

    /// The worker's exact queued prefill work (ms) at `now`, the running prefill's remainder included.
    pub fn queued_ms(&self, w: u32, now: f64) -> Result<f64> {
        let x = self.worker(w)?;
        Ok(self.queued(x, now))
    }

    fn queued(&self, x: &Worker, now: f64) -> f64 {
        if x.current.is_none() {
            x.waiting_ms
        } else if self.cfg.chunked {
            x.waiting_ms + pos(x.step_end - now) + x.rest_ms
        } else {
            x.waiting_ms + pos(x.busy_until - now)
        }
    }

    /// Estimated prefill (ms) on its way to the worker, for requests from `origin` (all: None).
    pub fn dispatched_ms(&self, w: u32, origin: Option<u16>) -> Result<f64> {
        let x = self.worker(w)?;
        Ok(match origin {
            None => origin_total(&x.dispatched),
            Some(o) => x
                .dispatched
                .iter()
                .find(|(r, _)| *r == o)
                .map_or(0.0, |(_, v)| *v),
        })
    }

    /// Requests waiting at the worker for prefill (the running one excluded).
    pub fn waiting(&self, w: u32) -> Result<usize> {
        Ok(self.worker(w)?.waiting.len())
    }

    /// Requests routed to the worker whose prefill has not ended (on their way, waiting or
    /// prefilling).
    pub fn pending(&self, w: u32) -> Result<u32> {
        Ok(self.worker(w)?.pending)
    }

    /// `(vram, dram)` hit tokens of the worker's cache for `tokens`.
    pub fn cached(&self, w: u32, tokens: &[u32], salt_seed: u64) -> Result<(u64, u64)> {
        let x = self.worker(w)?;
        lookup(&x.cache, tokens, salt_seed)
    }

    /// Move every worker's cache out (for the driver to inspect after a run; one-block
    /// placeholders stay behind); `put_caches` undoes it. A cache that published token-free
    /// events to a native reader goes back refusing to publish any.
    pub fn take_caches(&mut self) -> Vec<BlockCache> {
        self.workers
            .iter_mut()
            .map(|x| {
                x.cache.set_token_free_events(false).expect("turning token-free events off always succeeds");
                std::mem::replace(
                    &mut x.cache,
                    BlockCache::new(1, 1, 0, false, 0).expect("a one-block cache"),
                )
            })
            .collect()
    }

    pub fn put_caches(&mut self, caches: Vec<BlockCache>) {
        for (x, c) in self.workers.iter_mut().zip(caches) {
            x.cache = c;
        }
    }

    pub fn cache(&self, w: u32) -> Result<&BlockCache> {
        Ok(&self.worker(w)?.cache)
    }

    pub fn busy(&self, w: u32) -> Result<&[(f64, f64)]> {
        Ok(&self.worker(w)?.busy)
    }

    pub fn decoded(&self, w: u32) -> Result<u64> {
        Ok(self.worker(w)?.decoded)
    }

    /// Workers running a prefill whose queue their edge reads (the tick re-reads them), with
    /// their queued work now.
    pub fn busy_queues(&self) -> Vec<(u32, f64)> {
        if !self.cfg.indexed {
            return Vec::new();
        }
        self.workers
            .iter()
            .enumerate()
            .filter(|(_, x)| x.current.is_some() && x.queue_to_edge)
            .map(|(i, x)| (i as u32, self.queued(x, self.now)))
            .collect()
    }

    /// [`Self::way`] for a caller's regions: an error (and no draw) unless both are regions of
    /// the topology.
    pub fn checked_way(&mut self, a: u16, b: u16) -> Result<f64> {
        if a as usize >= self.regions || b as usize >= self.regions {
            return Err(CoreError::InvalidArgument(format!("way({a}, {b}): regions are 0..{}", self.regions)));
        }
        Ok(self.way(a, b))
    }

    /// One WAN traversal from region `a` to `b` (ms), jittered when the run asks.
    pub fn way(&mut self, a: u16, b: u16) -> f64 {
        let base = self.cfg.rtt[a as usize * self.regions + b as usize] / 2.0;
        let j = self.cfg.wan_jitter;
        if j != 0.0 {
            base * (1.0 + j * (2.0 * self.faults.random() - 1.0))
        } else {
            base
        }
    }

    /// Moving the KV of `tokens` between workers (ms).
    pub fn transfer_ms(&self, tokens: u64) -> f64 {
        self.cfg.cost.transfer_ms(tokens, self.cfg.transfer_gbps)
    }

    pub fn rng(&mut self) -> &mut Pcg64 {
        &mut self.rng
    }
    pub fn faults(&mut self) -> &mut Pcg64 {
        &mut self.faults
    }

    // ---- the driver's answers ----------------------------------------------------------------

    /// Route the pending arrival to `c`.
    pub fn arrive(&mut self, req: u32, c: Choice) -> Result<()> {
        let (tokens, chain) = match self.pending.take() {
            Some((r, t, c)) if r == req => (t, c),
            _ => {
                return Err(CoreError::InvalidArgument(format!(
                    "request {req} is not the pending arrival"
                )))
            }
        };
        self.worker(c.worker)?;
        // A worker whose cache publishes no events never needs the prompt's tokens again (its
        // chain names the blocks): a waiting job keeps 8 bytes a block, not 4 a token.
        let tokens = if self.workers[c.worker as usize].cache.keeps_tokens() { tokens.unwrap_or_else(|| self.prompts.tokens(req)) } else { Vec::new() };
        let r = self.prompts.reqs[req as usize];
        let wr = self.workers[c.worker as usize].region;
        let forward = self.way(r.edge_region, wr);
        let back = self.way(wr, r.edge_region);
        let mut j = Job::fresh(req, tokens, chain, c.worker, (r.edge_region, r.region), r.salt, (r.input_length, r.output_length), self.issued[req as usize]);
        j.claimed = c.claimed;
        j.one_way_ms = back;
        let job = self.new_job(j);
        let est = self.estimate_now(c.worker, job)?;
        self.jobs[job as usize].dispatched_ms = est;
        add_dispatched(&mut self.workers[c.worker as usize], r.region, est);
        self.workers[c.worker as usize].pending += 1;
        let t = self.now + c.delay_ms + forward;
        self.push(t, Ev::Land(job));
        Ok(())
    }

    /// The scheme's answer to [`Step::Land`]: `None` keeps the job where it was sent.
    pub fn land(&mut self, job: u32, c: Option<Choice>) -> Result<()> {
        let w = self
            .jobs
            .get(job as usize)
            .ok_or_else(|| CoreError::InvalidArgument(format!("unknown job {job}")))?
            .worker;
        let Some(c) = c else {
            return self.enqueue(w, job);
        };
        self.jobs[job as usize].claimed = c.claimed;
        if c.worker == w {
            return self.enqueue(w, job);
        }
        let region = self.workers[w as usize].region;
        if self.worker(c.worker)?.region != region {
            return Err(CoreError::InvalidArgument(format!(
                "hand-off of job {job} to worker {} outside region {region}",
                c.worker
            )));
        }
        let (origin, dispatched) = (
            self.jobs[job as usize].origin,
            self.jobs[job as usize].dispatched_ms,
        );
        if dispatched != 0.0 {
            sub_dispatched(&mut self.workers[w as usize], origin, dispatched);
        }
        let est = self.estimate_now(c.worker, job)?;
        self.jobs[job as usize].dispatched_ms = est;
        add_dispatched(&mut self.workers[c.worker as usize], origin, est);
        self.workers[w as usize].pending = self.workers[w as usize].pending.saturating_sub(1);
        self.workers[c.worker as usize].pending += 1;
        self.jobs[job as usize].worker = c.worker;
        self.handoffs += 1;
        let t = self.now + self.way(region, region);
        self.push(t, Ev::Enqueue { w: c.worker, job });
        Ok(())
    }

    /// A migration's copy lands: the blocks of `tokens` into `tier` of worker `w`'s cache.
    pub fn copy_in(
        &mut self,
        w: u32,
        tokens: &[u32],
        tier: u8,
        salt: u32,
        salt_seed: u64,
    ) -> Result<Vec<Event>> {
        self.worker(w)?;
        let now = self.now / 1e3;
        let x = &mut self.workers[w as usize];
        copy_into(&mut x.cache, tokens, tier, now, salt, salt_seed, x.publish)
    }

    /// A recompute migration: the prompt joins worker `w`'s FIFO at `t`, its replica to `tier`.
    #[allow(clippy::too_many_arguments)]
    pub fn migrate_recompute(
        &mut self,
        t: f64,
        w: u32,
        tokens: Vec<u32>,
        tier: u8,
        region: u16,
        salt: u32,
        salt_seed: u64,
    ) -> Result<()> {
        self.worker(w)?;
        if tier != VRAM && tier != DRAM {
            return Err(CoreError::InvalidTier(tier));
        }
        let n = tokens.len() as u64;
        let chain = block_chain(salt_seed, &tokens, self.block_size)?;
        let mut j = Job::fresh(NO_REQ, tokens, chain, w, (region, region), salt, (n, 0), self.now);
        j.migration_tier = tier;
        let job = self.new_job(j);
        self.push(t, Ev::Enqueue { w, job });
        Ok(())
    }

    // ---- a request's life --------------------------------------------------------------------

    fn prefill_ms(&self, w: u32, length: u64, v: u64, d: u64) -> f64 {
        self.workers[w as usize].cost.prefill_with_reuse_ms(length, v, d)
    }

    /// The worker's estimate of the job's prefill from a lookup of its cache now.
    fn estimate_now(&self, w: u32, job: u32) -> Result<f64> {
        let x = &self.workers[w as usize];
        let j = &self.jobs[job as usize];
        let (v, d) = prompt_hit(&x.cache, &j.chain, j.input_length);
        Ok(self.estimate(x, j.input_length, v, d))
    }

    fn estimate(&self, x: &Worker, length: u64, v: u64, d: u64) -> f64 {
        let (batch, context) = if self.cfg.chunked {
            let context: u64 = x.running.iter().chain(&x.joining).map(|&j| self.jobs[j as usize].context).sum();
            ((x.running.len() + x.joining.len()) as u64, context)
        } else {
            (0, 0)
        };
        x.cost.estimate_ms(length, v, d, batch, context, self.cfg.max_batched_tokens, self.cfg.chunked)
    }

    fn enqueue(&mut self, w: u32, job: u32) -> Result<()> {
        let now = self.now;
        let (origin, dispatched) = {
            let j = &mut self.jobs[job as usize];
            j.at_worker_ms = now;
            (j.origin, j.dispatched_ms)
        };
        if dispatched != 0.0 {
            sub_dispatched(&mut self.workers[w as usize], origin, dispatched);
            if let Policy::Baseline(Baseline::Dynamo(st)) = &mut self.policy {
                st.note_landed(w, origin, dispatched);
            }
        }
        let est = self.estimate_now(w, job)?;
        self.jobs[job as usize].estimate_ms = est;
        let x = &mut self.workers[w as usize];
        x.waiting.push_back(job);
        x.waiting_ms += est;
        if x.waiting.len() > KEEP_AHEAD {
            self.strip(job);
        }
        let x = &self.workers[w as usize];
        if self.cfg.chunked {
            if x.stepping {
                self.poke(w);
            } else {
                self.step(w)?;
            }
        } else if x.current.is_none() {
            if self.kv_fits(w)? {
                self.start_prefill(w)?;
            }
        }
        self.publish_queue(w);
        Ok(())
    }

    fn publish_queue(&mut self, w: u32) {
        if matches!(self.policy, Policy::Baseline(Baseline::CentralDirectory(_))) {
            let (q, now) = (self.queued(&self.workers[w as usize], self.now), self.now);
            if let Policy::Baseline(Baseline::CentralDirectory(c)) = &mut self.policy {
                c.on_queue(w, q, now);
            }
            return;
        }
        let x = &self.workers[w as usize];
        if self.cfg.indexed && x.queue_to_edge {
            let q = self.queued(x, self.now);
            self.out.push(Out::Queue {
                worker: w,
                queued_ms: q,
            });
        }
    }

    fn publish_events(&mut self, w: u32, events: Vec<Event>) {
        if let Policy::Baseline(Baseline::Dynamo(s)) = &mut self.policy {
            s.on_events(w, &events, self.now);
            return;
        }
        if let Policy::Baseline(Baseline::CentralDirectory(c)) = &mut self.policy {
            c.on_events(w, &events, self.now);
            return;
        }
        if !events.is_empty() {
            let seq = self.reserve();
            self.out.push(Out::Events {
                seq,
                worker: w,
                events,
            });
        }
    }

    /// The head of the FIFO leaves it: its hits and start.
    fn pop_waiting(&mut self, w: u32) -> Result<u32> {
        let now = self.now;
        let x = &mut self.workers[w as usize];
        let job = x
            .waiting
            .pop_front()
            .ok_or_else(|| CoreError::InvalidArgument("no waiting job".into()))?;
        let est = self.jobs[job as usize].estimate_ms;
        x.waiting_ms = if x.waiting.is_empty() {
            0.0
        } else {
            pos(x.waiting_ms - est)
        };
        if self.jobs[job as usize].stripped {
            self.restore(job, w)?;
        }
        self.kv_hold(w, job)?;
        let x = &self.workers[w as usize];
        let j = &mut self.jobs[job as usize];
        j.start_ms = now;
        let (v, d) = prompt_hit(&x.cache, &j.chain, j.input_length);
        j.vram_hit = v;
        j.dram_hit = d;
        Ok(job)
    }

    /// A job deep in a queue keeps neither its tokens nor its chain (an overloaded worker's
    /// queue grows with the run, and a 5,000-token prompt's are 22 KB); they are derived again
    /// from the request's block ids when its prefill starts ([`Self::restore`]).
    fn strip(&mut self, job: u32) {
        let j = &mut self.jobs[job as usize];
        if j.req != NO_REQ {
            j.tokens = Vec::new();
            j.chain = Vec::new();
            j.stripped = true;
        }
    }

    fn restore(&mut self, job: u32, w: u32) -> Result<()> {
        let req = self.jobs[job as usize].req;
        let chain = self.prompts.chain(req, self.block_size, &mut self.chain_memo);
        let tokens = if self.workers[w as usize].cache.keeps_tokens() { self.prompts.tokens(req) } else { Vec::new() };
        let j = &mut self.jobs[job as usize];
        j.chain = chain;
        j.tokens = tokens;
        j.stripped = false;
        Ok(())
    }

    fn start_prefill(&mut self, w: u32) -> Result<()> {
        let job = self.pop_waiting(w)?;
        let j = &self.jobs[job as usize];
        let end = self.now + self.prefill_ms(w, j.input_length, j.vram_hit, j.dram_hit);
        let now = self.now;
        let x = &mut self.workers[w as usize];
        x.current = Some(job);
        x.busy_until = end;
        x.busy.push((now, end));
        self.push(end, Ev::EndPrefill { w, job });
        Ok(())
    }

    /// The prompt's KV enters the cache (a migration's replica lands in its tier); true for a
    /// migration, which sends no response.
    fn admit(&mut self, w: u32, job: u32) -> Result<bool> {
        let now = self.now / 1e3;
        // First the room the sequences' reservations take from the cache (see `kv_room`).
        let mut ev = self.kv_room(w)?;
        let x = &mut self.workers[w as usize];
        let j = &self.jobs[job as usize];
        let chain = x.cache.named(&j.chain);
        if j.migration_tier != 0 {
            ev.extend(place(&mut x.cache, &j.tokens, &chain, j.migration_tier, now, j.salt, x.publish)?);
            self.publish_events(w, ev);
            self.kv_release(job)?;
            self.free_job(job); // a replica has landed: nothing refers to its job again
            return Ok(true);
        }
        x.pending = x.pending.saturating_sub(1); // a routed request's prefill ended
        // Its tokens are the request's prompt: the cache keeps a reference, not a copy.
        x.cache.set_call_source(Some(j.req));
        let placed = x.cache.place_vram_len(&j.tokens, j.input_length as usize, &chain, now, j.salt, true, x.publish);
        x.cache.set_call_source(None);
        ev.extend(placed?);
        self.publish_events(w, ev);
        let j = &mut self.jobs[job as usize];
        // Its KV is in the cache now: decoding needs neither the prompt's tokens nor its chain
        // (a long-context decode batch would otherwise hold every prompt it serves).
        j.tokens = Vec::new();
        j.chain = Vec::new();
        j.ttft_ms = self.now + j.one_way_ms - j.arrival_ms;
        if self.cfg.indexed {
            self.respond(w, job);
        }
        Ok(false)
    }

    fn end_prefill(&mut self, w: u32, job: u32) -> Result<()> {
        let migration = self.admit(w, job)?;
        self.workers[w as usize].current = None;
        if !self.workers[w as usize].waiting.is_empty() && self.kv_fits(w)? {
            self.start_prefill(w)?;
        }
        self.publish_queue(w);
        if !migration {
            self.decode(w, job)?;
        }
        Ok(())
    }

    fn respond(&mut self, w: u32, job: u32) {
        let j = &self.jobs[job as usize];
        if !self.cfg.has_edge[j.edge_region as usize] {
            return;
        }
        let region = self.workers[w as usize].region;
        let vector = if region != j.edge_region && !self.cfg.has_edge[region as usize] {
            Some(
                self.cfg.region_workers[region as usize]
                    .iter()
                    .map(|&i| self.queued(&self.workers[i as usize], self.now))
                    .collect(),
            )
        } else {
            None
        };
        let (edge_region, claimed, reused, t) = (
            j.edge_region,
            j.claimed,
            j.vram_hit + j.dram_hit,
            self.now + j.one_way_ms,
        );
        let seq = self.reserve();
        if region != edge_region && vector.is_none() {
            // The worker's own region runs an edge, which piggybacks its queue vector on the
            // response: the driver asks that edge now and schedules the delivery.
            self.out.push(Out::Respond {
                seq,
                worker: w,
                edge_region,
                claimed,
                reused,
                t,
            });
            return;
        }
        // Nothing to ask at this moment: the delivery is the engine's own event, filed where
        // the driver's reply to a `Respond` would sort (the first thing scheduled under `seq`).
        let vector = match vector {
            None => NO_VECTOR,
            Some(v) => match self.free_vectors.pop() {
                Some(i) => {
                    self.in_flight_vectors[i as usize] = v;
                    i
                }
                None => {
                    self.in_flight_vectors.push(v);
                    (self.in_flight_vectors.len() - 1) as u32
                }
            },
        };
        let ctx = self.ctx.replace((seq, 0));
        self.push(
            t,
            Ev::Response {
                worker: w,
                edge_region,
                claimed,
                reused,
                vector,
            },
        );
        self.ctx = ctx;
    }

    fn decode(&mut self, w: u32, job: u32) -> Result<()> {
        let j = &mut self.jobs[job as usize];
        let out = j.output_length;
        if out <= 1 {
            return self.complete(job);
        }
        j.remaining = out - 1;
        j.context = j.input_length + 1;
        let region = self.workers[w as usize].region;
        if self.cfg.decoders[region as usize].is_empty() {
            return self.join(w, job);
        }
        let pool = &self.cfg.decoders[region as usize];
        let d = if pool.len() > 1 {
            pool[self.rng.integers(pool.len() as u64) as usize]
        } else {
            pool[0]
        };
        let dr = self.workers[d as usize].region;
        let wire = if dr == region {
            0.0
        } else {
            self.way(region, dr) // jittered as every WAN traversal is (found in review)
        };
        let edge_region = self.jobs[job as usize].edge_region;
        let back = self.way(dr, edge_region);
        self.jobs[job as usize].back_ms = back;
        let hand_off = wire
            + self
                .cfg
                .cost
                .transfer_ms(self.jobs[job as usize].input_length, self.cfg.transfer_gbps);
        if !self.cfg.kv_pool {
            self.push(self.now + hand_off, Ev::Join { w: d, job });
            return Ok(());
        }
        self.jobs[job as usize].hand_ms = hand_off;
        self.workers[d as usize].handed.push_back(job);
        self.admit_handed(d)?;
        // Admitted in order: a queue left behind still holds this job, which waits for room
        // (whether at its head or behind one that does).
        if !self.workers[d as usize].handed.is_empty() {
            self.kv_waited(job);
        }
        Ok(())
    }

    /// Admit the sequences waiting for decode instance `w`, in order, while each fits. With
    /// [`Config::kv_pool`] a prefill instance hands a sequence off only once its decode
    /// instance has room for its whole context, the prompt's blocks and its answer's
    /// reservation ([`handed_blocks`]), none shared with another (the hand-off moves every
    /// block of its prompt); a sequence larger than the pool runs alone. Until then its KV
    /// stays in the prefill instance's pool, which then admits fewer prompts: a saturated
    /// decode side pushes back on the prefills. Admitted, the decode instance sets its room
    /// aside, and [`Job::hand_ms`] later the KV has arrived: the prefill instance lets go of
    /// its copy and the sequence joins the batch ([`Self::handed_over`]). One that waits
    /// (for room, or behind one that does) is counted once in [`Engine::kv_waits`]
    /// ([`Self::decode`]).
    ///
    /// Why: a decode instance's batch is bounded by its VRAM as a prefill-and-decode worker's
    /// is, and an engine pulls a sequence's KV only into blocks it has allocated (vLLM's
    /// disaggregated prefill keeps the prefill side's blocks until the decode side reads
    /// them), so unbounded instances hid the decode side's saturation.
    fn admit_handed(&mut self, w: u32) -> Result<()> {
        let bs = self.block_size;
        while let Some(&job) = self.workers[w as usize].handed.front() {
            let blocks = handed_blocks(&self.jobs[job as usize], bs);
            let x = &mut self.workers[w as usize];
            if !x.kv.fits(&[], blocks) {
                return Ok(());
            }
            x.handed.pop_front();
            let h = x.kv.hold(Vec::new(), blocks);
            let j = &mut self.jobs[job as usize];
            j.hand_handle = h;
            let t = self.now + j.hand_ms;
            self.push(t, Ev::Join { w, job });
        }
        Ok(())
    }

    /// A handed-off sequence's KV has reached decode instance `w`. With [`Config::kv_pool`]
    /// the prefill instance lets go of its copy only now (it is read until the transfer ends)
    /// and the room `w` set aside becomes the sequence's; then it joins the batch.
    fn handed_over(&mut self, w: u32, job: u32) -> Result<()> {
        if self.cfg.kv_pool {
            self.kv_release(job)?;
            let j = &mut self.jobs[job as usize];
            j.kv_at = w;
            j.kv_handle = j.hand_handle;
        }
        self.join(w, job)
    }

    fn join(&mut self, w: u32, job: u32) -> Result<()> {
        let x = &mut self.workers[w as usize];
        x.joining.push(job);
        if !x.stepping {
            self.step(w)
        } else {
            self.poke(w);
            Ok(())
        }
    }

    fn poke(&mut self, w: u32) {
        let x = &mut self.workers[w as usize];
        if !x.seg_mixed && !x.seg_cut {
            x.seg_cut = true;
            self.cut(w);
        }
    }

    fn step(&mut self, w: u32) -> Result<()> {
        let x = &mut self.workers[w as usize];
        let joining = std::mem::take(&mut x.joining);
        x.running.extend(joining);
        if self.cfg.chunked {
            let idle = x.current.is_none() && !x.waiting.is_empty();
            if idle && self.kv_fits(w)? {
                self.begin_prefill(w)?;
            }
            if let Some(job) = self.workers[w as usize].current {
                self.mixed_step(w, job);
                return Ok(());
            }
        }
        let x = &self.workers[w as usize];
        if x.running.is_empty() {
            self.workers[w as usize].stepping = false;
            return Ok(());
        }
        let batch = x.running.len() as u64;
        let mut context = 0u64;
        let mut least = u64::MAX;
        for &j in &x.running {
            let j = &self.jobs[j as usize];
            context += j.context;
            least = least.min(j.remaining);
        }
        let steps = self.cfg.segment_steps.min(least);
        let linear = self.cfg.cost.linear(batch);
        let now = self.now;
        let x = &mut self.workers[w as usize];
        x.stepping = true;
        x.seg_mixed = false;
        x.seg_cut = false;
        x.seg_start = now;
        x.seg_batch = batch;
        x.seg_context = context;
        x.seg_linear = linear;
        x.seg_steps = steps;
        x.seg_gen += 1;
        let gen = x.seg_gen;
        let t = self.boundary(w, steps);
        self.push(t, Ev::EndSegment { w, gen });
        Ok(())
    }

    /// The end of the segment's `steps`-th step.
    fn boundary(&self, w: u32, steps: u64) -> f64 {
        let x = &self.workers[w as usize];
        let b = self.cfg.cost.decode_ms_per_context_token;
        let mut t = x.seg_start;
        for i in 0..steps {
            t += (x.seg_linear + b * (x.seg_context + i * x.seg_batch) as f64).max(1e-9);
        }
        t
    }

    fn cut(&mut self, w: u32) {
        let b = self.cfg.cost.decode_ms_per_context_token;
        let now = self.now;
        let x = &mut self.workers[w as usize];
        let mut t = x.seg_start;
        for i in 0..x.seg_steps {
            t += (x.seg_linear + b * (x.seg_context + i * x.seg_batch) as f64).max(1e-9);
            if t > now {
                if i + 1 < x.seg_steps {
                    x.seg_steps = i + 1;
                    x.seg_gen += 1;
                    let gen = x.seg_gen;
                    self.push(t, Ev::EndSegment { w, gen });
                }
                return;
            }
        }
    }

    fn begin_prefill(&mut self, w: u32) -> Result<()> {
        let job = self.pop_waiting(w)?;
        let cost = self.workers[w as usize].cost;
        let j = &mut self.jobs[job as usize];
        let length = j.input_length;
        j.left = length - length.min(j.vram_hit + j.dram_hit);
        j.extra_ms = (if j.left != 0 {
            cost.prefill_base_ms
        } else {
            0.0
        }) + cost.reload_ms(j.dram_hit);
        self.workers[w as usize].current = Some(job);
        Ok(())
    }

    fn mixed_step(&mut self, w: u32, job: u32) {
        let cost = self.workers[w as usize].cost;
        let now = self.now;
        let x = &self.workers[w as usize];
        let batch = x.running.len() as u64;
        let room = self.cfg.max_batched_tokens.saturating_sub(batch).max(1);
        let context: u64 = x.running.iter().map(|&j| self.jobs[j as usize].context).sum();
        let j = &mut self.jobs[job as usize];
        let (chunk, compute, decode) = cost.chunk_step(j.left, j.extra_ms, batch, context, self.cfg.max_batched_tokens);
        j.extra_ms = 0.0;
        let rest = j.left - chunk;
        let x = &mut self.workers[w as usize];
        x.rest_ms = cost.prefill_ms_per_token * rest as f64
            + if rest != 0 {
                rest.div_ceil(room) as f64 * decode
            } else {
                0.0
            };
        let serial = j.serial;
        if compute > 0.0 {
            if x.busy_job == Some(serial) {
                if let Some(last) = x.busy.last_mut() {
                    last.1 += compute;
                }
            } else {
                x.busy.push((now, now + compute));
                x.busy_job = Some(serial);
            }
        }
        x.stepping = true;
        x.seg_mixed = true;
        x.seg_batch = batch;
        x.seg_gen += 1;
        x.step_end = now + compute + decode;
        let t = x.step_end;
        self.push(t, Ev::EndMixed { w, job, chunk });
    }

    /// Every running sequence advances `steps` tokens; the finished ones complete.
    fn advance(&mut self, w: u32, steps: u64) -> Result<()> {
        let running = std::mem::take(&mut self.workers[w as usize].running);
        let mut keep = Vec::with_capacity(running.len());
        let mut failed = Ok(());
        for &j in &running {
            let job = &mut self.jobs[j as usize];
            job.remaining -= steps;
            job.context += steps;
            if job.remaining == 0 {
                if let Err(e) = self.complete(j) {
                    failed = Err(e);
                }
            } else {
                keep.push(j);
            }
        }
        self.workers[w as usize].running = keep;
        failed
    }

    fn end_mixed(&mut self, w: u32, job: u32, chunk: u64) -> Result<()> {
        let batch = self.workers[w as usize].seg_batch;
        if batch != 0 {
            self.workers[w as usize].decoded += batch;
            self.advance(w, 1)?;
        }
        let j = &mut self.jobs[job as usize];
        j.left -= chunk;
        if j.left == 0 {
            self.workers[w as usize].current = None;
            if !self.admit(w, job)? {
                self.decode(w, job)?;
            }
        }
        self.step(w)?;
        self.publish_queue(w);
        Ok(())
    }

    fn end_segment(&mut self, w: u32, gen: u64) -> Result<()> {
        let x = &self.workers[w as usize];
        if gen != x.seg_gen {
            return Ok(()); // superseded by a cut
        }
        let steps = x.seg_steps;
        self.workers[w as usize].decoded += x.seg_batch * steps;
        self.advance(w, steps)?;
        self.step(w)
    }

    // ---- the KV pool ---------------------------------------------------------------------------

    /// Whether the head of `w`'s FIFO may start its prefill: with [`Config::kv_pool`], only
    /// when its KV fits in the pool beside what the worker's sequences hold, or when they hold
    /// nothing (a prompt larger than the pool runs alone, as an engine sized for its context
    /// runs it). A head held back is counted once in [`Engine::kv_waits`].
    ///
    /// Why: an engine's running sequences and its prefix cache share one KV pool, so a worker
    /// whose batch fills VRAM holds new prompts back (vLLM's scheduler admits a request only
    /// when its blocks can be allocated) and has less room for cached prefixes.
    fn kv_fits(&mut self, w: u32) -> Result<bool> {
        if !self.cfg.kv_pool {
            return Ok(true);
        }
        let x = &self.workers[w as usize];
        let Some(&job) = x.waiting.front() else {
            return Ok(false);
        };
        let answer = self.cfg.decoders[x.region as usize].is_empty();
        let j = &self.jobs[job as usize];
        let extra = kv_extra(j, self.block_size, answer);
        if x.kv.surely_fits(j.input_length / self.block_size as u64, extra).is_some() {
            return Ok(true);
        }
        if j.stripped {
            self.restore(job, w)?;
        }
        let j = &self.jobs[job as usize];
        if self.workers[w as usize].kv.fits(&j.chain, extra) {
            return Ok(true);
        }
        self.kv_waited(job);
        Ok(false)
    }

    /// Job `job`'s prefill starts on `w`: it holds its prompt's full blocks (by their seed-free
    /// chain hashes: tenants' chains differ by their salt's root) and reserves blocks for the
    /// rest of its context, the partial last block and its whole answer (reserved up front: the
    /// simulator knows the answer's length, and an engine that runs out of blocks mid-answer
    /// preempts, which this model leaves out). The prefix cache keeps what the reservations
    /// leave.
    fn kv_hold(&mut self, w: u32, job: u32) -> Result<()> {
        if !self.cfg.kv_pool {
            return Ok(());
        }
        let x = &mut self.workers[w as usize];
        let j = &mut self.jobs[job as usize];
        // A prefill instance hands the KV over once the prompt is done: no answer to reserve.
        let extra = kv_extra(j, self.block_size, self.cfg.decoders[x.region as usize].is_empty());
        j.kv_handle = x.kv.hold(j.chain.clone(), extra);
        j.kv_at = w;
        Ok(())
    }

    /// Job `job` waits for room in a pool: counted once in [`Engine::kv_waits`].
    fn kv_waited(&mut self, job: u32) {
        let j = &mut self.jobs[job as usize];
        if !j.kv_waited {
            j.kv_waited = true;
            self.kv_waits += 1;
        }
    }

    /// Job `job` leaves its worker's pool (its answer is done, its KV handed to a decode
    /// instance, or its replica landed); a decode instance admits the sequences waiting for
    /// room, and a worker whose next prompt waited on the pool starts it (a stepping worker
    /// at its next step).
    fn kv_release(&mut self, job: u32) -> Result<()> {
        let j = &mut self.jobs[job as usize];
        let w = j.kv_at;
        if w == NO_WORKER {
            return Ok(());
        }
        j.kv_at = NO_WORKER;
        let h = j.kv_handle;
        let x = &mut self.workers[w as usize];
        x.kv.release_into(h, &mut x.cache, x.publish)?;
        if !x.handed.is_empty() {
            return self.admit_handed(w);
        }
        let x = &self.workers[w as usize];
        if x.current.is_some() || x.waiting.is_empty() {
            return Ok(());
        }
        if self.cfg.chunked {
            // A stepping worker looks again at its next step; one with nothing running (a
            // prefill instance whose handed-off sequence just left) steps now.
            return if x.stepping { Ok(()) } else { self.step(w) };
        }
        if self.kv_fits(w)? {
            self.start_prefill(w)?;
            self.publish_queue(w);
        }
        Ok(())
    }

    /// The prefix cache of `w` takes what the reservations leave ([`KvPool::fit_cache`]) as a
    /// prefill ends ([`Self::admit`]); a release gives room back at once ([`Self::kv_release`]).
    fn kv_room(&mut self, w: u32) -> Result<Vec<Event>> {
        if !self.cfg.kv_pool {
            return Ok(Vec::new());
        }
        let x = &mut self.workers[w as usize];
        x.kv.fit_cache(&mut x.cache, x.publish)
    }

    /// A job's id: a finished one's, else a new one.
    ///
    /// Why: a job is some 230 bytes, and keeping every finished one was a tenth of a
    /// paper-scale run's memory (500,000 of them); only those in flight need room.
    fn new_job(&mut self, mut j: Job) -> u32 {
        self.job_serial += 1;
        j.serial = self.job_serial;
        crate::slots::put(&mut self.jobs, &mut self.free_jobs, j)
    }

    /// Job `job` is finished (its record written, a replica landed): its id is free, and it
    /// keeps no tokens.
    fn free_job(&mut self, job: u32) {
        let j = &mut self.jobs[job as usize];
        j.tokens = Vec::new();
        j.chain = Vec::new();
        self.free_jobs.push(job);
    }

    fn complete(&mut self, job: u32) -> Result<()> {
        self.kv_release(job)?;
        let now = self.now;
        let j = &mut self.jobs[job as usize];
        let i = j.req as usize;
        let r = &mut self.records;
        r.order.push(j.req);
        r.worker[i] = j.worker;
        r.ttft_ms[i] = j.ttft_ms;
        let at_client = now + (if j.back_ms >= 0.0 { j.back_ms } else { j.one_way_ms });
        r.e2e_ms[i] = at_client - j.arrival_ms;
        r.queue_ms[i] = j.start_ms - j.at_worker_ms;
        r.vram_hit[i] = j.vram_hit;
        r.dram_hit[i] = j.dram_hit;
        // A claim counts against what an engine could reuse of the prompt (all but its last
        // token, `BlockCache::prompt_hit`): a router that names the whole prompt's blocks on
        // the worker that holds them made no false claim.
        let b = self.block_size as usize;
        r.claimed[i] = j.claimed.min((reusable_blocks(j.input_length as usize, b) * b) as i64);
        self.free_job(job); // nothing refers to a completed job again
        self.done += 1;
        if !self.child.is_empty() {
            for k in self.child_offs[i]..self.child_offs[i + 1] {
                let c = self.child[k as usize] as usize;
                self.release(c, at_client);
            }
        }
        if self.closed > 0 && self.next_issue < self.prompts.reqs.len() {
            let next = self.next_issue;
            self.next_issue += 1;
            // Its turn came now: that, not its own arrival time, is when it is issued.
            self.release(next, at_client);
        }
        let total = self.prompts.reqs.len() as u64;
        if self.done % self.progress_every == 0 || self.done == total {
            self.out.push(Out::Progress { done: self.done });
        }
        Ok(())
    }
}

fn lookup(cache: &BlockCache, tokens: &[u32], salt_seed: u64) -> Result<(u64, u64)> {
    let chain = cache.chain(tokens, salt_seed)?;
    let (v, d) = cache.lookup(&chain);
    let b = cache.block_size() as u64;
    Ok((v as u64 * b, d as u64 * b))
}

/// `(vram, dram)` hit tokens of a prompt of `tokens` tokens whose seed-free chain is `base`, as
/// the engine schedules it ([`BlockCache::prompt_hit`]: never its last token).
fn prompt_hit(cache: &BlockCache, base: &[u64], tokens: u64) -> (u64, u64) {
    let (v, d) = cache.prompt_hit(base, tokens as usize, true);
    let b = cache.block_size() as u64;
    (v as u64 * b, d as u64 * b)
}

#[allow(clippy::too_many_arguments)]
fn copy_into(cache: &mut BlockCache, tokens: &[u32], tier: u8, now: f64, salt: u32, salt_seed: u64, publish: bool) -> Result<Vec<Event>> {
    let chain = cache.chain(tokens, salt_seed)?;
    place(cache, tokens, &chain, tier, now, salt, publish)
}

/// A migration's replica of `tokens` (named `chain` by this cache) into `tier`.
fn place(cache: &mut BlockCache, tokens: &[u32], chain: &[u64], tier: u8, now: f64, salt: u32, publish: bool) -> Result<Vec<Event>> {
    match tier {
        VRAM => cache.place_vram(tokens, chain, now, salt, false, publish),
        DRAM => cache.place_dram(tokens, chain, now, salt, publish),
        t => Err(CoreError::InvalidTier(t)),
    }
}

fn add_dispatched(x: &mut Worker, origin: u16, ms: f64) {
    origin_add(&mut x.dispatched, origin, ms);
}

/// Work (ms) kept by origin region, as a short list (a handful of regions): `ms` more from
/// `origin`.
pub(super) fn origin_add(by: &mut Vec<(u16, f64)>, origin: u16, ms: f64) {
    match by.iter_mut().find(|(r, _)| *r == origin) {
        Some((_, v)) => *v += ms,
        None => by.push((origin, 0.0 + ms)),
    }
}

/// `origin`'s share of such a list (0 when absent).
pub(super) fn origin_share(by: &[(u16, f64)], origin: u16) -> f64 {
    by.iter().find(|(r, _)| *r == origin).map_or(0.0, |(_, v)| *v)
}

/// Every origin's share of such a list.
pub(super) fn origin_total(by: &[(u16, f64)]) -> f64 {
    by.iter().fold(0.0, |a, (_, v)| a + v)
}

fn sub_dispatched(x: &mut Worker, origin: u16, ms: f64) {
    if let Some((_, v)) = x.dispatched.iter_mut().find(|(r, _)| *r == origin) {
        let left = *v - ms;
        *v = if left > 1e-9 { left } else { 0.0 };
    }
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::token_ids::MAX_ID;

    fn spec(input_length: u64, block_size: u32, salt_seed: u64, runs: bool) -> RequestSpec {
        RequestSpec { arrival_ms: 0.0, region: 0, edge_region: 0, input_length, output_length: 1, block_size, salt: 0, salt_seed, runs }
    }

    /// The memoised chain equals `block_chain` of the expanded tokens for prompts that share
    /// runs (memo hits), stop inside a run (a shorter hit, then a longer miss), end in a partial
    /// block, carry a salt's seed, or are plain ids; and after the memo starts over.
    #[test]
    fn chain_from_runs_equals_the_chain_of_the_tokens() {
        let bs = 16usize;
        let (a, b, c) = (crate::token_ids::mix64(1) & MAX_ID, crate::token_ids::mix64(2) & MAX_ID, crate::token_ids::mix64(3) & MAX_ID);
        type Prompt = (Vec<(u64, u64)>, u64, u64); // (runs, input_length, salt seed)
        let prompts: Vec<Prompt> = vec![
            (vec![(a, 10), (b, 5)], 15 * 16, 0),
            (vec![(a, 10), (b, 5)], 15 * 16 - 7, 0), // partial last block: 14 hashed
            (vec![(a, 10), (c, 3)], 13 * 16, 0),     // shares run a
            (vec![(a, 4)], 4 * 16, 0),               // a shorter prefix of run a
            (vec![(a, 10), (b, 5)], 15 * 16, 99),    // a salt's seed: other names
            (vec![(b, 10)], 10 * 16, 0),             // run b first: another name before it
            (vec![(a, 10), (b, 8)], 18 * 16, 0),     // run b after a, longer than held
            (vec![(a, 10), (b, 5)], 15 * 16, 0),
        ];
        let mut reqs = Vec::new();
        let mut ids = Vec::new();
        let mut offs = vec![0usize];
        for (runs, len, seed) in &prompts {
            reqs.push(spec(*len, bs as u32, *seed, true));
            for &(ch, n) in runs {
                ids.extend([ch, n]);
            }
            offs.push(ids.len());
        }
        // The same first prompt as plain ids.
        let plain = chain_block_ids(&[a, b], &[10, 5]).unwrap();
        reqs.push(spec(15 * 16, bs as u32, 0, false));
        ids.extend(&plain);
        offs.push(ids.len());
        let p = Prompts { reqs, ids, id_offs: offs };
        let mut memo = ChainMemo::default();
        for round in 0..2 {
            for req in 0..p.reqs.len() as u32 {
                let r = p.reqs[req as usize];
                let want = block_chain(r.salt_seed, &p.tokens(req), bs).unwrap();
                assert_eq!(p.chain(req, bs, &mut memo), want, "round {round}, request {req}");
            }
            assert!(!memo.at.is_empty());
            memo.put(0, 0, &vec![0; MEMO_NAMES]); // fills it: the next put starts over
        }
        // Content-keyed schemes' prefix sums: from the memo's partial sums of runs, the same as
        // from the tokens, for prefixes that end inside a run, on a run's end, inside a block.
        let mut sums = ChainMemo::default();
        for round in 0..2 {
            for req in 0..p.reqs.len() as u32 {
                let chain = p.chain(req, bs, &mut memo);
                for n in [0usize, 15, 16, 100, 16 * 4, 16 * 10, 16 * 12 + 3, 16 * 15, 10_000] {
                    let want = policy::prefix_sum(&p.tokens_upto(req, n), bs);
                    assert_eq!(p.prefix_sum(req, n, bs, &chain, &mut sums), want, "round {round}, request {req}, {n} tokens");
                }
            }
        }
        assert_eq!(p.chain(0, bs, &mut memo), p.chain(p.reqs.len() as u32 - 1, bs, &mut memo));
    }

    /// A stretch of a prompt's blocks, expanded alone, is that stretch of the whole prompt's
    /// tokens: for prompts given as runs (a stretch across a run's end too) and as plain ids,
    /// and through the general path for another block size.
    #[test]
    fn block_tokens_are_the_prompts_own() {
        let (a, b) = (crate::token_ids::mix64(7) & MAX_ID, crate::token_ids::mix64(8) & MAX_ID);
        let plain = chain_block_ids(&[a, b], &[6, 4]).unwrap();
        let mut ids = vec![a, 6, b, 4];
        ids.extend(&plain);
        let p = Prompts { reqs: vec![spec(10 * 16, 16, 0, true), spec(10 * 16 - 5, 16, 0, false)], ids, id_offs: vec![0, 4, 14] };
        for req in 0..2u32 {
            let all = p.tokens(req);
            let whole = all.len() / 16;
            for first in 0..whole {
                for n in 1..=whole - first {
                    assert_eq!(p.block_tokens(req, first, n, 16), all[first * 16..(first + n) * 16].to_vec(), "request {req}, blocks {first}+{n}");
                }
            }
            // Another block size than the request's: the general path.
            assert_eq!(p.block_tokens(req, 3, 2, 8), all[24..40].to_vec());
        }
        assert_eq!(p.tokens(0)[..9 * 16], p.tokens(1)[..9 * 16]); // the same blocks, two forms
    }
}
