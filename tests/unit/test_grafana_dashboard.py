"""The Grafana dashboard (docs/grafana/outbox.json) and docs/operations.md name only metrics the
daemons really export, with labels those metrics carry: a renamed metric or label fails here,
not as an empty panel or an alert that can never fire.

What is exported is read from the daemons' own registries, built as ``cli/observe.py`` builds
them (relay, consumer with hygiene, retention and the run worker's counters, runs by status) on
a SQLite file and fakeredis, with one event and one outcome recorded so that labelled series
show their label names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

import fakeredis
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Connection, Engine

from outbox_relay.cli import prune as retention
from outbox_relay.cli.demo_app import PIPELINE
from outbox_relay.consumer import Handlers, hygiene
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.metrics import ConsumerMetrics
from outbox_relay.consumer.ordering import Delivery, Outcome
from outbox_relay.producer import Producer
from outbox_relay.relay.daemon import Relay
from outbox_relay.relay.metrics import RelayMetrics
from outbox_relay.runs import schema as runs_schema
from outbox_relay.runs.metrics import SWEEPER_NAMES, WORKER_NAMES, RunsCollector
from outbox_relay.runs.sweeper import SweepStats
from outbox_relay.runs.worker import WorkerStats
from outbox_relay.shared import db, keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.schema import metadata
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings
from tests.helpers import ROOT

DASHBOARD = ROOT / "docs" / "grafana" / "outbox.json"
OPERATIONS = ROOT / "docs" / "operations.md"

METRIC = re.compile(r"\boutbox_[a-z0-9_]+\b")
SELECTOR = re.compile(r"\b(outbox_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
TARGET_LABELS = frozenset({"instance", "job"})  # added by Prometheus to every scraped series
DOC_METRIC = re.compile(r"\boutbox_(?:relay|consumer)_[a-z0-9_]+\b|\boutbox_runs\b")
PREFIX = "t"
GROUP = "billing"
STREAM = "orders"
EVENT_TYPE = "order.placed"

Exported = dict[str, frozenset[str] | None]
"""Series name (``…_total``, ``…_bucket`` …) → the label names its samples carry (None when
the series had no sample to show them)."""


# -- what the daemons export --------------------------------------------------------------------


def _series(registry: CollectorRegistry) -> Exported:
    """Every series name of ``registry``: from the samples, and from each family's type (a
    labelled counter nobody incremented yet still exports ``<name>_total`` later)."""
    found: dict[str, set[str] | None] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}
    for family in registry.collect():
        for suffix in suffixes.get(family.type, ("",)):
            found.setdefault(family.name + suffix, None)
        for sample in family.samples:
            labels = found.get(sample.name) or set()
            found[sample.name] = labels | set(sample.labels)
    return {name: None if labels is None else frozenset(labels)
            for name, labels in found.items()}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    eng = db.make_engine(f"sqlite:///{tmp_path_factory.mktemp('dashboard')}/outbox.db")
    runs_schema.upgrade(eng)  # the core and the runs tables
    yield eng
    eng.dispose()


def _relay_series(engine: Engine, client: fakeredis.FakeRedis) -> Exported:
    settings = RelaySettings(key_prefix=PREFIX, partitions=2)
    relay = Relay(settings, engine, client)
    retention.register_relay(relay, settings)  # as cli/main.py: task "retention"
    metrics = RelayMetrics(relay)
    with engine.begin() as conn:  # one undelivered row: the backlog gauges get samples
        Producer(source="test", partitions=2).enqueue(
            conn, type=EVENT_TYPE, stream=STREAM, aggregate_type="order", aggregate_id="o-1",
            revision=1, data={})
    metrics.append_failed("unknown_outcome", 1)
    return _series(metrics.registry)


def _consumer_series(engine: Engine, client: fakeredis.FakeRedis) -> Exported:
    settings = ConsumerSettings(key_prefix=PREFIX, partitions=2, group=GROUP, streams=STREAM)
    handlers = Handlers()

    @handlers.on(EVENT_TYPE)
    def handle(conn: Connection, event: Event) -> None:
        """Nothing: only its duration histogram is wanted."""

    # What a Runs app (cli/demo_app.py) adds: its stats and the runs-by-status collector.
    handlers.observe("run_worker", WorkerStats(), WORKER_NAMES)
    handlers.observe("run_sweeper", SweepStats(), SWEEPER_NAMES)
    handlers.collectors.append(RunsCollector(engine, PIPELINE))
    consumer = Consumer(settings, engine, client, handlers)  # unfenced: reads every key
    for key in consumer.keys:
        client.xgroup_create(key, GROUP, id="0", mkstream=True)
    hygiene.install(consumer)  # as cli/main.py: task "group hygiene"
    retention.register_consumer(consumer, settings)  # task "retention"
    metrics = ConsumerMetrics(consumer)
    event = Event(id="o-1:order.placed:1", source="test", type=EVENT_TYPE,
                  time=datetime.now(UTC), aggregatetype="order", aggregateid="o-1", revision=1)
    delivery = Delivery(keys.stream_key(PREFIX, STREAM, 0), "1-1", event, 1)
    metrics.claimed([Outcome(delivery, "dead", "out_of_order")], 0.001)
    return _series(metrics.registry)


@pytest.fixture(scope="module")
def exported(engine: Engine) -> Exported:
    """Every series the relay, consumer and ``serve`` registries export (serve's is
    ``outbox_runs``, part of the consumer's too)."""
    client = fakeredis.FakeRedis()
    found = {**_relay_series(engine, client), **_consumer_series(engine, client)}
    return {name: labels for name, labels in found.items() if name.startswith("outbox_")}


# -- what the dashboard and the docs ask for -----------------------------------------------------


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and variable queries."""
    queries = [target["expr"] for panel in dashboard["panels"]
               for target in panel.get("targets", [])]
    queries += [var["definition"] for var in dashboard["templating"]["list"]
                if var.get("type") == "query"]
    return queries


def alert_queries(markdown: str) -> list[str]:
    """The ``expr`` of every rule in the YAML blocks of a markdown text (single-line, or a
    folded ``>`` block of more-indented lines)."""
    queries: list[str] = []
    for block in re.findall(r"```yaml\n(.*?)```", markdown, flags=re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            key, _, value = line.strip().partition(":")
            if key != "expr":
                continue
            if value.strip() not in (">", "|"):
                queries.append(value.strip())
                continue
            indent = len(line) - len(line.lstrip())
            folded = []
            for following in lines[i + 1:]:
                if following.strip() and len(following) - len(following.lstrip()) <= indent:
                    break
                folded.append(following.strip())
            queries.append(" ".join(folded))
    return queries


def problems(queries: Iterable[str], exported: Exported) -> list[str]:
    """What in ``queries`` the registries do not export: unknown metric names, label matchers
    a metric does not carry, grouping labels none of an expression's metrics carries."""
    found: list[str] = []
    for query in queries:
        names = set(METRIC.findall(query))
        for name in sorted(names - set(exported)):
            found.append(f"unknown metric {name} in: {query}")
        for name, matchers in SELECTOR.findall(query):
            labels = exported.get(name)
            if labels is None:  # unknown (reported above) or no sample to show its labels
                continue
            for label in MATCHER.findall(matchers):
                if label not in labels:
                    found.append(f"{name} has no label {label!r} in: {query}")
        shown = [exported.get(n) for n in names]
        carried = set(TARGET_LABELS).union(*(labels or () for labels in shown))
        if all(labels is not None for labels in shown):  # every metric showed its labels
            for grouping in GROUPING.findall(query):
                for label in (part.strip() for part in grouping.split(",")):
                    if label and label not in carried:
                        found.append(f"grouping label {label!r} on none of {sorted(names)}: "
                                     f"{query}")
    return found


# -- tests ----------------------------------------------------------------------------------------


def test_the_registries_are_found(exported: Exported) -> None:
    """The fixture really builds the daemons' registries (so an empty set cannot pass)."""
    for name in ("outbox_relay_rows_delivered_total", "outbox_relay_backlog_rows",
                 "outbox_consumer_outcomes_total", "outbox_consumer_group_lag",
                 "outbox_consumer_run_sweeper_resumed_total", "outbox_runs",
                 "outbox_relay_prune_outbox_rows_total",
                 "outbox_consumer_hygiene_consumers_removed_total"):
        assert name in exported, name
    assert exported["outbox_relay_backlog_rows"] == frozenset({"stream", "partition"})
    assert exported["outbox_consumer_outcomes_total"] == frozenset(
        {"group", "type", "outcome", "reason"})
    assert exported["outbox_relay_leases_held"] == frozenset()  # a sample without labels


def test_the_checker_reports_what_does_not_exist(exported: Exported) -> None:
    assert problems(["sum(rate(outbox_relay_rows_delivered_total[5m]))"], exported) == []
    assert problems(["outbox_relay_rows_delivered"], exported)  # the family, not the series
    assert problems(['outbox_relay_backlog_rows{group="x"}'], exported)
    assert problems(['outbox_relay_leases_held{group="x"}'], exported)
    assert problems(["sum by (task) (outbox_relay_backlog_rows)"], exported)
    assert problems(["sum by (instance, le) (rate(outbox_relay_batch_size_bucket[1m]))"],
                    exported) == []


def test_the_dashboard_is_importable() -> None:
    dashboard = _dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == ["Relay", "Consumer", "Runs", "Housekeeping"]
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_every_dashboard_query_uses_exported_metrics_and_labels(exported: Exported) -> None:
    queries = dashboard_queries(_dashboard())
    assert len(queries) > 40
    assert problems(queries, exported) == []


def test_every_alert_rule_uses_exported_metrics_and_labels(exported: Exported) -> None:
    queries = alert_queries(OPERATIONS.read_text(encoding="utf-8"))
    assert len(queries) >= 15
    assert problems(queries, exported) == []


def test_every_metric_the_operations_doc_names_is_exported(exported: Exported) -> None:
    tables = set(metadata.tables) | set(runs_schema.metadata.tables)  # tables, not metrics
    histograms = {name.removesuffix("_bucket") for name in exported if name.endswith("_bucket")}
    named = set(DOC_METRIC.findall(OPERATIONS.read_text(encoding="utf-8")))
    assert len(named) > 50
    assert sorted(named - set(exported) - histograms - tables) == []
