"""``kvcompass up``: a whole multi-region cluster on loopback, every component its own process.

Start order follows the data flow, each phase started in parallel and awaited on the children's
ready lines (:func:`kvcompass.services.lifecycle.announce`), so every port is chosen by the
process that binds it and no two processes can race for one:

1. one maintenance unit per shard;
2. an emulated worker per (selected) worker;
3. an agent per worker (it needs the worker's ZMQ endpoints and every unit) and an edge per edge
   region (it needs every unit and every worker's URL);
4. the edges' gRPC endpoints go into a peers file the edges are waiting for (queue exchange);
5. health: every unit's and edge's ``/healthz``, every door's and worker's ``/health``, every
   agent's ``/healthz``, and every worker's KV-event subscription taken by its agent.

Every agent gets a random credential of its own (``--token-file``; the units get the whole map
with ``--tokens-file``), so an agent can write only its own worker's fields. With ``--tls`` a
throwaway CA is made in the run directory and every hop (gRPC, the doors, the workers' HTTP)
runs mutual TLS with one certificate for all processes; the metrics endpoints stay plain HTTP.

Only then are the endpoints printed and the state file written, so whoever waits for the file
may send traffic at once. Ctrl-C / SIGTERM stops the cluster in reverse data-flow order (edges
drain their in-flight requests first, maintenance units write their state last). Children run
in their own sessions, so a terminal's Ctrl-C reaches only this supervisor, and they watch it
(``KVCOMPASS_PARENT_PID``), so even a SIGKILLed supervisor leaves no orphans.

A child that dies while the cluster runs is started again, like a process manager would: on
the ports it had (its peers keep their addresses), after a backoff that doubles from 0.25 s up
to 8 s, and at most 5 times in 60 s; past that budget it is left down and said so. Every
restart is logged on stderr and counted in the state file (``restarts``, ``left_down``), whose
``pids`` follow the restarted processes. While a worker is down the edges route around it. The
exit status is 0 when every child still running at shutdown drained and exited 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp

from kvcompass.errors import UsageError
from kvcompass.services.lifecycle import env_for_child, stop_on_signals, stop_process_async

__all__ = ["Child", "ClusterConfig", "pick_workers", "run_cluster"]

_LOG_TAIL = 2000


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """What ``kvcompass up`` was asked for."""

    topology: str = "testbed-14x3"
    routing: str = "kvcompass"
    time_scale: float = 1.0
    wan_delay: bool = True
    handoff: bool = True
    """Edges forward cross-region requests through the destination region's door (hand-off)."""
    workers_per_region: int | None = None
    max_workers: int | None = None
    state_file: str | None = None
    run_dir: str | None = None
    startup_timeout_s: float = 120.0
    drain_grace_s: float = 15.0
    host: str = "127.0.0.1"
    auth: bool = True
    """One random credential per worker (agents may write only their own worker's fields)."""
    tls: bool = False
    """Mutual TLS on every hop, with a CA made for this run."""
    open: bool = False
    """Doors without API keys (any client acts as any tenant); else a key per tenant."""
    tenants: tuple[str, ...] = ()
    """Tenants beyond the default one to make API keys for."""
    key_rate_per_s: float | None = None
    """A token bucket per tenant key (requests per second; None: unlimited); the doors' own
    hand-off key is never limited."""
    key_burst: float | None = None
    """The buckets' depth (None: the rate, at least 1)."""


@dataclass(eq=False)
class Child:
    """One supervised process."""

    name: str
    role: str
    argv: list[str]
    log: Path
    proc: asyncio.subprocess.Process | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    exited: int | None = None
    stopping: bool = False
    base: list[str] = field(default_factory=list)
    """The command line before any fixed ports (a restart appends its predecessor's)."""
    _drain: asyncio.Task[None] | None = None
    _logf: IO[bytes] | None = None

    def tail(self) -> str:
        try:
            data = self.log.read_bytes()[-_LOG_TAIL:]
        except OSError:
            return ""
        return data.decode(errors="replace")


