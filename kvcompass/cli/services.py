"""``kvcompass maintenance | edge | agent | worker``: each runs one process of the discovery
plane, with the lifecycle every KVCompass process shares (:mod:`kvcompass.services.lifecycle`:
ports chosen at bind time and told in a ready line, drain on SIGTERM/SIGINT or when the
supervising parent dies, Prometheus ``/metrics`` and a health endpoint)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvcompass.errors import KVCompassError, UsageError
from kvcompass.services import lifecycle
from kvcompass.services.lifecycle import announce, on_signals, stop_on_signals
from kvcompass.services.wire import HEALTH_PATH, LOAD_PATH

__all__ = ["TOPOLOGY_HELP", "add_parsers", "parse_hostports", "tls_args"]

TOPOLOGY_HELP = "a built-in topology (testbed-14x3, ...) or a TOML file"


# -- argument parsing ------------------------------------------------------------------------------


def add_parsers(sub: Any) -> None:
    """``kvcompass maintenance | edge | agent | worker`` on ``kvcompass``'s subparsers."""
    m = sub.add_parser("maintenance", help="run the maintenance unit (single writer) of one shard as a gRPC service")
    m.add_argument("--shard", type=int, required=True)
    m.add_argument("--shards", type=int, default=None, help="shard count; must match the topology's (default: the topology's)")
    m.add_argument("--topology", required=True, metavar="NAME_OR_PATH", help=TOPOLOGY_HELP)
    _listen_args(m, port="--port", port_help="gRPC port (0: a free port)")
    m.add_argument("--state-file", default=None, metavar="PATH", help="persist the shard here and recover it on restart")
    m.add_argument("--tokens-file", default=None, metavar="JSON",
                   help='per-worker credentials {"us-0": "TOKEN", ...}: an agent must present its worker\'s token and may write only its fields')
    m.add_argument("--max-keys", type=int, default=None, metavar="N", help="refuse (RESOURCE_EXHAUSTED) batches that would grow a table past N keys")
    m.add_argument("--memory-budget", type=int, default=None, metavar="BYTES",
                   help="refuse (RESOURCE_EXHAUSTED) batches adding keys while the shard's tables hold this many bytes or more")
    m.add_argument("--view-budget", type=int, default=None, metavar="BYTES",
                   help="likewise per table, for the bytes each edge replica of it holds")
    tls_args(m)

    e = sub.add_parser("edge", help="run an edge: index replica, gRPC Route API and the OpenAI-compatible HTTP door")
    e.add_argument("--region", required=True)
    e.add_argument("--topology", required=True, metavar="NAME_OR_PATH", help=TOPOLOGY_HELP)
    e.add_argument("--routing", choices=("kvcompass", "local"), default="kvcompass", help="kvcompass: joint score over every region; local: region-local cache-aware routing")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--http-port", type=int, default=0)
    e.add_argument("--reuse-port", action="store_true",
                   help="bind --http-port with SO_REUSEPORT, so several edge processes of one region serve one door port from several cores "
                        "(each with its own views, fed by the units; the kernel spreads connections among them; give each its own --grpc-port and --metrics-port)")
    e.add_argument("--grpc-port", type=int, default=0)
    e.add_argument("--metrics-port", type=int, default=0)
    e.add_argument("--maintenance", required=True, metavar="HOST:PORT,...", help="the units of shards 0..N-1, in shard order")
    e.add_argument("--workers-file", default=None, metavar="JSON", help='worker id -> base URL: {"us-0": "http://127.0.0.1:8000", ...}')
    e.add_argument("--worker", action="append", default=[], metavar="ID=URL", help="one worker's base URL (repeatable)")
    e.add_argument("--wan-delay", type=float, nargs="?", const=1.0, default=0.0, metavar="SCALE",
                   help="emulate the topology's one-way WAN delay (RTT/2) times SCALE on each hop to a worker (bare flag: 1)")
    e.add_argument("--peers", default="", metavar="REGION=HOST:PORT,...", help="other regions' edge gRPC endpoints (queue exchange)")
    e.add_argument("--peers-file", default=None, metavar="JSON", help="like --peers, read from a JSON object once the file appears")
    e.add_argument("--door-peers", default="", metavar="REGION=URL,...",
                   help="other regions' door base URLs: requests routed there go through that door, which may hand them to a less loaded worker of its region")
    e.add_argument("--door-peers-file", default=None, metavar="JSON", help="like --door-peers, read from a JSON object once the file appears")
    e.add_argument("--no-handoff", action="store_true", help="forward requests routed to another region straight to the worker, not through that region's door")
    e.add_argument("--drain-grace", type=float, default=30.0, metavar="S", help="seconds in-flight requests may take to finish on SIGTERM")
    e.add_argument("--header-timeout", type=float, default=10.0, metavar="S", help="close a new connection whose first request head has not arrived after S seconds (slowloris)")
    e.add_argument("--max-connections-per-address", type=int, default=1024, metavar="N", help="open connections one client address may hold; past it, 503 and closed")
    e.add_argument("--model", default="llama-3.1-8b", metavar="NAME[,NAME...]",
                   help="the model names the door serves (the first answers requests naming none); each must be the --model its workers' agents key events under")
    e.add_argument("--allowed-origins", default="*", metavar="ORIGIN,...",
                   help="origins browsers may call the door from (CORS): '*' any (vLLM's default), a comma-separated list, or '' none")
    e.add_argument("--max-inflight-per-client", type=int, default=256, metavar="N",
                   help="requests one client (API key, or address without keys) may have in flight; past it, 429")
    e.add_argument("--queue-poll", type=float, default=0.1, metavar="S",
                   help="read own-region workers' queues (GET /kvcompass/load) every S seconds; 0: only from responses (default 0.1, Delta)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--view-budget", type=int, default=None, metavar="BYTES", help="report views at or over this size (metric kvcompass_over_budget{scope=\"view\"}); maintenance units enforce budgets")
    auth = e.add_mutually_exclusive_group(required=True)
    auth.add_argument("--api-keys-file", default=None, metavar="JSON",
                      help="the door's API keys (hashed; kvcompass.services.api_keys): completions need Authorization: Bearer KEY, "
                      "the tenant comes from the key; reloaded on SIGHUP")
    auth.add_argument("--open", action="store_true", help="serve completions without keys, any client acting as any tenant it names (local experiments only)")
    e.add_argument("--peer-key-file", default=None, metavar="PATH", help="the key this door presents to other regions' doors on hand-offs (an any-tenant key of theirs)")
    tls_args(e, also="the HTTP door and the clients to maintenance units, peer edges and https:// workers")

    a = sub.add_parser("agent", help="run a worker agent: engine KV events (ZMQ) -> key ops -> maintenance units")
    a.add_argument("--worker", required=True)
    a.add_argument("--events", required=True, metavar="tcp://HOST:PORT", help="the engine's KV-event PUB endpoint")
    a.add_argument("--replay", default=None, metavar="tcp://HOST:PORT", help="the engine's replay ROUTER endpoint")
    a.add_argument("--topology", required=True, metavar="NAME_OR_PATH", help=TOPOLOGY_HELP)
    a.add_argument("--maintenance", required=True, metavar="HOST:PORT,...")
    a.add_argument("--model", default="llama-3.1-8b", help="the namespace's model (the door's default model)")
    a.add_argument("--tenant", default="public", help="the namespace's tenant (the door's default tenant)")
    a.add_argument(
        "--heartbeat-s",
        type=float,
        default=2.0,
        metavar="S",
        help="after S seconds without a batch, send empty ones so a unit restored from an older state asks for a full re-report (0: off; default 2)",
    )
    a.add_argument("--host", default="127.0.0.1", help="where the metrics endpoint listens")
    a.add_argument("--metrics-port", type=int, default=0)
    tok = a.add_mutually_exclusive_group()
    tok.add_argument("--token", default=None, help="this worker's credential (visible in ps: prefer --token-file)")
    tok.add_argument("--token-file", default=None, metavar="PATH", help="a file holding this worker's credential")
    tls_args(a, client_only=True)

    w = sub.add_parser("worker", help="run an emulated vLLM worker (OpenAI API, prefix cache, KV events on ZMQ)")
    w.add_argument("--emulate", action="store_true", help="required: the only worker kvcompass runs itself is the emulated one")
    w.add_argument("--worker", required=True)
    w.add_argument("--topology", required=True, metavar="NAME_OR_PATH", help=TOPOLOGY_HELP)
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=0)
    w.add_argument("--events-port", type=int, default=0)
    w.add_argument("--replay-port", type=int, default=0)
    w.add_argument("--time-scale", type=float, default=1.0, metavar="S", help="wall seconds per modelled second (0: no sleeping)")
    w.add_argument("--policy", choices=("lru", "lfu"), default="lru")
    tls_args(w, also="its OpenAI HTTP API (the ZMQ event endpoints stay plain, as vLLM's)")
    m.set_defaults(func=_run(_maintenance))
    e.set_defaults(func=_run(_edge))
    a.set_defaults(func=_run(_agent))
    w.set_defaults(func=_run(_worker))


