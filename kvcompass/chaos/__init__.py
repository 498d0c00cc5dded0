"""Fault harnesses for the discovery plane (``kvcompass chaos``).

:mod:`kvcompass.chaos.harness` runs a whole plane in one process on a virtual clock and injects
seeded faults into its streams and components; :mod:`kvcompass.chaos.processes` does the same
with ``kill -9`` against a real local cluster. Both report whether every edge view converged to
its maintenance tables, how long that took, and how many requests could not be served.
"""

from __future__ import annotations

from kvcompass.chaos.harness import ChaosConfig, ChaosHarness, ChaosResult, run_chaos

__all__ = ["ChaosConfig", "ChaosHarness", "ChaosResult", "run_chaos"]
