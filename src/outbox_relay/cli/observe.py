"""The observation port of each daemon: metrics, liveness and readiness, wired here.

``outbox relay``, ``outbox consume`` and ``outbox serve`` serve ``/metrics``, ``/healthz`` and
``/readyz`` on ``--metrics-port`` / ``OUTBOX_METRICS_PORT`` (:mod:`shared.metrics_server`);
0 (the default) means no port and no instrument on the hot path. ``outbox serve`` uses a port
of its own too, not a route of the API app: one rule for every daemon, and the probes keep
answering while the API is saturated.

Each daemon's registry also carries the standard ``process_*`` and ``python_*`` metrics.

Readiness, per daemon:

- relay: ``database`` (reachable, schema current), ``redis`` (``PING``), ``leases`` (its last
  lease round succeeded within a lease lifetime, partitions held or not: a standby is ready);
- consume: ``database``, ``redis``, ``groups`` (the consumer group exists on every stream);
- serve: ``database``.

Liveness: the relay's and consumer's loops stamp ``last_loop`` at every iteration; ``/healthz``
fails once it is older than three times the longest wait an iteration can contain (backoff,
poll interval, blocking read, lease renewal), and at least 30 s.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator

import redis
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from sqlalchemy import Engine

from outbox_relay.consumer import metrics as consumer_metrics
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.relay import metrics as relay_metrics
from outbox_relay.relay.daemon import Relay
from outbox_relay.runs import schema as runs_schema
from outbox_relay.runs.metrics import RunsCollector
from outbox_relay.shared import db, metrics_server
from outbox_relay.shared.metrics_server import MetricsServer
from outbox_relay.shared.redis_conn import translate_redis_errors
from outbox_relay.shared.settings import DaemonSettings

MAX_BACKOFF_S = 5.0  # the daemons' longest retry backoff (relay/daemon.py, consumer/daemon.py)
MIN_STALE_S = 30.0


@contextlib.contextmanager
def relay(daemon: Relay) -> Iterator[MetricsServer | None]:
    """Instrument ``daemon`` and serve its port while the block runs (nothing when off)."""
    s = daemon.settings
    if s.metrics_port == 0:
        yield None
        return
    instruments = relay_metrics.RelayMetrics(daemon)
    daemon.metrics = instruments
    longest_wait = max(s.poll_max_ms / 1000, MAX_BACKOFF_S, s.lease_ttl_ms / 1000)
    with _serving(s, _with_process(instruments.registry), lambda: daemon.last_loop,
                  longest_wait, {
                      "database": functools.partial(db.check_schema, daemon.engine),
                      "redis": functools.partial(ping, daemon.client),
                      "leases": functools.partial(relay_metrics.leases_check, daemon),
                  }) as server:
        yield server


@contextlib.contextmanager
def consumer(daemon: Consumer) -> Iterator[MetricsServer | None]:
    """Instrument ``daemon`` (and its handlers) and serve its port while the block runs."""
    s = daemon.settings
    if s.metrics_port == 0:
        yield None
        return
    instruments = consumer_metrics.ConsumerMetrics(daemon)
    daemon.metrics = instruments
    longest_wait = max(s.block_ms / 1000, MAX_BACKOFF_S, s.lease_ttl_ms / 3000,
                       s.redis_timeout_s)
    with _serving(s, _with_process(instruments.registry), lambda: daemon.last_loop,
                  longest_wait, {
                      "database": functools.partial(db.check_schema, daemon.engine),
                      "redis": functools.partial(ping, daemon.client),
                      "groups": functools.partial(consumer_metrics.groups_check, daemon),
                  }) as server:
        yield server


@contextlib.contextmanager
def serve(settings: DaemonSettings, engine: Engine) -> Iterator[MetricsServer | None]:
    """The port of ``outbox serve``: runs by status; ready when the database is. Liveness is
    the process answering (uvicorn has no loop stamp of ours to check)."""
    if settings.metrics_port == 0:
        yield None
        return
    registry = _with_process(CollectorRegistry(auto_describe=False))
    registry.register(RunsCollector(engine))
    server = metrics_server.serve(
        settings.metrics_host, settings.metrics_port, registry,
        checks={"database": functools.partial(runs_schema.check_schema, engine)})
    try:
        yield server
    finally:
        if server is not None:
            server.stop()


def ping(client: redis.Redis) -> None:
    """Readiness of Redis: ``PING`` answered (connection errors become ``unavailable``)."""
    with translate_redis_errors():
        client.ping()


@contextlib.contextmanager
def _serving(
    settings: DaemonSettings,
    registry: CollectorRegistry,
    last_loop: Callable[[], float],
    longest_wait_s: float,
    checks: dict[str, metrics_server.Check],
) -> Iterator[MetricsServer | None]:
    """Serve while the block runs; ``last_loop()``: the loop's latest monotonic stamp."""
    server = metrics_server.serve(
        settings.metrics_host, settings.metrics_port, registry,
        heartbeat=lambda: time.monotonic() - last_loop(),
        stale_after_s=max(MIN_STALE_S, 3 * longest_wait_s), checks=checks)
    try:
        yield server
    finally:
        if server is not None:
            server.stop()


def _with_process(registry: CollectorRegistry) -> CollectorRegistry:
    """Add the standard process (CPU, memory, open files) and Python platform metrics."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