def _run(main: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    """One service's asyncio entry point as a command handler."""

    def run(args: argparse.Namespace) -> int:
        return int(lifecycle.run(main(args)))

    return run

def tls_args(p: argparse.ArgumentParser, *, client_only: bool = False, also: str = "") -> None:
    """The TLS flags (:class:`kvcompass.services.tls.TLSConfig`); PEM files."""
    t = p.add_argument_group("TLS", f"TLS on every connection this process makes or serves{' (' + also + ')' if also else ''}")
    who = "presented to servers that require client certificates" if client_only else "this process's certificate (served, and presented as a client)"
    t.add_argument("--tls-cert", default=None, metavar="PEM", help=who)
    t.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert (default: inside --tls-cert)")
    t.add_argument("--tls-ca", default=None, metavar="PEM", help="CA bundle that verifies peers (servers: the system trust store if omitted)")
    if not client_only:
        t.add_argument("--tls-client-auth", action="store_true", help="mutual TLS: require client certificates signed by --tls-ca")


def _tls(args: argparse.Namespace) -> Any:
    from kvcompass.services.tls import TLSConfig

    return TLSConfig(args.tls_cert, args.tls_key, args.tls_ca, bool(getattr(args, "tls_client_auth", False)))


def _read_secret(path: str, what: str) -> str:
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise UsageError(f"{what} {path}: {e.strerror or e}") from None
    if not text:
        raise UsageError(f"{what} {path} is empty")
    return text


def load_tokens(path: str, workers: Any = None) -> dict[str, str]:
    """``--tokens-file``: a JSON object of worker id -> non-empty token string (every worker
    named must be one of ``workers`` when given)."""
    try:
        obj = json.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"--tokens-file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise UsageError(f"--tokens-file {path}: not JSON ({e})") from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in obj.items()):
        raise UsageError(f"--tokens-file {path}: must be a JSON object of worker id -> non-empty token string")
    if workers is not None:
        unknown = sorted(set(obj) - set(workers))
        if unknown:
            raise UsageError(f"--tokens-file {path}: {unknown} are not indexed workers of the topology")
    return dict(obj)


def _listen_args(p: argparse.ArgumentParser, *, port: str, port_help: str) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(port, type=int, default=0, help=port_help)
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics and /healthz (0: a free port)")


# -- shared option parsing ------------------------------------------------------------------------


def parse_hostports(text: str, what: str = "--maintenance") -> list[str]:
    """``host:port,host:port`` -> the list, each checked."""
    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise UsageError(f"{what}: give at least one HOST:PORT")
    for t in out:
        host, sep, port = t.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"{what}: {t!r} is not HOST:PORT")
    return out