def _port(endpoint: str) -> str:
    return endpoint.rstrip("/").rsplit(":", 1)[1]


def fixed_ports(role: str, ready: dict[str, Any]) -> list[str]:
    """The arguments that restart a process on the ports its predecessor had (its peers keep
    the addresses they were given)."""
    if role == "maintenance":
        return ["--port", _port(str(ready["grpc"])), "--metrics-port", _port(str(ready["metrics"]))]
    if role == "edge":
        return ["--http-port", _port(str(ready["http"])), "--grpc-port", _port(str(ready["grpc"])), "--metrics-port", _port(str(ready["metrics"]))]
    if role == "agent":
        return ["--metrics-port", _port(str(ready["metrics"]))]
    if role == "worker":
        return ["--port", _port(str(ready["http"])), "--events-port", _port(str(ready["events"])), "--replay-port", _port(str(ready["replay"]))]
    raise ValueError(f"unknown role {role!r}")


RESTART_BUDGET = 5
"""Restarts of one process within :data:`RESTART_WINDOW_S` before the supervisor gives up on
it (a process that cannot stay up is left down and said so, not restarted in a tight loop)."""
RESTART_WINDOW_S = 60.0
RESTART_BACKOFF_S = (0.25, 8.0)
"""The first restart's delay and the cap; each further restart in the window doubles it."""


def pick_workers(topology: Any, per_region: int | None, max_workers: int | None) -> list[Any]:
    """The workers to start: at most ``per_region`` of each region, then at most ``max_workers``
    in all, taken round-robin over regions so every region keeps a worker as long as possible.
    Workers left out stay in the index layout (the edges know them but never forward to them)."""
    by_region: dict[str, list[Any]] = {}
    for w in topology.indexed_workers:
        by_region.setdefault(w.region, []).append(w)
    if per_region is not None:
        by_region = {r: ws[:per_region] for r, ws in by_region.items()}
    out: list[Any] = []
    depth = max((len(ws) for ws in by_region.values()), default=0)
    for i in range(depth):
        for ws in by_region.values():
            if i < len(ws):
                out.append(ws[i])
    if max_workers is not None:
        out = out[:max_workers]
    order = {w.id: i for i, w in enumerate(topology.workers)}
    return sorted(out, key=lambda w: order[w.id])


