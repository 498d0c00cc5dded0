"""The service units we ship for real deployments (deploy/systemd, deploy/kubernetes): every
command line parses with kvcompass's own parser, every process restarts when it dies, and every
probe asks an endpoint the process serves on a port it listens on."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from kvcompass.cli import build_parser
from kvcompass.discovery.topology import load_topology

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
SYSTEMD = ROOT / "deploy" / "systemd"
K8S = ROOT / "deploy" / "kubernetes" / "kvcompass.yaml"
# A sample instance name per unit (%i): a shard, a region, a worker.
INSTANCES = {"kvcompass-maintenance@.service": "0", "kvcompass-edge@.service": "us", "kvcompass-agent@.service": "us-0"}


def _parse(argv: list[str]) -> Any:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:  # argparse's way of refusing
        raise AssertionError(f"kvcompass refuses {argv}: exit {e.code}") from None


def _env_example() -> dict[str, str]:
    out = {}
    for line in (SYSTEMD / "kvcompass.env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v
    return out


def test_every_systemd_unit_parses_and_restarts() -> None:
    env = _env_example()
    units = sorted(SYSTEMD.glob("*.service"))
    assert {u.name for u in units} == set(INSTANCES)
    for unit in units:
        cp = configparser.ConfigParser(interpolation=None, strict=True)
        cp.optionxform = str  # type: ignore[assignment,method-assign]
        cp.read_string(unit.read_text())
        svc = cp["Service"]
        assert svc["Restart"] == "always" and float(svc["RestartSec"]) <= 1, unit.name
        # Restart limits are [Unit] keys: in [Service] systemd ignores the window (found in
        # review: `systemd-analyze verify` says so), and a crash-looping unit never fails.
        assert "StartLimitIntervalSec" not in svc and "StartLimitBurst" not in svc, unit.name
        assert int(cp["Unit"]["StartLimitIntervalSec"]) == 60 and int(cp["Unit"]["StartLimitBurst"]) == 5, unit.name
        assert svc["KillSignal"] == "SIGTERM" and svc["EnvironmentFile"] == "/etc/kvcompass/kvcompass.env"
        cmd = svc["ExecStart"].replace("%i", INSTANCES[unit.name])
        used = set(re.findall(r"\$\{(\w+)\}", cmd))
        assert used <= set(env), (unit.name, used - set(env))
        cmd = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], cmd)
        argv = shlex.split(cmd)
        assert argv[:2] == ["/usr/bin/env", "kvcompass"], argv
        args = _parse(argv[2:])
        assert args.command == unit.name.split("-", 1)[1].split("@")[0]
        if args.command == "edge":
            assert svc["ExecReload"] == "/bin/kill -HUP $MAINPID"  # the keys file reload
            assert args.api_keys_file and not args.open  # never open in production
        if args.command == "maintenance":
            assert args.state_file and "%i" not in args.state_file  # one state file per shard
    # The units name shards 0..N-1 in order, N being the example topology's.
    assert len(env["KVCOMPASS_MAINTENANCE"].split(",")) == load_topology("testbed-14x3").shards


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return list(spec.get("containers", []))


def _argv(c: dict[str, Any], hostname: str) -> list[str] | None:
    cmd, args = c.get("command", []), c.get("args", [])
    if cmd == ["kvcompass"]:
        return list(args)
    if cmd == ["/bin/sh", "-c"]:
        text = args[0].replace('"${HOSTNAME##*-}"', hostname.rsplit("-", 1)[1]).replace("${HOSTNAME}", hostname)
        argv = shlex.split(text)
        assert argv[:2] == ["exec", "kvcompass"], argv
        return argv[2:]
    return None


def test_kubernetes_commands_parse_and_probes_hit_served_ports() -> None:
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    shards = load_topology("testbed-14x3").shards
    seen: set[str] = set()
    for doc in docs:
        name = doc["metadata"]["name"]
        for c in _containers(doc):
            argv = _argv(c, f"{name}-2")
            if argv is None:
                continue
            args = _parse(argv)
            seen.add(args.command)
            ports = {p["containerPort"] for p in c["ports"]}
            served = {"/healthz": args.metrics_port, "/metrics": args.metrics_port}
            if args.command == "edge":
                served["/health"] = args.http_port  # the door's readiness
                assert {args.http_port, args.grpc_port} <= ports
                assert args.api_keys_file and not args.open
            if args.command == "maintenance":
                assert doc["spec"]["replicas"] == shards and args.shard == 2  # the pod's ordinal
                assert {args.port} <= ports
            if args.command in ("edge", "agent"):
                assert len(args.maintenance.split(",")) == shards
            for probe in ("readinessProbe", "livenessProbe"):
                get = c[probe]["httpGet"]
                assert get["path"] in served, (name, probe, get)
                assert get["port"] == served[get["path"]] and get["port"] in ports, (name, probe, get)
            # Liveness must not kill a process that is alive but not ready (a unit recovering,
            # an edge syncing its views): it asks /metrics, which answers whenever it runs.
            assert c["livenessProbe"]["httpGet"]["path"] == "/metrics"
    assert seen == {"maintenance", "edge", "agent"}


def test_the_probed_endpoints_exist() -> None:
    # The paths the units probe, as the servers register them: the metrics listener every
    # process runs, and the door of an edge (a not-ready metrics listener answers 503, the
    # liveness path 200 regardless).
    import asyncio

    import aiohttp
    from prometheus_client import CollectorRegistry

    from kvcompass.discovery.plane import LocalPlane
    from kvcompass.services.http_door import make_app
    from kvcompass.services.metrics import MetricsServer, metrics_app

    def paths(app: Any) -> set[str]:
        return set(app.paths)

    assert {"/healthz", "/metrics"} <= paths(metrics_app(CollectorRegistry(), lambda: False))
    topo = load_topology("testbed-14x3")
    edge = LocalPlane(topo).edges["us"]
    assert "/health" in paths(make_app(edge, {}, None))

    async def probe() -> tuple[int, int]:
        async with MetricsServer(CollectorRegistry(), lambda: False) as m, aiohttp.ClientSession() as c:
            base = f"http://127.0.0.1:{await m.start()}"
            async with c.get(base + "/healthz") as a, c.get(base + "/metrics") as b:
                return a.status, b.status

    assert asyncio.run(probe()) == (503, 200)
