"""The observation port (shared/metrics_server.py) and the stats exporter (shared/metrics.py),
without Redis or a database: routes, content negotiation, liveness, readiness answers
(redacted, bounded in time) and counters read from stats dataclasses at scrape time."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from outbox_relay.shared import metrics_server
from outbox_relay.shared.errors import UnavailableError
from outbox_relay.shared.metrics import Naming, Source, StatsCollector, discover
from outbox_relay.shared.metrics_server import MetricsServer
from outbox_relay.shared.periodic import Periodic


def get(port: int, path: str, accept: str = "") -> tuple[int, str, str]:
    """``(status, content type, body)`` of a GET (errors included)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=False)


@pytest.fixture
def server(registry: CollectorRegistry) -> Iterator[MetricsServer]:
    srv = MetricsServer("127.0.0.1", 0, registry)
    yield srv
    srv.stop()


def test_port_zero_means_no_server(registry: CollectorRegistry) -> None:
    assert metrics_server.serve("127.0.0.1", 0, registry) is None


def test_an_unknown_path_is_404(server: MetricsServer) -> None:
    status, content_type, body = get(server.port, "/nope")
    assert status == 404
    assert content_type == "application/json"
    assert json.loads(body) == {"error": "not_found"}


def test_metrics_are_openmetrics_unless_the_classic_format_is_asked_for(
    server: MetricsServer, registry: CollectorRegistry
) -> None:
    registry.register(StatsCollector("outbox_test", lambda: [Source(lambda: Stats(delivered=3))]))
    status, content_type, body = get(server.port, "/metrics")
    assert status == 200
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith("# EOF\n")
    assert "outbox_test_delivered_total 3.0" in body
    status, content_type, body = get(server.port, "/metrics", accept="text/plain;version=0.0.4")
    assert content_type.startswith("text/plain")
    assert "# EOF" not in body
    assert "outbox_test_delivered_total 3.0" in body


def test_healthz_turns_503_when_the_loop_stops_stamping(registry: CollectorRegistry) -> None:
    age = {"s": 1.0}
    srv = MetricsServer("127.0.0.1", 0, registry, heartbeat=lambda: age["s"], stale_after_s=30)
    try:
        status, _, body = get(srv.port, "/healthz")
        assert status == 200
        assert json.loads(body)["status"] == "ok"
        age["s"] = 31.0
        status, _, body = get(srv.port, "/healthz")
        assert status == 503
        assert json.loads(body) == {"status": "stale", "last_loop_age_s": 31.0,
                                    "stale_after_s": 30}
    finally:
        srv.stop()


def test_readyz_names_each_failing_check_redacted_and_never_hangs(
    registry: CollectorRegistry,
) -> None:
    release = threading.Event()

    def down() -> None:
        raise UnavailableError("cannot reach redis://user:secret@db.example:6379/0")

    def foreign() -> None:
        raise RuntimeError("password=hunter2 in a driver message")

    checks = {"ok": lambda: None, "redis": down, "driver": foreign, "hung": release.wait}
    srv = MetricsServer("127.0.0.1", 0, registry, checks=checks, check_timeout_s=0.2)
    try:
        status, _, body = get(srv.port, "/readyz")
        answer = json.loads(body)
        assert status == 503
        assert answer["ok"] == "ok"
        assert answer["redis"] == "unavailable: cannot reach redis://user:***@db.example:6379/0"
        assert answer["driver"] == "error: RuntimeError"
        assert answer["hung"].startswith("timeout")
        assert "secret" not in body and "hunter2" not in body
    finally:
        release.set()
        srv.stop()


def test_readyz_is_200_when_every_check_passes(registry: CollectorRegistry) -> None:
    srv = MetricsServer("127.0.0.1", 0, registry, checks={"a": lambda: None, "b": lambda: 1})
    try:
        status, _, body = get(srv.port, "/readyz")
        assert (status, json.loads(body)) == (200, {"a": "ok", "b": "ok"})
    finally:
        srv.stop()


@dataclass
class Inner:
    refills: int = 0


@dataclass
class Stats:
    delivered: int = 0
    covered: int = 0  # exported elsewhere: skipped
    added_later: int = 0  # no name mapping: exported under its own name
    skipped: dict[str, int] = field(default_factory=dict)
    nested: Inner = field(default_factory=Inner)
    findings: list[str] = field(default_factory=list)  # not a counter: left out


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.openmetrics.exposition import generate_latest

    text = generate_latest(registry).decode()  # type: ignore[no-untyped-call]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_stats_fields_are_counters_read_at_scrape_time(registry: CollectorRegistry) -> None:
    stats = Stats()
    naming = Naming("", {"delivered": ("rows_delivered", "Rows delivered.")},
                    frozenset({"covered"}))
    task = Periodic("trim", 10.0, lambda: None)
    registry.register(StatsCollector("outbox_x", lambda: [Source(lambda: stats, naming)],
                                     labels={"group": "g"}, periodic=lambda: [task]))
    stats.delivered, stats.covered, stats.added_later = 5, 7, 2
    stats.skipped["stale"] = 4
    stats.nested.refills = 1
    task.maybe_run()
    got = samples(registry)
    g = (("group", "g"),)
    assert got[("outbox_x_rows_delivered_total", g)] == 5
    assert got[("outbox_x_added_later_total", g)] == 2
    assert got[("outbox_x_skipped_total", (("group", "g"), ("reason", "stale")))] == 4
    assert got[("outbox_x_nested_refills_total", g)] == 1
    assert got[("outbox_x_housekeeping_runs_total", (("group", "g"), ("task", "trim")))] == 1
    assert not any("covered" in name or "findings" in name for name, _ in got)


class Component:
    def __init__(self) -> None:
        self.stats = Inner(refills=2)


class Daemon:
    def __init__(self) -> None:
        self.stats = Stats(delivered=1)
        self.repairer = Component()
        self.prune_stats: Any = None  # set later, as retention does
        self.alias_stats = self.stats  # the same object twice is exported once


def test_discover_finds_stats_added_after_start(registry: CollectorRegistry) -> None:
    daemon = Daemon()
    registry.register(StatsCollector(
        "outbox_d", lambda: discover(daemon, {"repairer": Naming("repair")})))
    assert ("outbox_d_pruned_rows_total", ()) not in samples(registry)
    daemon.prune_stats = PrunedStats(pruned_rows=9)
    got = samples(registry)
    assert got[("outbox_d_delivered_total", ())] == 1
    assert got[("outbox_d_repair_refills_total", ())] == 2
    assert got[("outbox_d_prune_pruned_rows_total", ())] == 9
    assert ("outbox_d_alias_delivered_total", ()) not in got


@dataclass
class PrunedStats:
    pruned_rows: int = 0