class Cluster:
    """The supervisor's state; :func:`run_cluster` drives it."""

    def __init__(self, cfg: ClusterConfig, run_dir: Path) -> None:
        from kvcompass.discovery.plan import LevelPlan
        from kvcompass.discovery.topology import load_topology

        self.cfg = cfg
        self.run_dir = run_dir
        self.topology = load_topology(cfg.topology)
        self.plan = LevelPlan(self.topology)
        self.workers = pick_workers(self.topology, cfg.workers_per_region, cfg.max_workers)
        if not self.workers:
            raise UsageError("no worker selected: --workers-per-region and --max-workers must be >= 1")
        self.children: list[Child] = []
        self.stopping = False
        self.tls_args: list[str] = []
        self.http_ssl: ssl.SSLContext | None = None
        self.restarts: dict[str, int] = {}
        """Restarts carried out, by process name."""
        self.given_up: list[str] = []
        """Processes left down after their restart budget ran out."""
        self._restart_times: dict[str, list[float]] = {}
        self._supervising: set[asyncio.Task[None]] = set()
        self.state: dict[str, Any] | None = None
        """What :meth:`start` returned, kept current (pids, restarts) once set."""
        self.state_file: Path | None = None

    def _secrets(self) -> Path:
        d = self.run_dir / "secrets"
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        return d

    def make_tokens(self) -> dict[str, Path]:
        """A random token per started worker: the units' map and each agent's own file (files,
        not argv, so ``ps`` does not show them). Returns worker -> its token file."""
        d = self._secrets()
        tokens = {w.id: secrets.token_urlsafe(32) for w in self.workers}
        files = {}
        for wid, tok in tokens.items():
            files[wid] = d / f"agent-{wid}.token"
            _write_secret(files[wid], tok + "\n")
        _write_secret(d / "tokens.json", json.dumps(tokens, indent=2) + "\n")
        return files

    def make_api_keys(self) -> tuple[dict[str, str], Path, Path]:
        """A key per tenant (the default one first) and the doors' peer key (any tenant, for
        hand-offs): the doors' hashed keys file, the peer key's file, and tenant -> key for
        the state file (clients read theirs there)."""
        from kvcompass.services.api_keys import ANY_TENANT, new_key, write_keys_file
        from kvcompass.services.http_door import DoorConfig

        d = self._secrets()
        tenants = list(dict.fromkeys((DoorConfig().default_tenant, *self.cfg.tenants)))
        keys = {t: new_key() for t in tenants}
        peer = new_key()
        path = d / "api-keys.json"
        rate = self.cfg.key_rate_per_s
        limits = {t: (rate, self.cfg.key_burst) for t in keys} if rate is not None else None
        write_keys_file(path, [*((t, k, [t]) for t, k in keys.items()), ("doors (hand-offs)", peer, [ANY_TENANT])], limits)
        peer_file = d / "peer.key"
        _write_secret(peer_file, peer + "\n")
        return keys, path, peer_file

    def make_tls(self) -> None:
        from kvcompass.services.tls import ThrowawayCA, TLSConfig

        ca = ThrowawayCA.create(self._secrets() / "pki")
        hosts = tuple(dict.fromkeys((self.cfg.host, "127.0.0.1", "localhost", "::1")))
        leaf = ca.issue("kvcompass-cluster", hosts)
        self.tls_args = ["--tls-cert", leaf.cert, "--tls-key", leaf.key, "--tls-ca", ca.cert]
        # The supervisor checks the doors' and workers' health over HTTPS with the same identity.
        self.http_ssl = TLSConfig(leaf.cert, leaf.key, ca.cert).client_context("http")

    def _mtls(self) -> list[str]:
        return [*self.tls_args, "--tls-client-auth"] if self.tls_args else []

    def _cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "kvcompass", *args]

    async def spawn(self, name: str, role: str, argv: list[str], base: list[str] | None = None) -> Child:
        c = Child(name, role, argv, self.run_dir / "logs" / f"{name}.log", base=list(argv if base is None else base))
        c.log.parent.mkdir(parents=True, exist_ok=True)
        # Appended to, with a line per start: a restart used to truncate the log, losing the
        # crash that caused it (found in review). Closed by _retire (or stop).
        c._logf = open(c.log, "ab")  # noqa: SIM115
        c._logf.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} kvcompass up: starting {name}\n".encode())
        c._logf.flush()
        c.proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=c._logf, env=env_for_child(), start_new_session=True
        )
        self.children.append(c)
        return c

    async def wait_ready(self, children: Sequence[Child], timeout: float) -> None:
        async def one(c: Child) -> None:
            assert c.proc is not None and c.proc.stdout is not None
            while True:
                line = await c.proc.stdout.readline()
                if not line:
                    code = await c.proc.wait()
                    raise RuntimeError(f"{c.name} exited with code {code} before it was ready; its log ({c.log}) ends:\n{c.tail()}")
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if isinstance(obj, dict) and obj.get("ready") == c.role:
                    c.ready = obj
                    c._drain = asyncio.get_running_loop().create_task(self._drain_stdout(c))
                    return

        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(one(c) for c in children))
        except TimeoutError:
            late = [c.name for c in children if not c.ready]
            raise RuntimeError(f"not ready within {timeout:.0f} s: {', '.join(late)}") from None

    async def _drain_stdout(self, c: Child) -> None:
        """Read what follows the ready line (nothing, normally), so a chatty child never blocks
        on a full pipe, and notice when it exits."""
        assert c.proc is not None and c.proc.stdout is not None
        while await c.proc.stdout.readline():
            pass
        code = await c.proc.wait()
        c.exited = code
        if not c.stopping and not self.stopping:
            print(f"kvcompass up: {c.name} exited with code {code}; restarting it on the same ports (log {c.log})", file=sys.stderr, flush=True)
            task = asyncio.get_running_loop().create_task(self._supervise(c))
            self._supervising.add(task)
            task.add_done_callback(self._supervising.discard)

    async def _retire(self, c: Child) -> None:
        """A child that has ended: its log file closed and its entry dropped (found in review: a
        file descriptor and an entry were kept per restart until the cluster stopped)."""
        if c._drain is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(c._drain), 1.0)
        if c._logf is not None:
            c._logf.close()
            c._logf = None
        with contextlib.suppress(ValueError):
            self.children.remove(c)

    async def _supervise(self, dead: Child) -> None:
        """Start ``dead`` again, on its ports, with backoff, within its restart budget."""
        await self._retire(dead)
        times = self._restart_times.setdefault(dead.name, [])
        timeout = self.cfg.startup_timeout_s
        while not self.stopping:
            now = time.monotonic()
            times[:] = [t for t in times if now - t < RESTART_WINDOW_S]
            if len(times) >= RESTART_BUDGET:
                self.given_up.append(dead.name)
                print(
                    f"kvcompass up: {dead.name} needed {RESTART_BUDGET} restarts within {RESTART_WINDOW_S:.0f} s: left down (log {dead.log})",
                    file=sys.stderr,
                    flush=True,
                )
                self._write_state()
                return
            first, cap = RESTART_BACKOFF_S
            await asyncio.sleep(min(cap, first * 2 ** len(times)))
            if self.stopping:
                return
            times.append(time.monotonic())
            new = await self.spawn(dead.name, dead.role, [*dead.base, *fixed_ports(dead.role, dead.ready)], base=dead.base)
            try:
                await self.wait_ready([new], timeout)
            except RuntimeError as e:
                print(f"kvcompass up: restarting {dead.name} failed: {e}", file=sys.stderr, flush=True)
                if new.proc is not None and new.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        new.proc.kill()
                    await new.proc.wait()
                await self._retire(new)
                continue
            self.restarts[dead.name] = self.restarts.get(dead.name, 0) + 1
            assert new.proc is not None
            print(f"kvcompass up: restarted {dead.name} (pid {new.proc.pid}; {len(times)} restart(s) in the last {RESTART_WINDOW_S:.0f} s)", file=sys.stderr, flush=True)
            self._write_state()
            return

    def _write_state(self) -> None:
        """Bring the state (and ``--state-file``) up to date: live pids, restarts, given up."""
        if self.state is None:
            return
        # Only processes that are up: a restart still starting keeps its predecessor's entry.
        live = {c.name: c.proc.pid for c in self.children if c.proc is not None and c.proc.returncode is None and c.ready}
        # A child left down has no pid to list (a script killing the listed pids could hit a
        # reused one; found in review).
        self.state["pids"] = {k: v for k, v in {**self.state.get("pids", {}), **live}.items() if k not in self.given_up}
        self.state["restarts"] = dict(self.restarts)
        self.state["left_down"] = list(self.given_up)
        if self.state_file is not None:
            _write_json(self.state_file, self.state)

    async def start(self) -> dict[str, Any]:
        cfg, topo = self.cfg, self.topology
        timeout = cfg.startup_timeout_s
        shards = topo.shards
        token_files = self.make_tokens() if cfg.auth else {}
        auth = ["--tokens-file", str(self.run_dir / "secrets" / "tokens.json")] if cfg.auth else []
        if cfg.tls:
            self.make_tls()
        api_keys: dict[str, str] = {}
        if cfg.open:
            door_auth = ["--open"]
        else:
            api_keys, keys_file, peer_file = self.make_api_keys()
            door_auth = ["--api-keys-file", str(keys_file), "--peer-key-file", str(peer_file)]
        units = [
            await self.spawn(f"maintenance-{s}", "maintenance", self._cmd(
                "maintenance", "--shard", str(s), "--shards", str(shards), "--topology", cfg.topology, "--host", cfg.host,
                "--state-file", str(self.run_dir / f"shard-{s}.state"), *auth, *self._mtls(),
            ))
            for s in range(shards)
        ]
        workers = [
            await self.spawn(f"worker-{w.id}", "worker", self._cmd(
                "worker", "--emulate", "--worker", w.id, "--topology", cfg.topology, "--host", cfg.host, "--time-scale", repr(cfg.time_scale),
                *self._mtls(),
            ))
            for w in self.workers
        ]
        await self.wait_ready(units + workers, timeout)
        maint = ",".join(str(u.ready["grpc"]) for u in sorted(units, key=lambda u: int(u.ready["shard"])))
        urls = {str(w.ready["worker"]): str(w.ready["http"]) for w in workers}
        workers_file = self.run_dir / "workers.json"
        _write_json(workers_file, urls)
        peers_file = self.run_dir / "peers.json"
        door_peers_file = self.run_dir / "door-peers.json"
        for f in (peers_file, door_peers_file):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
        agents = [
            await self.spawn(f"agent-{w.ready['worker']}", "agent", self._cmd(
                "agent", "--worker", str(w.ready["worker"]), "--events", str(w.ready["events"]), "--replay", str(w.ready["replay"]),
                "--topology", cfg.topology, "--maintenance", maint, "--host", cfg.host,
                *(["--token-file", str(token_files[str(w.ready["worker"])])] if cfg.auth else []), *self.tls_args,
            ))
            for w in workers
        ]
        wan = cfg.time_scale if cfg.wan_delay else 0.0
        edges = [
            await self.spawn(f"edge-{r}", "edge", self._cmd(
                "edge", "--region", r, "--topology", cfg.topology, "--routing", cfg.routing, "--host", cfg.host, "--maintenance", maint,
                "--workers-file", str(workers_file), "--wan-delay", repr(wan), "--peers-file", str(peers_file), "--door-peers-file", str(door_peers_file),
                "--drain-grace", repr(cfg.drain_grace_s), "--seed", str(i), *([] if cfg.handoff else ["--no-handoff"]), *door_auth, *self._mtls(),
            ))
            for i, r in enumerate(self.plan.edge_regions)
        ]
        await self.wait_ready(agents + edges, timeout)
        _write_json(peers_file, {str(e.ready["region"]): str(e.ready["grpc"]) for e in edges})
        _write_json(door_peers_file, {str(e.ready["region"]): str(e.ready["http"]) for e in edges})
        await self.wait_healthy(units, workers, agents, edges, timeout)
        _write_json(self.run_dir / "prometheus-targets.json", _scrape_targets(units, workers, agents, edges))
        return {
            "edges": {str(e.ready["region"]): {"http": e.ready["http"], "grpc": e.ready["grpc"], "metrics": e.ready["metrics"], "dashboard": e.ready.get("dashboard")} for e in edges},
            "maintenance": [{"shard": u.ready["shard"], "grpc": u.ready["grpc"], "metrics": u.ready["metrics"]} for u in sorted(units, key=lambda u: int(u.ready["shard"]))],
            "workers": {str(w.ready["worker"]): {"http": w.ready["http"], "region": w.ready["region"]} for w in workers},
            # Beyond the documented three keys: for operators and tests.
            "agents": {str(a.ready["worker"]): {"metrics": a.ready["metrics"]} for a in agents},
            "routing": cfg.routing,
            "time_scale": cfg.time_scale,
            "topology": topo.name,
            "run_dir": str(self.run_dir),
            "auth": cfg.auth,
            # Beside the documented keys too: each tenant's API key for the doors ({} with --open).
            "api_keys": api_keys,
            "tls": {"ca": self.tls_args[5], "cert": self.tls_args[1], "key": self.tls_args[3]} if self.tls_args else None,
            "pids": {c.name: c.proc.pid for c in self.children if c.proc is not None},
            "supervisor_pid": os.getpid(),
        }

    async def wait_healthy(self, units: list[Child], workers: list[Child], agents: list[Child], edges: list[Child], timeout: float) -> None:
        checks: list[tuple[Child, str, str | None]] = []
        checks += [(u, f"{u.ready['metrics']}/healthz", None) for u in units]
        checks += [(w, f"{w.ready['http']}/health", None) for w in workers]
        checks += [(a, f"{a.ready['metrics']}/healthz", None) for a in agents]
        checks += [(e, f"{e.ready['metrics']}/healthz", None) for e in edges]
        checks += [(e, f"{e.ready['http']}/health", None) for e in edges]
        # The agent's SUB is connected once the worker's XPUB counts it: events from then on reach it.
        checks += [(w, f"{w.ready['http']}/metrics", "kvcompass_worker_event_subscribers") for w in workers]
        deadline = time.monotonic() + timeout
        conn = aiohttp.TCPConnector(ssl=self.http_ssl if self.http_ssl is not None else True)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=5)) as http:

            async def one(c: Child, url: str, gauge: str | None) -> None:
                while True:
                    if c.proc is not None and c.proc.returncode is not None:
                        raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} during startup; its log ({c.log}) ends:\n{c.tail()}")
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        async with http.get(url) as r:
                            if r.status == 200 and (gauge is None or _gauge(await r.text(), gauge) >= 1):
                                return
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{c.name} not healthy within {timeout:.0f} s ({url})")
                    await asyncio.sleep(0.1)

            await asyncio.gather(*(one(*c) for c in checks))

    async def stop(self) -> int:
        """Drain in reverse data-flow order; SIGKILL whatever outlives its grace period."""
        self.stopping = True
        for task in list(self._supervising):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        code = 0
        for role in ("edge", "agent", "worker", "maintenance"):
            group = [c for c in self.children if c.role == role and c.proc is not None and c.proc.returncode is None]
            for c in group:
                c.stopping = True
            # The whole group drains at once: each gets SIGTERM now and its own grace period.
            results = await asyncio.gather(*(stop_process_async(c.proc, self.cfg.drain_grace_s + 10) for c in group if c.proc is not None))
            for c, (rc, killed) in zip(group, results):
                if killed:
                    print(f"kvcompass up: {c.name} did not stop within its grace period: killed", file=sys.stderr)
                if rc != 0 and not (not c.ready and rc == -signal.SIGTERM):
                    # (A restart still starting when the cluster stops dies of the SIGTERM
                    # before it can drain: that is the stop, not a failure.)
                    print(f"kvcompass up: {c.name} exited with code {rc}; its log ({c.log}) ends:\n{c.tail()}", file=sys.stderr)
                    code = 1
        for c in self.children:
            if c.proc is not None and c.proc.returncode is None:  # never started fully
                with contextlib.suppress(ProcessLookupError):
                    c.proc.kill()
                await c.proc.wait()
            if c._drain is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await c._drain
            if c._logf is not None:
                c._logf.close()
        return code


