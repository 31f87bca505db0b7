"""The consumer's metrics: one registry per :class:`consumer.daemon.Consumer`.

Three kinds, by what they cost:

- Counters the consumer already keeps (:class:`consumer.counters.ConsumerStats`, group
  hygiene, retention, the app's own such as the run worker and sweeper through
  ``Handlers.observe``), read at scrape time (:class:`shared.metrics.StatsCollector`).
- On the hot path: ``outbox_consumer_outcomes_total{group,type,outcome,reason}`` and
  ``outbox_consumer_retries_total{group,type,reason}`` (counted per batch in a dict, then one
  ``inc`` per label set), the claim transaction's duration (one observation per batch) and
  each handler call's duration by event type (one observation per event, from a wrapper
  :meth:`consumer.handlers.Handlers.instrument` installs).
- Gauges read at scrape time over the partition streams this consumer owns (so summing over
  the consumers of a group counts each stream once): from Redis, in one pipelined round trip
  (:func:`consumer.group_status.owned_streams`), pending entries (PEL) and the age of the
  oldest, the group's lag, the length of each dead-letter stream, and the leases held; from
  the database, in one query (:func:`consumer.inbox.retrying`), the entries waiting for a
  retry and the age of the oldest one's first failure. This module sends no command itself.

Labels stay bounded: group, stream, partition, outcome, reason (our codes, a handler's error
class) and type, which is the event type when a handler is registered for it by name, ``*``
for the catch-all handler and ``other`` otherwise (an unknown type from a foreign producer
must not create a series per type). Never an event or entry id.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter as Tally
from collections.abc import Generator, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Connection

from outbox_relay.consumer import group_status, inbox
from outbox_relay.consumer.handlers import Handler
from outbox_relay.consumer.ordering import DEAD, DUPLICATE, FAILED, Outcome
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import OutboxError
from outbox_relay.shared.metrics import (
    SECONDS_BUCKETS,
    LabelCache,
    Naming,
    Source,
    StatsCollector,
    discover,
    scrape_up,
)

if TYPE_CHECKING:
    from outbox_relay.consumer.daemon import Consumer

log = logging.getLogger(__name__)

NAMESPACE = "outbox_consumer"

CONSUMER_NAMES = {
    "read": ("entries_read", "Stream entries read (new ones and pending re-reads)."),
    "invalid": ("entries_invalid", "Entries that did not parse (dead-lettered with the reason)."),
    "autoclaimed": ("entries_reread", "Pending entries re-read by a pending pass."),
    "taken_over": ("entries_taken_over",
                   "Pending entries moved to this consumer from another one of the group."),
    "lease_losses": ("lease_losses", "Claims refused because a partition stream was taken over."),
    "lost": ("entries_lost",
             "Entries that vanished from the stream while pending (receipt lost, dead letter)."),
}
# Exported with their event type by outbox_consumer_outcomes_total instead.
OUTCOME_FIELDS = frozenset({"applied", "duplicates", "superseded", "dead", "out_of_order",
                            "failed", "waiting", "resurrected",
                            "retried"})  # outbox_consumer_retries_total{group,type,reason}

HYGIENE_NAMES = {
    "consumers_removed": ("consumers_removed",
                          "Idle consumers with nothing pending removed from the group."),
    "node_rows_removed": ("node_rows_removed", "Expired consumer heartbeat rows deleted."),
    "dead_letters_trimmed": ("dead_letters_trimmed",
                             "Dead letters older than the retention trimmed."),
}

PRUNE_NAMES = {
    "passes": ("passes", "Retention passes over the inbox."),
    "receipts": ("receipts", "Inbox receipts deleted by retention."),
    "heads": ("heads", "Aggregate heads deleted by retention."),
    "runs": ("runs", "Terminal runs deleted by retention."),
}

KNOWN = {
    "stats": Naming("", CONSUMER_NAMES, OUTCOME_FIELDS),
    "hygiene_stats": Naming("hygiene", HYGIENE_NAMES),
    "prune_stats": Naming("prune", PRUNE_NAMES),
}
"""Stats dataclasses by attribute of the consumer (or named by ``Handlers.observe``); any
other one is exported too (:func:`shared.metrics.discover`)."""


class ConsumerMetrics:
    """The registry of one consumer, and the hooks its loop calls per batch."""

    def __init__(self, consumer: Consumer) -> None:
        group = consumer.settings.group
        self.registry = CollectorRegistry(auto_describe=False)
        outcomes = Counter(
            f"{NAMESPACE}_outcomes",
            "Claimed deliveries by event type and outcome (applied, duplicate, superseded, "
            "dead, failed, waiting, resurrected); reason: why dead (unknown_type, "
            "max_deliveries, out_of_order …) or the failing handler's error.",
            ["group", "type", "outcome", "reason"], registry=self.registry)
        claim = Histogram(
            f"{NAMESPACE}_claim_duration_seconds",
            "Duration of one batch's claim transaction (handlers included), in seconds.",
            ["group"], buckets=SECONDS_BUCKETS, registry=self.registry)
        handler = Histogram(
            f"{NAMESPACE}_handler_duration_seconds",
            "Duration of one handler call, by event type, in seconds.",
            ["group", "type"], buckets=SECONDS_BUCKETS, registry=self.registry)
        retries = Counter(
            f"{NAMESPACE}_retries",
            "Failures of a handler given a later attempt (not dead-lettered), by event type; "
            "reason: the failing handler's error.",
            ["group", "type", "reason"], registry=self.registry)
        self._group = group
        self._outcomes = LabelCache(outcomes)
        self._retries = LabelCache(retries)
        self._claim = claim.labels(group)
        self._handler = LabelCache(handler)
        self._types = frozenset(consumer.handlers)
        consumer.handlers.instrument(self._timed)
        self.registry.register(StatsCollector(
            NAMESPACE, functools.partial(_sources, consumer), labels={"group": group},
            periodic=lambda: consumer.periodic))
        self.registry.register(StreamsCollector(consumer))
        for collector in consumer.handlers.collectors:  # the app's own (runs by status)
            self.registry.register(collector)

    def type_label(self, event_type: str) -> str:
        """The bounded ``type`` label of an event type (see the module docstring)."""
        if event_type in self._types:
            return event_type
        return "*" if "*" in self._types else "other"

    def claimed(self, outcomes: list[Outcome], seconds: float) -> None:
        """One claim transaction committed (hot path: one dict pass, one ``inc`` per label
        set, one observation)."""
        self._claim.observe(seconds)
        tally: Tally[tuple[str, str, str]] = Tally()
        retried: Tally[tuple[str, str]] = Tally()
        for o in outcomes:
            reason = "" if o.outcome == DUPLICATE or o.error is None else o.error
            tally[(o.delivery.event.type, o.outcome, reason)] += 1
            if o.outcome == FAILED and o.retry_at_ms is not None:
                retried[(o.delivery.event.type, reason)] += 1
        for (event_type, outcome, reason), count in tally.items():
            self._outcomes(self._group, self.type_label(event_type), outcome,
                           reason if outcome != DEAD else reason or DEAD).inc(count)
        for (event_type, reason), count in retried.items():
            self._retries(self._group, self.type_label(event_type), reason).inc(count)

    def _timed(self, event_type: str, handler: Handler) -> Handler:
        child = self._handler(self._group, event_type)

        def timed(conn: Connection, event: Event, /) -> None:
            started = time.perf_counter()
            try:
                handler(conn, event)
            finally:
                child.observe(time.perf_counter() - started)

        return timed


def _sources(consumer: Consumer) -> Iterable[Source]:
    yield from discover(consumer, KNOWN)
    for name, stats in list(consumer.handlers.observed.items()):
        naming = consumer.handlers.namings.get(name, Naming(name))
        yield Source(functools.partial(_same, stats), naming)


def _same(value: object) -> object:
    return value


class StreamsCollector(Collector):
    """Gauges read from Redis and the database when scraped, over the partition streams this
    consumer owns."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        c = self.consumer
        group = c.settings.group
        owned = [k for k in c.leases.ids if k in c.leases.held]
        leases = GaugeMetricFamily(f"{NAMESPACE}_leases_held",
                                   "Partition streams this consumer owns.", labels=["group"])
        leases.add_metric([group], len(owned))
        yield leases
        redis_up = yield from self._redis_gauges(owned)
        database_up = yield from self._retry_gauges(owned)
        yield scrape_up(NAMESPACE, {"redis": redis_up, "database": database_up},
                        {"group": group})

    def _retry_gauges(self, owned: list[str]) -> Generator[Metric, None, bool]:
        """Per owned stream, the group's entries waiting for a retry and the age of the oldest
        one's first failure (0 when none), from ``outbox_consumer_retries``; returns whether
        the database answered."""
        c = self.consumer
        group = c.settings.group
        try:
            rows = inbox.retrying(c.engine, group, owned)  # owning none: still a real read
        except OutboxError as err:
            log.debug("retry gauges skipped: %s", err)
            return False
        labels = ["group", "stream", "partition"]
        waiting = GaugeMetricFamily(f"{NAMESPACE}_retrying_entries",
                                    "Entries of the group whose handler failed and that wait "
                                    "for their next attempt (consumer/retry.py).", labels=labels)
        oldest = GaugeMetricFamily(f"{NAMESPACE}_oldest_retry_age_seconds",
                                   "Seconds since the first failure of the oldest entry "
                                   "waiting for a retry (0 when none).", labels=labels)
        count: Tally[str] = Tally()
        first: dict[str, int] = {}
        for row in rows:
            key = row["stream_key"]
            count[key] += row["count"]
            first[key] = min(first.get(key, row["oldest_first_failed_ms"]),
                             row["oldest_first_failed_ms"])
        now = now_ms()
        for key in owned:
            stream, partition = c.leases.ids[key]
            values = [group, stream, str(partition)]
            waiting.add_metric(values, count[key])
            oldest.add_metric(values, max(now - first[key], 0) / 1000 if key in first else 0)
        yield waiting
        yield oldest
        return True

    def _redis_gauges(self, owned: list[str]) -> Generator[Metric, None, bool]:
        """The Redis gauges of the owned streams (module docstring); returns whether Redis
        answered."""
        c = self.consumer
        group = c.settings.group
        try:
            replies = group_status.owned_streams(
                c.client, c.settings.key_prefix, group, {k: c.leases.ids[k] for k in owned})
        except OutboxError as err:
            log.debug("stream gauges skipped: %s", err)
            return False
        labels = ["group", "stream", "partition"]
        pending = GaugeMetricFamily(f"{NAMESPACE}_pending_entries",
                                    "Entries delivered to the group and not yet acknowledged "
                                    "(the PEL: failed and waiting ones, or in progress).",
                                    labels=labels)
        oldest = GaugeMetricFamily(f"{NAMESPACE}_oldest_pending_age_seconds",
                                   "Age of the oldest pending entry of the group, from its "
                                   "entry id's time (0 when none is pending).", labels=labels)
        lag = GaugeMetricFamily(f"{NAMESPACE}_group_lag",
                                "Entries of the stream the group has not read yet (0 once "
                                "it read the newest entry, else XINFO GROUPS lag; absent when "
                                "Redis cannot tell).", labels=labels)
        dead = GaugeMetricFamily(f"{NAMESPACE}_dead_letters",
                                 "Entries in the stream's dead-letter stream (XLEN).",
                                 labels=["stream", "partition"])
        length = GaugeMetricFamily(f"{NAMESPACE}_stream_entries",
                                   "Entries the partition stream holds (XLEN): bounded by the "
                                   "relay's trim once every group acknowledged them.",
                                   labels=["stream", "partition"])
        now = now_ms()
        for key, (summary, groups, dead_len, stream_len, newest) in zip(owned, replies,
                                                                         strict=True):
            stream, partition = c.leases.ids[key]
            values = [group, stream, str(partition)]
            if isinstance(summary, dict):
                pending.add_metric(values, int(summary["pending"]))
                first = summary.get("min")
                age_ms = now - _id_ms(first) if first else 0
                oldest.add_metric(values, max(age_ms, 0) / 1000)
            found = group_status.group_info(groups, group)
            behind = None if found is None or not isinstance(newest, list) else \
                group_status.unread(found, newest)
            if behind is not None:
                lag.add_metric(values, behind)
            if isinstance(dead_len, int):
                dead.add_metric([stream, str(partition)], dead_len)
            if isinstance(stream_len, int):
                length.add_metric([stream, str(partition)], stream_len)
        yield from (pending, oldest, lag, dead, length)
        return True


def _id_ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[0])


def groups_check(consumer: Consumer) -> None:
    """Readiness: the consumer group exists on every partition stream this consumer reads."""
    group = consumer.settings.group
    missing = group_status.missing_group(consumer.client, consumer.keys, group)
    if missing:
        raise OutboxError(f"group {group} is missing on {len(missing)} of "
                          f"{len(consumer.keys)} partition stream(s)", code="group_missing")
