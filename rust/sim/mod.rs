//! The simulator's engine: the virtual clock and event queue, the emulated workers (FIFO
//! prefill, vLLM-style chunked steps or separate lanes, continuous-batching decode in
//! segments, prefill-decode hand-off), their prefix caches ([`crate::block_cache`]), the
//! fleet's in-flight accounting, WAN delivery with jitter, and per-request records.
//!
//! `kvcompass/sim/engine.py` documents the model; this is its implementation. Decisions that
//! are not the engine's (which worker serves a request, what an edge learns from a response,
//! what an agent makes of KV events) are the driver's: the engine stops at an arrival or a
//! landing for the driver to route, and queues what the driver must be told (KV events,
//! responses, queue readings) in [`Out`], in the order the model produces them, each with the
//! event sequence number it would have scheduled at, so that whatever the driver schedules
//! in reply sorts exactly where it would have in one single-threaded loop.

pub mod busy;
pub(crate) mod lru_order;
pub mod engine;
pub mod kv_pool;
pub mod rng;

pub use engine::{Baseline, CoordinatorState, DynamoState, SGLangState, Choice, Config, Cost, Engine, History, Out, Policy, RequestSpec, Salts, Step, WorkerCheck, WorkerSetup};
pub use rng::Pcg64;
