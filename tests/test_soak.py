"""The 60-second soak (``benches/soak.py --seconds 60``): a real ``kvcompass up`` cluster under
twice its planned rate with a maintenance unit and a worker killed and restarted, checked for
bounded memory, stable fd/thread counts, a P99 TTFT that does not trend up, no failed requests
and recovery after every restart. The 10-minute run is the script's default."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_sixty_second_soak_with_faults(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "soak.py"), "--seconds", "60", "--fault-every", "15", "--run-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    lines = p.stdout.strip().splitlines()
    assert lines, f"no output (exit {p.returncode}):\n{p.stderr[-3000:]}"
    out = json.loads(lines[-1])
    assert out["ok"], (out["problems"], p.stderr[-3000:])
    assert p.returncode == 0
    assert out["faults"] >= 2 and {f["process"].split("-")[0] for f in out["fault_log"]} == {"maintenance", "worker"}
    assert out["requests"] >= 400 and out["failed_requests"] == 0
    assert out["all_alive_at_end"] and out["max_recover_ms"] is not None
