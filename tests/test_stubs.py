"""The typing surface: the hand-written stub matches the compiled module, and the Python
package type-checks under ``mypy --strict``.

Both run mypy in a subprocess of the test interpreter with caching disabled (``os.devnull``),
so they neither depend on nor disturb a shared ``.mypy_cache``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parents[1]
STRICT_FILES = ["kvcompass/index_types.py", "kvcompass/errors.py", "kvcompass/records.py", "kvcompass/__init__.py", "kvcompass/discovery/maintenance.py", "kvcompass/discovery/topology.py", "kvcompass/discovery/plan.py", "kvcompass/cli", "kvcompass/demo.py"]
STRICT_FILES += [f"kvcompass/discovery/{m}.py" for m in ("edge", "belief", "queues", "hotness", "migration", "params", "plane", "layout", "key_ops")]
STRICT_FILES += [f"kvcompass/agent/{m}.py" for m in ("__init__", "events", "agent")]
STRICT_FILES += [f"kvcompass/sim/{m}.py" for m in ("__init__",)]
STRICT_FILES += [f"kvcompass/engine/{m}.py" for m in ("__init__", "cache", "costs", "tokenizer")]
STRICT_FILES += ["kvcompass/sim/workload.py", "kvcompass/sim/requests.py", "kvcompass/sim/sharegpt.py"]
STRICT_FILES += [f"kvcompass/sim/{m}.py" for m in ("engine", "schemes", "summary")]
STRICT_FILES += ["kvcompass/sim/report.py", "kvcompass/sim/sensitivity.py"]
STRICT_FILES += [f"kvcompass/services/{m}.py" for m in ("__init__", "status", "metrics", "codec", "maintenance_service", "ingest_client", "edge_sync", "edge_service")]
STRICT_FILES += [f"kvcompass/services/{m}.py" for m in ("emulated_worker", "agent_runner", "http_door", "lifecycle", "grpc_lifecycle", "wire", "cluster", "loadgen", "openai_api", "conn_guard")]
STRICT_FILES += ["kvcompass/_proto/regen.py"]
STRICT_FILES += [f"kvcompass/chaos/{m}.py" for m in ("__init__", "harness", "processes")]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def test_package_ships_typing_markers() -> None:
    assert (ROOT / "kvcompass" / "py.typed").is_file()
    assert (ROOT / "kvcompass" / "_core.pyi").is_file()


def test_stubtest_core() -> None:
    p = run("-m", "mypy.stubtest", "kvcompass._core", "--mypy-config-file", str(ROOT / "pyproject.toml"))
    assert p.returncode == 0, p.stdout + p.stderr


def test_mypy_strict_package() -> None:
    p = run("-m", "mypy", "--strict", "--cache-dir", os.devnull, *STRICT_FILES)
    assert p.returncode == 0, p.stdout + p.stderr
