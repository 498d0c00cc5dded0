"""The simulator (docs/design.md section 4, ``sim``): transport-free, deterministic runs of a whole
fleet on a virtual clock, its engine in Rust (``rust/sim``), KVCompass's decisions made by the
services' own objects. The worker model it shares with the running system (the emulated cache
and the cost model) is :mod:`kvcompass.engine`."""