def _load(topology: str) -> Any:
    from kvcompass.discovery.topology import load_topology

    return load_topology(topology)


def _door_tokenizer(topo: Any) -> Any:
    """The topology's tokenizer as the door takes it: its path (loaded by the door), or, with
    the operator's chat template, the tokenizer built with it."""
    if not topo.chat_template:
        return topo.tokenizer or None
    from kvcompass.engine.tokenizer import load_tokenizer

    return load_tokenizer(topo.tokenizer, topo.chat_template)


def _units(text: str, shards: int) -> dict[int, str]:
    addrs = parse_hostports(text)
    if len(addrs) != shards:
        raise UsageError(f"--maintenance: the topology has {shards} shards, so give {shards} HOST:PORT (shard order), got {len(addrs)}")
    return dict(enumerate(addrs))


def check_state_dir(flag: str, path: str | None) -> None:
    """A file the process will write: its directory must exist and be writable, checked before
    anything starts (found in review: a maintenance unit started, said it was ready and never
    persisted anything; ``kvcompass up`` came up whole, then failed naming a temporary file)."""
    if path is None:
        return
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise UsageError(f"{flag} {path!r}: its directory does not exist")
    if not os.access(d, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path!r}: its directory is not writable")


def _check_port(name: str, v: int) -> None:
    if not 0 <= v < 65536:
        raise UsageError(f"{name} must be 0..65535, got {v}")


