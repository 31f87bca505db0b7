"""The observation port (shared/metrics_server.py) and the stats exporter (shared/metrics.py),
without Redis or a database: routes, content negotiation, liveness, readiness answers
(redacted, bounded in time) and counters read from stats dataclasses at scrape time."""

from __future__ import annotations

import json
import logging
import select
import selectors
import socket
import struct
import threading
import time
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
from outbox_relay.shared.settings import DaemonSettings
from tests.helpers import wait_until


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


# -- Hardening (issue 28, finding 3): loopback by default, bounded pool, deadline, no traceback.

HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # no blank line: the head never ends


def test_the_metrics_port_binds_loopback_unless_told(
    registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OUTBOX_METRICS_HOST", raising=False)
    settings = DaemonSettings()
    assert settings.metrics_host == "127.0.0.1"
    srv = MetricsServer(settings.metrics_host, 0, registry)
    try:
        assert srv.host == "127.0.0.1"
    finally:
        srv.stop()
    monkeypatch.setenv("OUTBOX_METRICS_HOST", "0.0.0.0")
    assert DaemonSettings().metrics_host == "0.0.0.0"  # told: e.g. a Kubernetes pod


def drain_until_closed(socks: list[socket.socket], timeout: float) -> dict[socket.socket, float]:
    """Read every socket until the server closes it; when each closed (monotonic)."""
    closed: dict[socket.socket, float] = {}
    with selectors.DefaultSelector() as sel:
        for sock in socks:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while len(closed) < len(socks):
            left = deadline - time.monotonic()
            assert left > 0, f"{len(socks) - len(closed)} connections still open after {timeout}s"
            for key, _ in sel.select(timeout=min(left, 0.5)):
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                try:
                    data = ready.recv(65536)
                except ConnectionError:
                    data = b""
                if not data:
                    closed[ready] = time.monotonic()
                    sel.unregister(ready)
    return closed


@pytest.mark.slow  # waits out the read timeout
def test_half_sent_requests_hold_no_more_than_the_pool_and_are_closed_after_the_timeout(
    registry: CollectorRegistry,
) -> None:
    srv = MetricsServer("127.0.0.1", 0, registry, request_timeout_s=1.0, max_connections=8)
    socks: list[socket.socket] = []
    try:
        before = threading.active_count()
        started = time.monotonic()
        most = 0
        for _ in range(200):
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            socks.append(sock)
            sock.sendall(HALF_SENT)
            most = max(most, threading.active_count())
        wait_until(lambda: srv.accepted + srv.refused == 200, timeout=20,
                   what="every connection taken or refused")
        assert max(most, threading.active_count()) <= before + 8  # the pool, made as needed
        assert srv.refused > 0
        closed = drain_until_closed(socks, timeout=20)
        # Each connection the pool took was held until its deadline, then closed.
        assert sorted(closed.values())[-1] - started >= 0.9
        wait_until(lambda: srv.busy == 0, timeout=10, what="the pool to be free")
        assert threading.active_count() <= before + 8
        assert get(srv.port, "/healthz")[0] == 200  # and it serves again
    finally:
        for sock in socks:
            sock.close()
        srv.stop()


def test_a_client_dripping_its_head_is_cut_off_at_the_deadline(
    registry: CollectorRegistry,
) -> None:
    srv = MetricsServer("127.0.0.1", 0, registry, request_timeout_s=1.0, max_connections=2)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            started = time.monotonic()
            closed_after = None
            while closed_after is None and time.monotonic() - started < 10:
                try:
                    sock.sendall(b"X")  # one byte every 0.1 s: no single read waits long
                    readable, _, _ = select.select([sock], [], [], 0.1)
                    if readable and not sock.recv(1024):
                        closed_after = time.monotonic() - started
                except ConnectionError:
                    closed_after = time.monotonic() - started
            assert closed_after is not None and 0.9 <= closed_after < 5
    finally:
        srv.stop()


def test_resets_and_garbage_log_one_line_each_and_never_a_traceback(
    registry: CollectorRegistry, capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="outbox_relay.shared.metrics_server")
    srv = MetricsServer("127.0.0.1", 0, registry, request_timeout_s=1.0)
    try:
        tls_hello = b"\x16\x03\x01garbage\r\n\r\n"  # a scanner speaking TLS: a 400
        for payload in [HALF_SENT, b"GET /metrics HTTP/1.0\r\n\r\n", tls_hello]:
            for _ in range(10):
                sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
                sock.sendall(payload)
                # SO_LINGER 0: close() sends a reset, as a killed client or a scanner does.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
        wait_until(lambda: srv.busy == 0, timeout=10, what="every connection handled")
        assert get(srv.port, "/healthz")[0] == 200
    finally:
        srv.stop()
    assert "Traceback" not in capfd.readouterr().err
    for record in caplog.records:
        assert record.exc_info is None and record.levelno <= logging.INFO, record.getMessage()
        assert "\n" not in record.getMessage()


def test_stop_cuts_held_connections_so_the_pool_ends_at_once(
    registry: CollectorRegistry,
) -> None:
    def workers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("outbox-metrics-worker")]

    srv = MetricsServer("127.0.0.1", 0, registry, request_timeout_s=60.0, max_connections=4)
    socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(4)]
    try:
        for sock in socks:
            sock.sendall(HALF_SENT)
        wait_until(lambda: srv.busy == 4, what="four held connections")
        assert len(workers()) >= 4
        srv.stop()
        wait_until(lambda: srv.busy == 0 and not workers(), timeout=5,
                   what="the pool's threads to end well before the 60 s deadline")
    finally:
        for sock in socks:
            sock.close()
