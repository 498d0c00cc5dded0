"""The simulator (docs/design.md section 4, ``sim``): transport-free, deterministic models driven by a
virtual clock. Among them :mod:`kvcompass.sim.cache`, a worker's two-tier block prefix cache that
publishes the KV events a real engine would, and :mod:`kvcompass.sim.costs`, the calibrated
prefill / reload / decode cost model."""
