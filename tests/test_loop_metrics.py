"""The door's and the worker's lock-free metrics expose what prometheus_client's own would."""

from __future__ import annotations

import re
from types import ModuleType

import prometheus_client as pc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvcompass.services import loop_metrics as lm


def _build(mod: ModuleType, reg: CollectorRegistry) -> None:
    c = mod.Counter("x_requests", "requests", ["endpoint", "status"], registry=reg)
    c.labels("a", "200").inc()
    c.labels("a", "200").inc(2)
    c.labels("b", 404).inc()  # a non-string label value, converted
    c.labels(endpoint="c", status="500").inc(0.5)
    # Equal values that print differently are different series, as str() makes them.
    c.labels(1, 1.0).inc()
    c.labels(True, 1).inc()
    c.labels(1.0, True).inc()
    mod.Counter("y_total", "a name given with _total", registry=reg).inc(5)
    g = mod.Gauge("z_inflight", "up and down", registry=reg)
    g.inc()
    g.inc(3)
    g.dec()
    mod.Gauge("w_queue", "labelled", ["worker"], registry=reg).labels("w1").set(3.5)
    mod.Gauge("f_gauge", "read at scrape", registry=reg).set_function(lambda: 7)
    h = mod.Histogram("h_seconds", "labelled histogram", ["ep"], buckets=(0.01, 0.1, 1), registry=reg)
    for v in (0.005, 0.01, 0.05, 0.1, 0.5, 5.0):  # 0.01 and 0.1 sit on bounds: le is inclusive
        h.labels("x").observe(v)
    h2 = mod.Histogram("h2_seconds", "plain histogram", buckets=(1e-5, 1e-3, float("inf")), registry=reg)
    h2.observe(1e-5)
    h2.observe(2.0)
    mod.Counter("empty", "no child yet", ["k"], registry=reg)


def _without_created(text: str) -> str:
    return re.sub(r"(_created(\{[^}]*\})? )\S+", r"\1T", text)


def test_the_exposition_is_prometheus_clients_own_but_for_creation_times() -> None:
    native, ours = CollectorRegistry(), CollectorRegistry()
    _build(pc, native)
    _build(lm, ours)
    a, b = generate_latest(native).decode(), generate_latest(ours).decode()
    assert "x_requests_created" in b and "h_seconds_created" in b
    assert _without_created(a) == _without_created(b)
    assert ours.get_sample_value("x_requests_total", {"endpoint": "b", "status": "404"}) == 1.0
    assert ours.get_sample_value("h_seconds_bucket", {"ep": "x", "le": "0.1"}) == 4.0
    assert ours.get_sample_value("h_seconds_count", {"ep": "x"}) == 6.0
    assert ours.get_sample_value("f_gauge") == 7.0


def test_the_created_series_follow_prometheus_clients_switch() -> None:
    pc.disable_created_metrics()
    try:
        native, ours = CollectorRegistry(), CollectorRegistry()
        _build(pc, native)
        _build(lm, ours)
        a, b = generate_latest(native).decode(), generate_latest(ours).decode()
        assert "_created" not in b and a == b
    finally:
        pc.enable_created_metrics()
    assert "_created" in generate_latest(ours).decode()


def test_a_child_is_made_once_per_label_values() -> None:
    c = lm.Counter("x", "x", ["status"], registry=CollectorRegistry())
    assert c.labels("200") is c.labels("200") is c.labels(200) is c.labels(status="200")
    assert c.labels("200") is not c.labels("404")
    c.labels(200).inc()
    c.labels("200").inc()
    assert c.labels(status="200").value == 2
    c.clear()  # prometheus_client's clear: every series gone, made afresh on next use
    assert c.labels("200").value == 0


def test_misuse_is_refused_as_prometheus_client_refuses_it() -> None:
    reg = CollectorRegistry()
    c = lm.Counter("x", "x", ["a", "b"], registry=reg)
    with pytest.raises(ValueError, match="takes 2 label values"):
        c.labels("only one")
    with pytest.raises(ValueError, match="takes the labels"):
        c.labels(a="1", c="2")
    with pytest.raises(ValueError, match="non-negative"):
        c.labels("1", "2").inc(-1)
    g = lm.Gauge("g", "g", registry=reg)
    with pytest.raises(ValueError, match="no labels"):
        g.labels("x")
    with pytest.raises(ValueError, match="no labels"):
        g.labels()
    with pytest.raises(ValueError, match="update a child from labels"):
        c.inc()
    with pytest.raises(ValueError, match="update a child from labels"):
        lm.Histogram("h_labelled", "x", ["ep"], registry=reg).observe(1.0)
    with pytest.raises(ValueError, match="invalid metric name"):
        lm.Counter("bad-name", "x", registry=reg)
    with pytest.raises(ValueError, match="invalid label name"):
        lm.Counter("y", "x", ["bad-label"], registry=reg)
    with pytest.raises(ValueError, match="'le'"):
        lm.Histogram("h", "x", ["le"], registry=reg)
    with pytest.raises(ValueError, match="increasing order"):
        lm.Histogram("h", "x", buckets=(1.0, 0.5), registry=reg)
    # A second metric of the same name in one registry is refused by the registry.
    with pytest.raises(ValueError, match="Duplicated"):
        lm.Counter("x", "again", registry=reg)


def test_state_positions_are_values_not_labels() -> None:
    """Review, twenty-fifth session: kvcompass_state_digest carried epoch and seq as labels, so
    every flush made a new series (cardinality driven by client traffic). Now three gauges per
    (table, shard), read back together by chaos --processes."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvcompass.chaos.processes import parse_states
    from kvcompass.services.metrics import export_states

    rows = [(0, 1, 7, 3, bytes(range(32)))]
    reg = CollectorRegistry()
    export_states(reg, "edge", lambda: rows)
    series = []
    for seq in (3, 12, 17):
        rows[0] = (0, 1, 7, seq, bytes(range(32)))
        text = generate_latest(reg).decode()
        series.append({line.rpartition(" ")[0] for line in text.splitlines() if line.startswith("kvcompass_state_")})
        assert parse_states(text) == {(0, 1): (7, seq, int.from_bytes(bytes(range(6)), "big"))}
    assert series[0] == series[1] == series[2] and len(series[0]) == 3  # the same three series
