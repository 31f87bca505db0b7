"""Exporting a daemon's counters to Prometheus without touching its hot path.

Daemons already count what they do in plain dataclasses (``RelayStats``, ``ConsumerStats``,
``RepairStats``, worker and sweeper stats): an attribute increment, the cheapest counter there
is. :class:`StatsCollector` reads those dataclasses when ``/metrics`` is scraped and exports
every ``int`` field as a counter ``<namespace>_<name>_total``; a ``dict[str, int]`` field as
one counter with a ``reason`` label; a nested dataclass under its field name. Known fields
get a chosen name and help text (``names``); a field added later is exported too, under its
own name, so nothing a daemon counts goes unseen. Fields already exported in a richer form
(with labels, by the daemon's own instruments) are left out with ``skip``.

Every metric of one daemon lives in its own ``CollectorRegistry`` (never the global one), so
tests that run several daemons in one process see each daemon's numbers alone.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from outbox_relay.shared.periodic import Periodic

log = logging.getLogger(__name__)

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)
"""Latency buckets (seconds) for per-batch and per-event timings: 0.5 ms to 30 s."""

SIZE_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
"""Batch-size buckets (rows or entries); batch sizes are capped at 10,000 by the settings."""


@dataclasses.dataclass(frozen=True)
class Naming:
    """How one stats dataclass is exported: ``<namespace>[_<subsystem>]_<name>_total``.

    ``names`` maps known fields to ``(name, help)``; other fields keep their own name.
    ``skip``: fields exported elsewhere in a richer form.
    """

    subsystem: str = ""
    names: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    skip: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Source:
    """One stats dataclass to export: ``get()`` returns it (read at every scrape)."""

    get: Callable[[], object]
    naming: Naming = Naming()


class StatsCollector(Collector):
    """Counters read from stats dataclasses at scrape time (see the module docstring).

    ``sources()`` is called at every scrape (so stats objects created later, or replaced, are
    found); the same dataclass reached twice, or two fields mapped to one name, are exported
    once. ``labels`` are constant labels added to every sample (e.g. ``{"group": "workers"}``);
    ``periodic()`` returns the daemon's housekeeping tasks, exported as
    ``<namespace>_housekeeping_runs_total{task}`` and ``…_failures_total{task}``.
    """

    def __init__(
        self,
        namespace: str,
        sources: Callable[[], Iterable[Source]],
        *,
        labels: Mapping[str, str] | None = None,
        periodic: Callable[[], list[Periodic]] | None = None,
    ) -> None:
        self.namespace = namespace
        self.sources = sources
        self.labels = dict(labels or {})
        self.periodic = periodic

    def describe(self) -> list[Metric]:
        """Nothing up front: the fields are only known at scrape time."""
        return []

    def collect(self) -> Iterator[Metric]:
        """One counter family per field of every source, then the housekeeping tasks."""
        seen_objects: set[int] = set()
        names: set[str] = set()
        for source in self.sources():
            stats = source.get()
            if not dataclasses.is_dataclass(stats) or id(stats) in seen_objects:
                continue
            seen_objects.add(id(stats))
            naming = source.naming
            prefix = f"{self.namespace}_{naming.subsystem}" if naming.subsystem else \
                self.namespace
            for family in self._fields(prefix, stats, naming.names, naming.skip):
                if family.name not in names:
                    names.add(family.name)
                    yield family
        if self.periodic is not None:
            yield from self._housekeeping(self.periodic())

    def _fields(
        self, prefix: str, stats: Any, names: Mapping[str, tuple[str, str]],
        skip: frozenset[str],
    ) -> Iterator[Metric]:
        keys, values = list(self.labels), list(self.labels.values())
        for f in dataclasses.fields(stats):
            if f.name in skip:
                continue
            value = getattr(stats, f.name)
            name, doc = names.get(f.name, (f.name, f"{f.name.replace('_', ' ')} (since start)"))
            if isinstance(value, bool):
                continue
            if isinstance(value, int):
                family = CounterMetricFamily(f"{prefix}_{name}", doc, labels=keys)
                family.add_metric(values, value)
                yield family
            elif isinstance(value, dict) and all(isinstance(v, int) for v in value.values()):
                family = CounterMetricFamily(f"{prefix}_{name}", doc, labels=[*keys, "reason"])
                for reason, count in sorted(value.items()):
                    family.add_metric([*values, str(reason)], count)
                yield family
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                yield from self._fields(f"{prefix}_{name}", value, {}, frozenset())

    def _housekeeping(self, tasks: list[Periodic]) -> Iterator[Metric]:
        keys, values = [*self.labels, "task"], list(self.labels.values())
        runs = CounterMetricFamily(f"{self.namespace}_housekeeping_runs",
                                   "Housekeeping passes that completed, by task.", labels=keys)
        failures = CounterMetricFamily(
            f"{self.namespace}_housekeeping_failures",
            "Housekeeping passes that failed (database or Redis unavailable), by task.",
            labels=keys)
        for task in tasks:
            runs.add_metric([*values, task.name], task.runs)
            failures.add_metric([*values, task.name], task.failures)
        yield runs
        yield failures


def discover(owner: object, known: Mapping[str, Naming]) -> list[Source]:
    """The stats dataclasses a daemon object carries, found at every scrape: its attribute
    ``stats`` (the daemon's own), any ``<name>_stats``, and the ``stats`` of a component
    attribute (``relay.repairer.stats``). ``known`` names them by attribute; another is
    exported under its attribute name (minus ``_stats``). This is how counters a later change
    adds are exported without touching the metrics code."""
    found: list[Source] = []
    for attr, value in dict(vars(owner)).items():  # a copy: the loop thread may add one
        if attr == "stats" or attr.endswith("_stats"):
            stats = value
        elif attr.startswith("_") or isinstance(value, type):
            continue
        else:
            stats = getattr(value, "stats", None)
        if not dataclasses.is_dataclass(stats) or isinstance(stats, type):
            continue
        default = Naming("" if attr == "stats" else attr.removesuffix("_stats"))
        found.append(Source(functools.partial(_same, stats), known.get(attr, default)))
    return found


def _same(value: object) -> object:
    return value


def scrape_up(namespace: str, up: Mapping[str, bool], labels: Mapping[str, str]) -> Metric:
    """``<namespace>_scrape_up{source}``: 1 when the scrape-time reads of ``source``
    (``database``, ``redis``) succeeded, 0 when their gauges are missing from this scrape."""
    family = GaugeMetricFamily(
        f"{namespace}_scrape_up",
        "1 if this scrape's reads from the source succeeded (0: its gauges are missing).",
        labels=[*labels, "source"])
    for source, ok in up.items():
        family.add_metric([*labels.values(), source], 1.0 if ok else 0.0)
    return family


class LabelCache:
    """Children of a labelled counter or histogram, looked up once per label tuple.

    ``metric.labels(...)`` validates and hashes its arguments on every call; the hot path
    calls it per batch and label pair, so the children are kept in a plain dict.
    """

    def __init__(self, metric: Counter | Histogram) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child
