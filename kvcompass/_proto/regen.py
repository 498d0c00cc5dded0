"""Regenerates the betterproto code in this package from ``proto/`` (or checks it is fresh).

The generated modules are committed so that installing KVCompass needs no protoc; this is the
one command that writes them (it needs the test extras: grpcio-tools and betterproto[compiler])::

    python -m kvcompass._proto.regen            # rewrite the generated files
    python -m kvcompass._proto.regen --check    # exit 1 if they differ from a fresh run

which is ``python -m grpc_tools.protoc -I proto --python_betterproto_out=kvcompass/_proto
proto/kvcompass/v1/*.proto`` run from the repository root.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["PACKAGE_DIR", "PROTO_DIR", "diff", "generate", "main"]

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_DIR = PACKAGE_DIR.parents[1] / "proto"
_OWN = {"regen.py"}


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> dict[str, bytes]:
    """Run protoc with the betterproto plugin into ``out_dir``; returns {relative path: bytes}."""
    # Exactly the documented command, run from the directory above proto/: the plugin's output
    # layout depends on how the .proto paths are spelled.
    root = proto_dir.parent
    protos = sorted(p.relative_to(root).as_posix() for p in proto_dir.rglob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files under {proto_dir}")
    env = dict(os.environ)
    # The plugin (protoc-gen-python_betterproto) is a script next to this interpreter.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", proto_dir.name, f"--python_betterproto_out={out_dir}", *protos]
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"protoc failed ({p.returncode}): {p.stderr.strip()}")
    return {f.relative_to(out_dir).as_posix(): f.read_bytes() for f in sorted(out_dir.rglob("*.py"))}


def committed(package_dir: Path = PACKAGE_DIR) -> dict[str, bytes]:
    """The generated files as they are in the package (this module excluded)."""
    return {f.relative_to(package_dir).as_posix(): f.read_bytes() for f in sorted(package_dir.rglob("*.py")) if f.name not in _OWN or f.parent != package_dir}


def diff() -> list[str]:
    """Paths that a fresh generation would add, change or remove (empty: up to date)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    have = committed()
    return sorted(k for k in fresh.keys() | have.keys() if fresh.get(k) != have.get(k))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--check"]:
        stale = diff()
        for path in stale:
            print(f"stale: kvcompass/_proto/{path}", file=sys.stderr)
        return 1 if stale else 0
    if args:
        print("usage: python -m kvcompass._proto.regen [--check]", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    for path in committed().keys() - fresh.keys():
        (PACKAGE_DIR / path).unlink()
    for path, data in fresh.items():
        dest = PACKAGE_DIR / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
