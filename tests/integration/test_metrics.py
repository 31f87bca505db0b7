"""Each daemon's observation port during a real run (real Redis, both databases).

What ``/metrics`` says is checked against the database and Redis themselves: backlog against
undelivered rows, delivered rows, outcomes against inbox receipts, dead letters against the
dead-letter streams, pending entries and group lag against ``XPENDING`` and ``XINFO GROUPS``.
``/readyz`` must turn 503 when Redis (a private ``redis-server``, killed by pid and restarted
on the same port) or PostgreSQL (behind a small TCP proxy the test closes and reopens) goes
away, and 200 again when it is back, while ``/healthz`` stays 200: the loops keep turning.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from sqlalchemy import Engine, create_engine, func, select, text

from outbox_relay.cli import observe
from outbox_relay.consumer import Handlers
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.producer import Producer
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import db, keys
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.schema import outbox
from tests.conftest import PG_ADMIN_URL, REDIS_URL, pg_schema_url
from tests.helpers import (
    GROUP,
    PARTITIONS,
    STREAM,
    consumer_settings,
    enqueue_events,
    free_port,
    receipt_counts,
    record_effect,
    relay_settings,
    wait_until,
)

pytestmark = pytest.mark.integration

Samples = list[tuple[str, dict[str, str], float]]


def get(port: int, path: str) -> tuple[int, str]:
    """``(status, body)`` of a GET on the observation port (error statuses included)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def scrape(port: int) -> Samples:
    """Every sample of ``/metrics`` (OpenMetrics, parsed by prometheus_client's parser)."""
    status, body = get(port, "/metrics")
    assert status == 200
    return [(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(body) for s in family.samples]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in samples
               if n == name and all(lab.get(k) == want for k, want in labels.items()))


def by_partition(samples: Samples, name: str) -> dict[int, float]:
    return {int(lab["partition"]): v for n, lab, v in samples if n == name}


def ready(port: int) -> tuple[int, dict[str, str]]:
    status, body = get(port, "/readyz")
    return status, json.loads(body)


@contextlib.contextmanager
def running(loop: Callable[[], object], stop: Callable[[], None]) -> Iterator[None]:
    """Run a daemon loop on a thread for the block; stop and join it afterwards."""
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop()
        thread.join(timeout=30)
        assert not thread.is_alive()


def recorder() -> Handlers:
    handlers = Handlers()
    handlers.register("thing.happened", lambda conn, ev: record_effect(conn, ev))
    return handlers


def undelivered(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(
            outbox.c.delivered_at_ms.is_(None))).scalar_one())


def delivered(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(
            outbox.c.delivered_at_ms.is_not(None))).scalar_one())


def enqueue_unknown_type(engine: Engine) -> None:
    """One event no handler is registered for: it ends ``dead`` (``unknown_type``)."""
    with engine.begin() as conn:
        Producer(source="tests", partitions=PARTITIONS).enqueue(
            conn, type="thing.unheard_of", stream=STREAM, data={}, aggregate_type="other",
            aggregate_id="stranger", revision=1)


