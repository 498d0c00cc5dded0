"""What every bench script's JSON line carries: which code was measured (the checkout's commit,
and whether tracked files differ from it) and whether each figure met its bar (shared by the
scripts; not a test)."""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def git_info(repo: Path = REPO) -> tuple[str | None, bool | None]:
    """(short commit, dirty) of the checkout at ``repo``; (None, None) outside git. Dirty counts
    untracked files too (a new module changes what runs), and the loaded extension's build is
    said apart by :func:`core_build` (it is ignored by git, so a stale or experimental build
    would otherwise pass as the commit's; found in review)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None, None
        st = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=normal"], cwd=repo, capture_output=True, text=True, timeout=10)
        dirty = bool(st.stdout.strip()) if st.returncode == 0 else None
        return head.stdout.strip() or None, dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def core_build() -> str | None:
    """The first 12 hex digits of the SHA-256 of the ``kvcompass._core`` file this process
    loaded: two runs with the same commit and different builds say so."""
    try:
        from kvcompass import _core

        return hashlib.sha256(Path(_core.__file__).read_bytes()).hexdigest()[:12]
    except (ImportError, OSError, AttributeError):
        return None


def meets(results: Mapping[str, Any], bars: Mapping[str, Mapping[str, Any]]) -> dict[str, bool | None]:
    """Per bar, whether the result named like it meets it: a bar is ``{"max": x}``, ``{"min": x}``,
    ``{"eq": x}`` or ``{"in": [...]}``; None when the run has no such result (not measured)."""
    out: dict[str, bool | None] = {}
    for name, bar in bars.items():
        v = results.get(name)
        if v is None:
            out[name] = None
        elif "max" in bar:
            out[name] = bool(v <= bar["max"])
        elif "min" in bar:
            out[name] = bool(v >= bar["min"])
        elif "eq" in bar:
            out[name] = bool(v == bar["eq"])
        else:
            out[name] = v in bar["in"]
    return out