# -- kvcompass maintenance ------------------------------------------------------------------------------


async def _maintenance(args: argparse.Namespace) -> int:
    from kvcompass.discovery.params import EdgeParams, layout_for
    from kvcompass.discovery.plan import LevelPlan
    from kvcompass.services.maintenance_service import MaintenanceConfig, MaintenanceEndpoints, serve_maintenance

    topo = _load(args.topology)
    layout = layout_for(LevelPlan(topo).layout(), EdgeParams())
    if args.shards is not None and args.shards != layout.shards:
        raise UsageError(f"--shards {args.shards}: the topology {topo.name!r} has {layout.shards} shards (set shards in its TOML)")
    if not 0 <= args.shard < layout.shards:
        raise UsageError(f"--shard must be 0..{layout.shards - 1}, got {args.shard}")
    _check_port("--port", args.port)
    _check_port("--metrics-port", args.metrics_port)
    check_state_dir("--state-file", args.state_file)

    tokens = load_tokens(args.tokens_file, layout.workers) if args.tokens_file is not None else None
    for name in ("max_keys", "memory_budget", "view_budget"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    tls = _tls(args)
    ssl_context = tls.server_or_none("grpc")
    config = MaintenanceConfig(state_path=args.state_file, tokens=tokens, memory_budget_bytes=args.memory_budget, view_budget_bytes=args.view_budget)

    def ready(ends: MaintenanceEndpoints) -> None:
        announce("maintenance", shard=ends.shard, grpc=ends.grpc, metrics=ends.metrics, tls=ssl_context is not None, auth=tokens is not None)

    stop = asyncio.Event()
    async with stop_on_signals(stop):
        await serve_maintenance(
            layout, args.shard, host=args.host, port=args.port, metrics_port=args.metrics_port,
            config=config, on_ready=ready, stop=stop, ssl_context=ssl_context, max_keys=args.max_keys,
        )
    return 0


# -- kvcompass edge ---------------------------------------------------------------------------------------


def _worker_urls(args: argparse.Namespace) -> dict[str, str]:
    urls: dict[str, str] = {}
    if args.workers_file is not None:
        obj = json.loads(Path(args.workers_file).read_text())
        if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in obj.items()):
            raise UsageError(f"--workers-file {args.workers_file}: must be a JSON object of worker id -> URL")
        urls.update(obj)
    for item in args.worker:
        wid, sep, url = item.partition("=")
        if not sep or not wid or not url.startswith(("http://", "https://")):
            raise UsageError(f"--worker {item!r}: give ID=http://HOST:PORT")
        urls[wid] = url
    return urls