def _scrape_targets(units: list[Child], workers: list[Child], agents: list[Child], edges: list[Child]) -> list[dict[str, Any]]:
    """Every process's Prometheus endpoint (``/metrics``) in Prometheus' file_sd format
    (``deploy/prometheus/prometheus.yml`` reads it): the edges' doors and their gRPC side's
    listener, the units, the agents and the workers."""

    def hostport(url: str) -> str:
        return url.split("://", 1)[-1].rstrip("/")

    out: list[dict[str, Any]] = []
    for e in edges:
        out.append({"targets": [hostport(str(e.ready["http"]))], "labels": {"role": "door", "region": str(e.ready["region"])}})
        out.append({"targets": [hostport(str(e.ready["metrics"]))], "labels": {"role": "edge", "region": str(e.ready["region"])}})
    for u in units:
        out.append({"targets": [hostport(str(u.ready["metrics"]))], "labels": {"role": "maintenance", "shard": str(u.ready["shard"])}})
    for a in agents:
        out.append({"targets": [hostport(str(a.ready["metrics"]))], "labels": {"role": "agent", "worker": str(a.ready["worker"])}})
    for w in workers:
        out.append({"targets": [hostport(str(w.ready["http"]))], "labels": {"role": "worker", "worker": str(w.ready["worker"])}})
    return out