def test_scraped_numbers_match_the_database_and_redis(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    engine, n = effects_engine, 120
    enqueue_events(engine, n, aggregates=12)
    enqueue_unknown_type(engine)
    relay = Relay(relay_settings(key_prefix, metrics_port=free_port()), engine,
                  connect_redis(REDIS_URL))
    consumer = Consumer(consumer_settings(key_prefix, metrics_port=free_port()), engine,
                        connect_redis(REDIS_URL), recorder())
    with observe.relay(relay) as relay_port, observe.consumer(consumer) as consumer_port:
        assert relay_port is not None and consumer_port is not None
        before = scrape(relay_port.port)
        assert total(before, "outbox_relay_backlog_rows") == undelivered(engine) == n + 1
        assert total(before, "outbox_relay_rows_delivered_total") == 0

        with running(relay.run, relay.stop):
            with running(consumer.run, consumer.stop):
                during = scrape(relay_port.port)
                assert 0 <= total(during, "outbox_relay_rows_delivered_total") <= n + 1
                wait_until(lambda: sum(receipt_counts(engine).values()) == n + 1, timeout=60,
                           what="every event claimed")
            # The consumer stopped: its gauges and counters hold still while compared. The
            # consumer can claim a batch before the relay marked it (the XADD comes first),
            # and the relay counts a batch after its mark commits: wait for the relay's count.
            r = relay_counted(relay_port.port, engine, n + 1)
            c = scrape(consumer_port.port)
            assert total(r, "outbox_relay_backlog_rows") == undelivered(engine) == 0
            assert total(r, "outbox_relay_rows_delivered_total") == delivered(engine) == n + 1
            assert total(r, "outbox_relay_batch_size_sum") == n + 1
            assert total(r, "outbox_relay_append_duration_seconds_count") >= 1
            assert total(r, "outbox_relay_leases_held") == PARTITIONS
            assert total(r, "outbox_relay_lease_acquisitions_total") == PARTITIONS

            got = receipt_counts(engine)
            assert total(c, "outbox_consumer_outcomes_total", outcome="applied",
                         type="thing.happened") == got["applied"] == n
            assert total(c, "outbox_consumer_outcomes_total", outcome="dead",
                         reason="unknown_type", type="other") == got["dead"] == 1
            assert total(c, "outbox_consumer_outcomes_total") == n + 1
            assert total(c, "outbox_consumer_handler_duration_seconds_count",
                         type="thing.happened") == n  # one call each: no handler failed
            assert total(c, "outbox_consumer_claim_duration_seconds_count") >= 1
            assert total(c, "outbox_consumer_entries_read_total") == n + 1
            dead_keys = [keys.dead_letter_key(key_prefix, STREAM, p) for p in range(PARTITIONS)]
            assert total(c, "outbox_consumer_dead_letters") == \
                sum(redis_client.xlen(k) for k in dead_keys) == 1
            stream_keys = [keys.stream_key(key_prefix, STREAM, p) for p in range(PARTITIONS)]
            assert total(c, "outbox_consumer_stream_entries") == \
                sum(redis_client.xlen(k) for k in stream_keys) > 0
            assert total(c, "outbox_consumer_pending_entries") == 0
            assert total(c, "outbox_consumer_group_lag") == 0
            assert total(c, "outbox_consumer_leases_held", group=GROUP) == PARTITIONS

            # Entries read and not acknowledged, and entries not read yet: PEL and lag.
            enqueue_events(engine, 40, aggregates=8, prefix="late")
            wait_until(lambda: undelivered(engine) == 0, what="the late events delivered")
            stream_keys = [keys.stream_key(key_prefix, STREAM, p) for p in range(PARTITIONS)]
            for key in stream_keys[:2]:  # one key per call: on a cluster they are two slots
                redis_client.xreadgroup(GROUP, "someone", {key: ">"}, count=3)
            c = scrape(consumer_port.port)
            for p, key in enumerate(stream_keys):
                summary: Any = redis_client.xpending(key, GROUP)
                info = next(g for g in redis_client.xinfo_groups(key)
                            if g["name"] == GROUP.encode())
                assert by_partition(c, "outbox_consumer_pending_entries")[p] == \
                    summary["pending"]
                assert by_partition(c, "outbox_consumer_group_lag")[p] == info["lag"]
            assert total(c, "outbox_consumer_pending_entries") > 0
            assert total(c, "outbox_consumer_group_lag") == 40 - total(
                c, "outbox_consumer_pending_entries")
            assert all(v >= 0 for v in by_partition(
                c, "outbox_consumer_oldest_pending_age_seconds").values())
            r = relay_counted(relay_port.port, engine, n + 41)
            assert total(r, "outbox_relay_rows_delivered_total") == delivered(engine) == n + 41


def relay_counted(port: int, engine: Engine, rows: int) -> Samples:
    """A scrape of the relay once the database has ``rows`` delivered and the relay's
    delivered counter says as many (it counts a batch right after its mark commits); a
    counter that never gets there fails the wait."""
    got: Samples = []

    def counted() -> bool:
        got[:] = scrape(port)
        return delivered(engine) == rows and total(got, "outbox_relay_rows_delivered_total") == rows

    wait_until(counted, timeout=30, what=f"the relay to count {rows} delivered rows")
    return got


class Server:
    """A private ``redis-server`` on a fixed port, killed by pid and restarted on that port."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is not installed"
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = redis.Redis.from_url(self.url, socket_timeout=1)

        def up() -> bool:
            try:
                return bool(probe.ping())
            except redis.ConnectionError:
                return False

        try:
            wait_until(up, timeout=10, what="the private redis-server")
        finally:
            probe.close()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def private_server(tmp_path: Path) -> Iterator[Server]:
    server = Server(tmp_path / "redis")
    server.start()
    yield server
    server.kill()


def check_flips(ports: list[int], check: str, go_away: Callable[[], None],
                come_back: Callable[[], None]) -> None:
    """Ready, then ``check`` fails on every port (the loops stay live), then ready again."""
    for port in ports:
        wait_until(lambda port=port: ready(port)[0] == 200, timeout=30, what="ready")
    go_away()
    for port in ports:
        wait_until(lambda port=port: ready(port)[0] == 503, timeout=30, what="not ready")
        status, answer = ready(port)
        assert status == 503
        assert answer[check].startswith("unavailable: "), answer
        assert get(port, "/healthz")[0] == 200
        assert total(scrape(port), "outbox_relay_scrape_up", source=check) + total(
            scrape(port), "outbox_consumer_scrape_up", source=check) == 0
    come_back()
    for port in ports:
        wait_until(lambda port=port: ready(port)[0] == 200, timeout=30, what="ready again")
        assert all(v == "ok" for v in ready(port)[1].values())


def test_readyz_follows_redis_away_and_back(
    sqlite_engine: Engine, private_server: Server, key_prefix: str
) -> None:
    relay = Relay(relay_settings(key_prefix, redis_url=private_server.url,
                                 metrics_port=free_port()),
                  sqlite_engine, connect_redis(private_server.url, timeout_s=2))
    consumer = Consumer(consumer_settings(key_prefix, redis_url=private_server.url,
                                          metrics_port=free_port()),
                        sqlite_engine, connect_redis(private_server.url, timeout_s=2),
                        recorder(), ownership=True)
    with observe.relay(relay) as r, observe.consumer(consumer) as c, \
            running(relay.run, relay.stop), running(consumer.run, consumer.stop):
        assert r is not None and c is not None
        check_flips([r.port, c.port], "redis", private_server.kill, private_server.start)
        assert set(ready(c.port)[1]) == {"database", "redis", "groups"}
        assert set(ready(r.port)[1]) == {"database", "redis", "leases"}


class Proxy:
    """A TCP proxy in front of PostgreSQL: ``close`` drops every connection and refuses new
    ones (the database "goes away"); ``open`` listens on the same port again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.port = target, free_port()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listening = threading.Event()
        self._acceptor: threading.Thread | None = None

    def open(self) -> None:
        if self._acceptor is not None:  # the previous listener is closed once it returns
            self._acceptor.join(timeout=10)
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)
        self._listening.set()
        self._acceptor = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._acceptor.start()

    def close(self) -> None:
        with self._lock:
            self._listening.clear()
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        with listener:
            while self._listening.is_set():
                try:
                    client, _ = listener.accept()
                except TimeoutError:
                    continue
                client.settimeout(None)
                upstream = socket.create_connection(self.target)
                with self._lock:
                    if not self._listening.is_set():  # closed meanwhile: refuse it too
                        client.close()
                        upstream.close()
                        return
                    self._sockets += [client, upstream]
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@pytest.fixture
def proxied_pg() -> Iterator[tuple[Proxy, str]]:
    """A migrated PostgreSQL schema of its own, reached through a :class:`Proxy`."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    direct = db.make_engine(pg_schema_url(schema))
    db.upgrade(direct)
    direct.dispose()
    url = db.make_engine(pg_schema_url(schema)).url
    proxy = Proxy((url.host or "127.0.0.1", url.port or 5432))
    proxy.open()
    try:
        yield proxy, pg_schema_url(schema).replace(f":{url.port or 5432}/", f":{proxy.port}/")
    finally:
        proxy.close()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.mark.postgresql
def test_readyz_follows_the_database_away_and_back(
    proxied_pg: tuple[Proxy, str], redis_client: redis.Redis, key_prefix: str
) -> None:
    proxy, url = proxied_pg
    assert f":{proxy.port}/" in url
    engine = db.make_engine(url, connect_args={"connect_timeout": 2})
    relay = Relay(relay_settings(key_prefix, metrics_port=free_port()), engine,
                  connect_redis(REDIS_URL))
    consumer = Consumer(consumer_settings(key_prefix, metrics_port=free_port()), engine,
                        connect_redis(REDIS_URL), recorder(), ownership=True)
    try:
        with observe.relay(relay) as r, observe.consumer(consumer) as c, \
                running(relay.run, relay.stop), running(consumer.run, consumer.stop):
            assert r is not None and c is not None
            check_flips([r.port, c.port], "database", proxy.close, proxy.open)
    finally:
        engine.dispose()