def _door_keys(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The door's key store (None with --open) and its peer key."""
    from kvcompass.services.api_keys import KeyStore

    keys = None
    if args.api_keys_file is not None:
        try:
            keys = KeyStore.load(args.api_keys_file)
        except KVCompassError as e:
            raise UsageError(str(e)) from None
        if not len(keys):
            raise UsageError(f"--api-keys-file {args.api_keys_file}: no key in it, so no request could be served")
    peer_key = None
    if args.peer_key_file is not None:
        try:
            peer_key = Path(args.peer_key_file).read_text().strip()
        except OSError as e:
            raise UsageError(f"--peer-key-file: {e}") from None
        if not peer_key:
            raise UsageError(f"--peer-key-file {args.peer_key_file} is empty")
    return keys, peer_key


def _no_keys_to_reload() -> None:
    print("kvcompass edge: SIGHUP: no keys file to reload (--open)", file=sys.stderr, flush=True)


def _reload_keys(keys: Any) -> Callable[[], None]:
    """Re-read the keys file (on SIGHUP: connections stay up; a malformed file is logged and the
    keys in force stay)."""

    def reload() -> None:
        try:
            n = keys.reload()
        except KVCompassError as e:
            print(f"kvcompass edge: SIGHUP: keeping the keys in force: {e}", file=sys.stderr, flush=True)
        else:
            print(f"kvcompass edge: SIGHUP: {n} API keys in force", file=sys.stderr, flush=True)

    return reload


def _door_peers(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        region, sep, url = item.partition("=")
        if not sep or not region or not url.startswith(("http://", "https://")):
            raise UsageError(f"--door-peers {item!r}: give REGION=http://HOST:PORT")
        out[region] = url
    return out


async def _wait_door_peers(path: str, door: Any, stop: asyncio.Event) -> None:
    """Give the door its peers once ``kvcompass up`` has written them (ports are known only
    after every edge started)."""
    p = Path(path)
    while not stop.is_set():
        if p.is_file():
            obj = json.loads(p.read_text())
            if isinstance(obj, dict):
                door.door.set_peers({str(r): str(u) for r, u in obj.items()})
                return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


def _peers(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        region, sep, addr = item.partition("=")
        if not sep:
            raise UsageError(f"--peers {item!r}: give REGION=HOST:PORT")
        out[region] = parse_hostports(addr, "--peers")[0]
    return out


async def _edge(args: argparse.Namespace) -> int:
    from kvcompass.discovery.plane import build_edge
    from kvcompass.services.edge_service import EdgeServer, EdgeService, QueueBroadcaster
    from kvcompass.services.edge_sync import EdgeSync
    from kvcompass.services.http_door import DoorConfig, serve_door

    topo = _load(args.topology)
    edge = build_edge(topo, args.region, args.routing, args.seed, handoff=not args.no_handoff)
    units = _units(args.maintenance, edge.layout.shards)
    urls = _worker_urls(args)
    unknown = sorted(set(urls) - set(edge.workers))
    if unknown:
        raise UsageError(f"workers {unknown} are not indexed workers of topology {topo.name!r}")
    if args.wan_delay < 0:
        raise UsageError(f"--wan-delay must be >= 0, got {args.wan_delay}")
    for name in ("--http-port", "--grpc-port", "--metrics-port"):
        _check_port(name, getattr(args, name[2:].replace("-", "_")))
    peers = _peers(args.peers)
    door_peers = _door_peers(args.door_peers)
    regions = {w.id: w.region for w in topo.workers}
    scale = float(args.wan_delay)

    def one_way(a: str, b: str) -> float:
        return float(topo.rtt_ms(a, b)) / 2 * scale

    if args.view_budget is not None and args.view_budget < 1:
        raise UsageError(f"--view-budget must be >= 1, got {args.view_budget}")
    keys, peer_key = _door_keys(args)
    models = tuple(m.strip() for m in args.model.split(","))
    origins = tuple(o.strip() for o in args.allowed_origins.split(",")) if args.allowed_origins.strip() else ()
    try:  # the door's own checks, worded for the flags before anything starts
        DoorConfig(models=models, cors_origins=origins, max_inflight_per_client=args.max_inflight_per_client)
    except ValueError as e:
        raise UsageError(f"--model / --allowed-origins / --max-inflight-per-client: {e}") from None
    tls = _tls(args)
    grpc_server_ssl, grpc_client_ssl = tls.server_or_none("grpc"), tls.client_or_none("grpc")
    http_server_ssl, http_client_ssl = tls.server_or_none("http"), tls.client_or_none("http")
    stop = asyncio.Event()
    sync = EdgeSync(edge, units, name=f"edge-{args.region}", ssl_context=grpc_client_ssl, view_budget_bytes=args.view_budget)
    from kvcompass.services.dashboard import Dashboard

    dashboard = Dashboard(edge)
    dashboard.stale_shards = sync.stale_shards
    # The doors' peer key is the deployment's shared edge secret: hand-offs between doors and
    # the queue exchange between edges both need it.
    # The gRPC Route API takes the doors' keys too: a key routes only in its own tenants'
    # namespaces, so a caller cannot probe another tenant's cache through gRPC either.
    server = EdgeServer(
        EdgeService(edge, peer_token=peer_key, keys=keys, models=models),
        health=sync.health, metrics=sync.metrics, ready=lambda: sync.ready, routes=dashboard.routes(),
    )
    broadcaster: QueueBroadcaster | None = None
    async with stop_on_signals(stop), contextlib.AsyncExitStack() as stack:
        await sync.start()
        stack.push_async_callback(sync.close)
        grpc = await server.start(args.host, args.grpc_port, metrics_port=args.metrics_port, ssl_context=grpc_server_ssl)
        stack.push_async_callback(server.close)
        door = await serve_door(
            edge, urls, _door_tokenizer(topo), host=args.host, port=args.http_port, config=DoorConfig(
                drain_grace_s=args.drain_grace, api_keys=keys, peer_key=peer_key, header_timeout_s=args.header_timeout, max_connections_per_address=args.max_connections_per_address,
                models=models, cors_origins=origins, max_inflight_per_client=args.max_inflight_per_client,
            ),
            regions=regions, wan_one_way_ms=one_way if scale > 0 else None, ssl_context=http_server_ssl, upstream_ssl=http_client_ssl,
            peers=door_peers, reuse_port=args.reuse_port,
        )
        door.door.stale_shards = sync.stale_shards
        dashboard.door = door.door
        # Registered last, so it runs first: the door drains while the index is still current.
        stack.push_async_callback(door.stop)
        local = {w: u for w, u in urls.items() if regions.get(w) == args.region}
        if args.queue_poll > 0 and local:
            poller = asyncio.get_running_loop().create_task(_poll_queues(edge, local, args.queue_poll, http_client_ssl, door.door.hold_unresponsive))
            stack.push_async_callback(_cancel, poller)
        if keys is not None:
            stack.enter_context(on_signals(_reload_keys(keys), (signal.SIGHUP,)))
        else:
            # SIGHUP means "reload the keys" to an operator; an open door has none to reload, and
            # the signal's default action would end the edge.
            stack.enter_context(on_signals(_no_keys_to_reload, (signal.SIGHUP,)))
            print("kvcompass edge: --open: the door serves completions without API keys, and any client may act as any tenant", file=sys.stderr, flush=True)
        announce("edge", region=args.region, http=door.url, grpc=grpc, metrics=server.metrics_url, dashboard=f"{server.metrics_url}/dashboard" if server.metrics_url else None)
        if args.door_peers_file is not None and not door_peers:
            waiter = asyncio.get_running_loop().create_task(_wait_door_peers(args.door_peers_file, door, stop))
            stack.push_async_callback(_cancel, waiter)
        if peers:
            broadcaster = QueueBroadcaster(edge, {r: a for r, a in peers.items() if r != args.region}, ssl_context=grpc_client_ssl, token=peer_key)
        elif args.peers_file is not None:
            broadcaster = await _wait_peers(args.peers_file, edge, args.region, stop, grpc_client_ssl, peer_key)
        if broadcaster is not None:
            await broadcaster.start()
            stack.push_async_callback(broadcaster.close)
            stack.push_async_callback(door.stop)  # still first to run (stopping twice is a no-op)
        await stop.wait()
    return 0


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


UNRESPONSIVE_S = 2.0
"""A worker whose load poll has had no answer for this long is held dead by the door until it
answers again (a hung worker accepts connections, so requests would otherwise wait it out)."""


async def _poll_queues(
    edge: Any, urls: Mapping[str, str], period_s: float, ssl_context: Any = None, hold: Callable[[str, bool], None] | None = None, silent_s: float = UNRESPONSIVE_S
) -> None:
    """Own-region queues read live (paper section 3.4), not only when a response happens to
    carry one: an estimate that only responses refresh stays at its last value for a worker the
    edge stopped choosing *because* it looked busy, and the edge would then keep paying WAN
    round trips to other regions while that worker sits idle. A worker without the endpoint
    (a real vLLM answers it 404) is polled at its ``/health`` instead, for its silence alone
    (found in review: it was dropped, so a hung vLLM kept its share of requests until the head
    deadline, minutes); one without either is dropped. One that does not answer keeps its last
    reading, and ``hold(worker, silent)`` (the door's
    :meth:`~kvcompass.services.http_door.FrontDoor.hold_unresponsive`) hears after every poll
    whether it has been silent for ``silent_s``."""
    import time

    import aiohttp

    left = dict(urls)
    paths = dict.fromkeys(urls, LOAD_PATH)
    timeout = aiohttp.ClientTimeout(total=max(0.05, min(1.0, 2 * period_s)))
    conn = aiohttp.TCPConnector(ssl=ssl_context if ssl_context is not None else True)
    answered = {w: time.monotonic() for w in urls}
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:

        async def one(w: str, url: str) -> None:
            try:
                async with http.get(url.rstrip("/") + paths[w]) as r:
                    answered[w] = time.monotonic()  # an answer, whatever it says
                    if r.status == 404:
                        if paths[w] == LOAD_PATH:
                            paths[w] = HEALTH_PATH
                        else:
                            left.pop(w, None)
                        return
                    if r.status != 200 or paths[w] != LOAD_PATH:
                        return
                    body = await r.json()
                    q = body.get("queue_ms") if isinstance(body, dict) else None
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return
            finally:
                # A worker dropped from polling (404) is told it answered, or it stayed held.
                if hold is not None:
                    hold(w, time.monotonic() - answered[w] >= silent_s)
            if isinstance(q, (int, float)) and not isinstance(q, bool) and q >= 0:
                edge.set_local_queue(w, float(q), time.monotonic())

        try:
            while left:
                await asyncio.gather(*(one(w, u) for w, u in list(left.items())))
                await asyncio.sleep(period_s)
        finally:
            # No poll, no silence to go by: nobody stays held dead for it (found in review).
            if hold is not None:
                for w in urls:
                    hold(w, False)


async def _wait_peers(path: str, edge: Any, region: str, stop: asyncio.Event, ssl_context: Any = None, token: str | None = None) -> Any:
    """The broadcaster to the peers the file names, once ``kvcompass up`` has written it (the
    edges start together, so none knows the others' ports at first); None if stopped first."""
    from kvcompass.services.edge_service import QueueBroadcaster

    p = Path(path)
    while not stop.is_set():
        if p.is_file():
            obj = json.loads(p.read_text())
            if isinstance(obj, dict):
                return QueueBroadcaster(edge, {str(r): str(a) for r, a in obj.items() if r != region and r in set(edge.plan)}, ssl_context=ssl_context, token=token)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
    return None


# -- kvcompass agent -----------------------------------------------------------------------------------------


async def _agent(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry, Counter

    from kvcompass.index_types import Namespace
    from kvcompass.agent.agent import AGENT_COUNTERS
    from kvcompass.services.agent_runner import AgentRunner, agent_for_worker
    from kvcompass.services.ingest_client import IngestClient, SendReport
    from kvcompass.services.metrics import MetricsServer, export_counter

    topo = _load(args.topology)
    _check_port("--metrics-port", args.metrics_port)
    if not (math.isfinite(args.heartbeat_s) and args.heartbeat_s >= 0):
        raise UsageError(f"--heartbeat-s must be a number of seconds >= 0 (0: off), got {args.heartbeat_s}")
    agent = agent_for_worker(topo, args.worker, Namespace(args.model, args.tenant))
    units = _units(args.maintenance, topo.shards)
    token = args.token if args.token is not None else _read_secret(args.token_file, "--token-file") if args.token_file is not None else None
    if token is not None and not token:
        raise UsageError("--token must not be empty")
    client = IngestClient(args.worker, units, agent.on_rejected, token=token, ssl_context=_tls(args).client_or_none("grpc"))
    reg = CollectorRegistry()
    batches = Counter("kvcompass_agent_sent_batches", "Key-op batches acknowledged by maintenance units", ["worker"], registry=reg).labels(args.worker)
    ops = Counter("kvcompass_agent_sent_key_ops", "Key ops acknowledged by maintenance units", ["worker"], registry=reg).labels(args.worker)

    unreachable = Counter("kvcompass_agent_unreachable_shard_sends", "Sends that left a shard out because its maintenance unit was unreachable (re-reported once it is back)", ["worker"], registry=reg).labels(args.worker)

    async def sink(bs: Any) -> SendReport:
        report = await client.send(bs)
        batches.inc(report.batches)
        ops.inc(report.ops)  # acknowledged ops (a reset's, not the batches it replaced)
        if report.unreachable:
            unreachable.inc(len(report.unreachable))
        return report

    runner = AgentRunner(agent, sink, args.events, args.replay, heartbeat_s=args.heartbeat_s if args.heartbeat_s > 0 else None)
    for name, fn in (  # running totals: counters (``_total``), read when scraped
        ("kvcompass_agent_engine_messages", lambda: runner.stats.messages),
        ("kvcompass_agent_malformed_messages", lambda: runner.stats.malformed),
        ("kvcompass_agent_replays", lambda: runner.stats.replays),
        ("kvcompass_agent_replay_failures", lambda: runner.stats.replay_failures),
        ("kvcompass_agent_skipped_events", lambda: runner.stats.events_skipped),
        ("kvcompass_agent_engine_disconnects", lambda: runner.stats.engine_gone),
    ):
        export_counter(reg, name, name.removeprefix("kvcompass_agent_").replace("_", " "), fn, {"worker": args.worker})
    # What the agent made of the stream (found in review: none of it was exported, so a gap the
    # replay could not fill, after which claims may be stale, showed nowhere).
    for field, doc in AGENT_COUNTERS.items():
        export_counter(reg, f"kvcompass_agent_{field}", doc, functools.partial(lambda f: getattr(agent.stats, f), field), {"worker": args.worker})
    metrics = MetricsServer(reg, lambda: runner.running)
    stop = asyncio.Event()
    code = 0
    async with stop_on_signals(stop):
        await runner.start()
        try:
            port = await metrics.start(args.host, args.metrics_port)
            host = f"[{args.host}]" if ":" in args.host else args.host
            announce("agent", worker=args.worker, metrics=f"http://{host}:{port}")
            stopped = asyncio.ensure_future(stop.wait())
            died = asyncio.ensure_future(runner.wait())
            await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if died.done() and not died.cancelled() and died.exception() is not None:
                print(f"kvcompass agent: worker {args.worker}: {died.exception()!r}", file=sys.stderr)
                code = 1
            died.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await died
        finally:
            with contextlib.suppress(Exception):
                await runner.stop()
            await client.close()
            await metrics.close()
    return code


# -- kvcompass worker --emulate -----------------------------------------------------------------------------


async def _worker(args: argparse.Namespace) -> int:
    from kvcompass.services.emulated_worker import EmulatedWorker, WorkerConfig, serve_worker

    if not args.emulate:
        raise UsageError("only --emulate is supported: run vLLM itself and point kvcompass agent at its KV-event endpoint")
    topo = _load(args.topology)
    spec = next((w for w in topo.workers if w.id == args.worker), None)
    if spec is None:
        raise UsageError(f"--worker {args.worker!r} is not a worker of topology {topo.name!r}")
    for name in ("--port", "--events-port", "--replay-port"):
        _check_port(name, getattr(args, name[2:].replace("-", "_")))
    # Per-process block hashes, as vLLM seeds them: the agent must not depend on them.
    cfg = WorkerConfig.from_spec(spec, topo.block_size, time_scale=args.time_scale, policy=args.policy, hash_seed=os.getpid(), tokenizer_path=topo.tokenizer or None, chat_template=topo.chat_template or None)
    ssl_context = _tls(args).server_or_none("http")
    zhost = f"[{args.host}]" if ":" in args.host else args.host

    def ready(w: EmulatedWorker) -> None:
        announce("worker", worker=args.worker, region=spec.region, http=w.http_url, events=w.events_endpoint, replay=w.replay_endpoint)

    stop = asyncio.Event()
    async with stop_on_signals(stop):
        await serve_worker(
            cfg, args.host, args.port,
            events=f"tcp://{zhost}:{args.events_port}" if args.events_port else None,
            replay=f"tcp://{zhost}:{args.replay_port}" if args.replay_port else None,
            ready=ready, stop=stop, handle_signals=False, ssl_context=ssl_context,
        )
    return 0
