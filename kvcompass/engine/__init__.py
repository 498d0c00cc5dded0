"""The engine model, one for the simulator and the running system: :mod:`kvcompass.engine.cache`,
a worker's two-tier block prefix cache that publishes the KV events a real engine would (its
blocks in Rust, ``rust/block_cache.rs``), and :mod:`kvcompass.engine.costs`, the calibrated
prefill, reload and decode cost model with the chunked-prefill step rule (one Rust
implementation, ``rust/sim/engine.rs``). The emulated vLLM worker (``kvcompass worker
--emulate``), the chaos harness and the simulator all run these, so a timing or eviction rule
cannot differ between them."""
