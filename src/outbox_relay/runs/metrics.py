"""Runs by status, read from the run store when ``/metrics`` is scraped.

``outbox_runs{status}``: how many runs are in each status now (one ``GROUP BY`` over the
status index). Exported by ``outbox serve`` and ``outbox consume`` (the daemons that own runs);
every instance reads the same table, so take ``max`` by status across instances.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine, func, select

from outbox_relay.runs import pipeline as rs
from outbox_relay.runs.pipeline import Pipeline
from outbox_relay.runs.schema import runs
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.errors import OutboxError

log = logging.getLogger(__name__)

WORKER_NAMES = {
    "leased": ("leased", "Runs leased to this worker by a run event."),
    "stages": ("stages", "Run stages executed."),
    "completed": ("completed", "Runs completed."),
    "asked": ("questions", "Questions asked by runs that then waited for input."),
    "failed": ("failed", "Runs that failed."),
    "lost": ("leases_lost", "Executions stopped because the run's lease expired or moved."),
    "errors": ("errors", "Stages or checkpoints that raised unexpectedly (left to the sweeper)."),
    "skipped": ("skipped", "Run events skipped without executing, by reason."),
}
SWEEPER_NAMES = {
    "resumed": ("resumed", "Runs whose execution lease expired and that got a run.resume."),
    "failed": ("failed", "Runs whose lease expired after run_max_attempts (failed)."),
    "raced": ("raced", "Expired runs another sweeper (or the worker) handled first."),
}
"""The run worker's and the sweeper's counters, exported by the consumer daemon that runs them
as ``outbox_consumer_run_worker_<name>_total`` and ``outbox_consumer_run_sweeper_<name>_total``."""


def runs_by_status(engine: Engine) -> dict[str, int]:
    """``{status: runs}`` for every status that has runs."""
    query = select(runs.c.status, func.count()).group_by(runs.c.status)
    with translate_errors(), engine.connect() as conn:
        return {str(status): int(n) for status, n in conn.execute(query).all()}


class RunsCollector(Collector):
    """``outbox_runs{status}`` at scrape time: every generic status and every stage of
    ``pipeline`` (when known) with 0 when none, and any other status that has runs."""

    def __init__(self, engine: Engine, pipeline: Pipeline | None = None) -> None:
        self.engine = engine
        self.known = rs.GENERIC if pipeline is None else pipeline.statuses

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            counts = runs_by_status(self.engine)
        except OutboxError as err:
            log.debug("runs gauge skipped (absent from this scrape): %s", err)
            return
        family = GaugeMetricFamily("outbox_runs", "Runs in each status now.",
                                   labels=["status"])
        for status in sorted(self.known | set(counts)):
            family.add_metric([status], counts.get(status, 0))
        yield family