def _gauge(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _write_secret(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _write_json(path: Path, obj: object) -> None:
    """Atomically, so a reader polling for the file never reads half of it; mode 0600, since
    the cluster's state names its API keys (found in review: it was world-readable)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _write_secret(tmp, json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def format_endpoints(state: dict[str, Any]) -> str:
    out = [f"KVCompass cluster up: topology {state['topology']}, routing {state['routing']}, time scale {state['time_scale']}"]
    for r, e in state["edges"].items():
        out.append(f"  edge {r:<8} http {e['http']}  grpc {e['grpc']}  metrics {e['metrics']}/metrics  dashboard {e.get('dashboard')}")
    for m in state["maintenance"]:
        out.append(f"  maintenance shard {m['shard']}  grpc {m['grpc']}  metrics {m['metrics']}/metrics")
    for w, d in state["workers"].items():
        out.append(f"  worker {w:<10} {d['region']:<8} http {d['http']}")
    if state.get("api_keys"):
        keys = ", ".join(f"{t}={k}" for t, k in state["api_keys"].items())
        out.append(f"  API keys (send Authorization: Bearer KEY; the tenant comes from the key): {keys}")
    else:
        out.append("  doors are open (--open): no API keys, any client may act as any tenant")
    out.append(f"  logs and state in {state['run_dir']}; Ctrl-C stops everything")
    return "\n".join(out)


async def run_cluster(cfg: ClusterConfig, stop: asyncio.Event | None = None) -> int:
    """Start the cluster, run until SIGINT/SIGTERM (or ``stop``), then stop it."""
    stop = stop if stop is not None else asyncio.Event()
    # stop_on_signals also watches KVCOMPASS_PARENT_PID: `kvcompass up` started by another
    # process (cluster-demo) stops with it, killed or not (found in review: a cluster-demo
    # killed or SIGTERMed left its whole cluster running, in a session of its own).
    async with stop_on_signals(stop):
        return await _run_cluster(cfg, stop)


async def _run_cluster(cfg: ClusterConfig, stop: asyncio.Event) -> int:
    loop = asyncio.get_running_loop()
    own_dir = cfg.run_dir is None
    state_file = None if cfg.state_file is None else Path(cfg.state_file)
    if state_file is not None:
        if not state_file.parent.is_dir():
            raise OSError(f"--state-file {str(state_file)!r}: no directory {str(state_file.parent)!r}")
        # Whoever waits for the file may send traffic once it exists: one left by an earlier
        # run named dead endpoints and pids from the first moment (found in review).
        state_file.unlink(missing_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="kvcompass-up-")) if cfg.run_dir is None else Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # The units' state files belong to one run (restarts inside it): a reused run directory
    # handed an earlier cluster's index to new workers, or refused a changed topology's layout
    # (found in review).
    for old in run_dir.glob("shard-*.state"):
        old.unlink(missing_ok=True)
    try:
        cluster = Cluster(cfg, run_dir)
    except BaseException:
        if own_dir:  # a bad topology or option: no temporary directory left behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    code = 0
    try:
        starting = loop.create_task(cluster.start())
        stopped = loop.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting
            print("kvcompass up: interrupted during startup", file=sys.stderr)
        else:
            try:
                state = starting.result()
            except (RuntimeError, OSError) as e:
                print(f"kvcompass up: startup failed: {e}", file=sys.stderr)
                code = 1
            else:
                state["restarts"], state["left_down"] = {}, []
                cluster.state = state
                if state_file is not None:
                    cluster.state_file = state_file
                    _write_json(cluster.state_file, state)
                print(format_endpoints(state), flush=True)
                await stop.wait()
        stopped.cancel()
    finally:
        rc = await cluster.stop()
        if state_file is not None:
            state_file.unlink(missing_ok=True)  # its endpoints and pids are gone
        if own_dir and code == 0 and rc == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
    return code or rc
