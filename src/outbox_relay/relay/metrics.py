"""The relay's metrics: one registry per :class:`relay.daemon.Relay`.

Three kinds, by what they cost:

- Counters of :class:`relay.counters.RelayStats` and :class:`RepairStats` (rows delivered,
  lease losses and acquisitions, refills, rebuilds …): the relay already counts them; they are
  read at scrape time (:class:`shared.metrics.StatsCollector`), nothing is added to the hot path.
- Per batch, on the hot path (two histogram observations per ``XADD`` script call, a few µs
  against milliseconds): ``outbox_relay_batch_size``, ``outbox_relay_append_duration_seconds``,
  and ``outbox_relay_append_errors_total{reason}`` when Redis refuses rows or the outcome of an
  append is unknown.
- Gauges computed at scrape time with one statement (:func:`relay.backlog.backlog`): backlog
  and oldest undelivered age per stream and partition, over every partition (not only this
  relay's: a partition no relay holds must show up too; with several relays take ``max`` by
  stream and partition), and the leases this relay holds.

Labels stay bounded: stream, partition, reason (our error codes); never an event id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from outbox_relay.relay import backlog
from outbox_relay.shared.errors import OutboxError, UnavailableError
from outbox_relay.shared.metrics import (
    SECONDS_BUCKETS,
    SIZE_BUCKETS,
    LabelCache,
    Naming,
    StatsCollector,
    discover,
)
from outbox_relay.shared.metrics import scrape_up as scrape_up_family

if TYPE_CHECKING:
    from outbox_relay.relay.append import Verdicts
    from outbox_relay.relay.daemon import Relay

log = logging.getLogger(__name__)

NAMESPACE = "outbox_relay"

RELAY_NAMES = {
    "rounds": ("rounds", "Relay rounds over the owned partitions."),
    "delivered": ("rows_delivered", "Outbox rows appended to their stream and marked delivered."),
    "already_present": ("rows_already_present",
                        "Rows whose retried append found the entry already in the stream."),
    "ordering_gaps": ("ordering_gaps",
                      "Rows held back because an earlier row of their stream was missing."),
    "failed": ("rows_refused", "Rows Redis refused to append (see append_errors by reason)."),
    "not_appended": ("rows_not_appended",
                     "Rows left behind a gap or refusal in their stream (taken again)."),
    "unknown_outcomes": ("unknown_outcomes",
                         "Rows whose append outcome was unknown (Redis timed out or dropped)."),
    "lease_losses": ("lease_losses", "Partition leases lost to another relay."),
    "lease_acquisitions": ("lease_acquisitions",
                           "Partition leases taken (or taken again under a new epoch)."),
}

REPAIR_NAMES = {
    "checks": ("checks", "Checks of the owned streams against what the outbox delivered."),
    "behind": ("streams_behind", "Streams found holding less than the outbox delivered."),
    "refills": ("refills", "Repairs that appended missing entries back (stream kept)."),
    "rebuilds": ("rebuilds", "Repairs that rebuilt a stream from the outbox."),
    "repaired_entries": ("entries_refilled", "Entries put back into streams by repairs."),
    "changed": ("changed", "Repairs dropped because the stream changed meanwhile (retried)."),
    "fenced": ("fenced", "Repairs refused by the fence (a newer lease owns the stream)."),
    "foreign_entries": ("foreign_entries", "Entries above every id the relay assigned (not "
                        "the relay's) moved to the dead-letter stream as foreign_entry."),
    "foreign_tops": ("foreign_tops", "Streams found with a last id above every id the relay "
                     "assigned: foreign entries moved, or a bare last id set back or adopted."),
}

TRIM_NAMES = {
    "trims": ("runs", "Trim passes over a partition stream."),
    "trimmed_entries": ("entries", "Entries trimmed below what every group acknowledged."),
    "trim_fenced": ("fenced", "Trims refused by the fence (a newer lease owns the stream)."),
    "trim_errors": ("errors", "Trims Redis refused (ACL, wrong type): logged, retried."),
    "trims_held": ("held", "Trims held because a group known to read the stream is missing "
                   "from it (Redis lost it; its consumers have not recreated it)."),
    "groups_forgotten": ("groups_forgotten", "Known groups forgotten after being missing "
                         "longer than OUTBOX_GROUP_FORGET_S."),
}

PRUNE_NAMES = {
    "passes": ("passes", "Retention passes over the outbox."),
    "outbox_rows": ("outbox_rows", "Delivered outbox rows deleted by retention."),
}

KNOWN = {
    "stats": Naming("", RELAY_NAMES),
    "repairer": Naming("repair", REPAIR_NAMES, frozenset({"findings"})),
    "trimmer": Naming("trim", TRIM_NAMES),
    "prune_stats": Naming("prune", PRUNE_NAMES),
}
"""The relay's stats dataclasses by attribute; any other one is exported too
(:func:`shared.metrics.discover`)."""


class RelayMetrics:
    """The registry of one relay, and the hooks its loop calls per batch."""

    def __init__(self, relay: Relay) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.batch_size = Histogram(
            f"{NAMESPACE}_batch_size", "Rows per append script call.",
            buckets=SIZE_BUCKETS, registry=self.registry)
        self.append_seconds = Histogram(
            f"{NAMESPACE}_append_duration_seconds",
            "Duration of one batch's append script call (XADDs of a batch), in seconds.",
            buckets=SECONDS_BUCKETS, registry=self.registry)
        errors = Counter(
            f"{NAMESPACE}_append_errors", "Rows whose append failed, by reason "
            "(redis_oom, redis_acl, … refused; unknown_outcome, stream_behind: retried).",
            ["reason"], registry=self.registry)
        self._errors = LabelCache(errors)
        self.registry.register(StatsCollector(
            NAMESPACE, lambda: discover(relay, KNOWN), periodic=lambda: relay.periodic))
        self.registry.register(BacklogCollector(relay))
        self.registry.register(RefusalCollector(relay))

    def appended(self, rows: int, verdicts: Verdicts, seconds: float) -> None:
        """One append script call returned (hot path: keep it to a few observations)."""
        self.batch_size.observe(rows)
        self.append_seconds.observe(seconds)
        for _seq, code in verdicts.failed:
            self._errors(code).inc()

    def append_failed(self, code: str, rows: int) -> None:
        """A batch's append raised: its ``rows`` have an unknown outcome (``code``)."""
        self._errors(code).inc(rows)


class RefusalCollector(Collector):
    """``outbox_relay_stream_backoff{stream,partition,reason}``: 1 while a stream backs off
    after Redis refused its append (relay/refusals.py); the series goes when it recovers."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            f"{NAMESPACE}_stream_backoff",
            "1 while the stream's appends are refused by Redis and retried with backoff, "
            "by reason (redis_oom, redis_acl, redis_wrongtype, redis_not_ready, redis_error).",
            labels=["stream", "partition", "reason"])
        for (stream, partition), r in sorted(dict(self.relay.refusals.refused).items()):
            gauge.add_metric([stream, str(partition), r.reason], 1)
        yield gauge


class BacklogCollector(Collector):
    """Gauges read when scraped: backlog, oldest undelivered age, leases held."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self._streams: set[str] = set()

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        leases = GaugeMetricFamily(f"{NAMESPACE}_leases_held",
                                   "Partition leases this relay holds.")
        leases.add_metric([], len(self.relay.leases))
        yield leases
        try:
            found = backlog.backlog(self.relay.engine)
        except OutboxError as err:
            log.debug("backlog gauges skipped: %s", err)
            yield scrape_up_family(NAMESPACE, {"database": False}, {})
            return
        labels = ["stream", "partition"]
        rows = GaugeMetricFamily(f"{NAMESPACE}_backlog_rows",
                                 "Undelivered outbox rows (including delayed ones not yet due).",
                                 labels=labels)
        age = GaugeMetricFamily(
            f"{NAMESPACE}_oldest_undelivered_age_seconds",
            "Seconds since the oldest undelivered row became deliverable (0 if none is due).",
            labels=labels)
        current = {(b.stream, b.partition): b for b in found}
        # Every partition of every stream known (pending rows now, delivered rows found by
        # the repair check, or seen before): a drained partition reads 0 rather than vanish.
        known = {st for st, _ in current} | {st for st, _ in self.relay.repairer.streams}
        self._streams |= known
        grid = {(st, p) for st in self._streams for p in range(self.relay.settings.partitions)}
        for stream, partition in sorted(grid | set(current)):
            b = current.get((stream, partition))
            values = [stream, str(partition)]
            rows.add_metric(values, b.rows if b else 0)
            age.add_metric(values, b.waited_ms / 1000 if b else 0.0)
        yield rows
        yield age
        yield scrape_up_family(NAMESPACE, {"database": True}, {})


def leases_check(relay: Relay) -> None:
    """Readiness: the relay's last lease round (take, renew, rebalance) succeeded within one
    lease lifetime, whether or not it holds a partition (a standby relay, with every partition
    held by others, is ready too). A relay that cannot reach its lease table is not: its
    leases expire and it relays nothing."""
    ttl_s = relay.settings.lease_ttl_ms / 1000
    if time.monotonic() - relay.leases_tried_at > ttl_s:
        raise UnavailableError(f"no successful lease round in the last {ttl_s:g}s",
                               code="no_leases")
