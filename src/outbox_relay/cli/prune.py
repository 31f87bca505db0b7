"""Retention: ``outbox prune [--dry-run] [--json]``, and the same pruning inside the daemons.

What is pruned (each rule's guarantees are in its module):

* delivered outbox rows older than ``retention_delivered`` (:mod:`relay.prune`), by every relay;
* inbox receipts and aggregate heads older than ``retention_inbox`` (:mod:`consumer.prune`:
  never a dead receipt whose letter exists, never one whose event could come back), by every
  consumer;
* terminal runs older than ``retention_runs`` (:mod:`runs.prune`), by every consumer, where
  the database has the runs tables. That setting is the runs component's
  (:class:`runs.settings.RunsRetentionSettings`): the CLI adds it to the settings of
  ``outbox consume`` and ``outbox prune`` (:mod:`cli.settings`); settings without it prune no
  runs.

This module only wires them: the relay and the consumer never learn of each other. In a daemon
the task ``retention`` (a :class:`shared.periodic.Periodic`) runs every ``prune_interval_s`` on
the loop thread; a pass deletes at most :data:`PASS_BATCHES` batches per table, so the loop is
never starved, and when it stopped at that bound (a backlog of old rows: the first pass after
enabling retention, or a burst) the next pass comes after :data:`CATCH_UP_S` instead of the
full interval. A pass that deleted anything logs one INFO line; its counts add up in the
daemon's ``prune_stats`` (exported as metrics).

``outbox prune`` runs every rule to the end once (``--dry-run``: counts only, writes nothing,
and never creates a database file).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any

from sqlalchemy import Engine

from outbox_relay.cli.settings import PruneSettings
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.prune import InboxPruned, InboxPruner
from outbox_relay.consumer.prune import PruneStats as ConsumerPruneStats
from outbox_relay.relay.daemon import Relay
from outbox_relay.relay.prune import PruneStats as RelayPruneStats
from outbox_relay.relay.prune import prune_delivered
from outbox_relay.runs import schema as runs_schema
from outbox_relay.runs.prune import prune_terminal_runs
from outbox_relay.runs.settings import RunsRetentionSettings
from outbox_relay.shared import db
from outbox_relay.shared.periodic import Periodic
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings, RetentionSettings

log = logging.getLogger("outbox.retention")

PASS_BATCHES = 5
"""Batches (of ``prune_batch`` rows) one daemon pass deletes per table, at most."""
CATCH_UP_S = 1.0
"""Delay of the next pass after one that stopped at its bound with old rows left."""


# -- in the daemons ----------------------------------------------------------------------------


def register_relay(relay: Relay, settings: RelaySettings) -> None:
    """Add the ``retention`` task (delivered outbox rows) to ``relay.periodic``; nothing when
    ``retention_delivered`` is off."""
    if settings.retention_delivered <= 0:
        return
    task = Periodic("retention", settings.prune_interval_s, lambda: None)
    stats = relay.prune_stats = RelayPruneStats()

    def run() -> None:
        result = prune_delivered(relay.engine, settings.retention_delivered,
                                 batch=settings.prune_batch, max_batches=PASS_BATCHES,
                                 below_trim_floor=settings.stream_trim)
        stats.passes += 1
        stats.outbox_rows += result.rows
        _catch_up(task, result.more)
        if result.rows:
            log.info("retention: pruned %d delivered outbox rows%s", result.rows,
                     " (more to prune)" if result.more else "")

    task.run = run
    relay.periodic.append(task)


def register_consumer(consumer: Consumer, settings: ConsumerSettings) -> None:
    """Add the ``retention`` task (receipts, heads; terminal runs when the settings carry
    ``retention_runs``, it is on and the database has the runs tables) to
    ``consumer.periodic``; nothing when both rules are off."""
    retention_runs = _runs_retention(consumer.engine, settings)
    if settings.retention_inbox <= 0 and retention_runs <= 0:
        return
    pruner = InboxPruner(consumer.engine, consumer.client, settings.retention_inbox,
                         batch=settings.prune_batch, below_trim_floor=settings.stream_trim)
    # On PostgreSQL the pass runs on a thread of its own (shared/periodic.py): its deletes must
    # not hold up consuming. SQLite serializes writers anyway: there it stays on the loop.
    task = Periodic("retention", settings.prune_interval_s, lambda: None,
                    background=db.is_postgres(consumer.engine))
    stats = consumer.prune_stats = ConsumerPruneStats()

    def run() -> None:
        inbox = pruner.prune(max_batches=PASS_BATCHES)
        runs, more_runs = prune_terminal_runs(consumer.engine, retention_runs,
                                              batch=settings.prune_batch,
                                              max_batches=PASS_BATCHES)
        stats.passes += 1
        stats.receipts += inbox.receipts
        stats.heads += inbox.heads
        stats.runs += runs
        more = inbox.more or more_runs
        _catch_up(task, more)
        if inbox.receipts or inbox.heads or inbox.retries or runs:
            log.info("retention: pruned %d receipts, %d heads, %d retry rows, %d runs%s",
                     inbox.receipts, inbox.heads, inbox.retries, runs,
                     " (more to prune)" if more else "")

    task.run = run
    consumer.periodic.append(task)


def _catch_up(task: Periodic, more: bool) -> None:
    if more:
        task.next_at = min(task.next_at, time.monotonic() + CATCH_UP_S)


# -- outbox prune ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--dry-run`` and ``--json`` besides the settings flags."""
    parser.add_argument("--dry-run", action="store_true",
                        help="count what would be pruned; delete nothing")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")


def main(args: argparse.Namespace) -> int:
    """Prune every table once, to the end; print the counts per table."""
    from outbox_relay.cli import options

    settings = options.load_settings(PruneSettings, args)
    engine = db.existing_engine(settings.database_url)
    try:
        db.check_schema(engine)
        report = prune_all(engine, settings, dry_run=args.dry_run)
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(report))
    else:
        print(render(report))
    return 0


def prune_all(engine: Engine, settings: RetentionSettings, *, dry_run: bool) -> dict[str, Any]:
    """Run every rule to the end; ``{"dry_run", "pruned": {table: count or None (rule off)},
    "kept": {...}}``."""
    batch = settings.prune_batch
    pruned: dict[str, int | None] = {
        "outbox_events": None, "outbox_inbox": None, "outbox_inbox_heads": None,
        "outbox_runs": None,
    }
    kept = {"dead_letter_exists": 0, "above_trim_floor": 0, "row_undelivered": 0}
    if settings.retention_delivered > 0:
        pruned["outbox_events"] = prune_delivered(
            engine, settings.retention_delivered, batch=batch, dry_run=dry_run,
            below_trim_floor=settings.stream_trim).rows
    if settings.retention_inbox > 0:
        client = connect_redis(settings.redis_url)
        try:
            inbox: InboxPruned = InboxPruner(
                engine, client, settings.retention_inbox, batch=batch,
                below_trim_floor=settings.stream_trim,
            ).prune(dry_run=dry_run)
        finally:
            client.close()
        pruned["outbox_inbox"], pruned["outbox_inbox_heads"] = inbox.receipts, inbox.heads
        pruned["outbox_consumer_retries"] = inbox.retries
        kept = {"dead_letter_exists": inbox.kept_letter, "above_trim_floor": inbox.kept_floor,
                "row_undelivered": inbox.kept_undelivered}
    retention_runs = _runs_retention(engine, settings)
    if retention_runs > 0:
        pruned["outbox_runs"] = prune_terminal_runs(
            engine, retention_runs, batch=batch, dry_run=dry_run)[0]
    return {"dry_run": dry_run, "pruned": pruned, "kept_receipts": kept}


def _runs_retention(engine: Engine, settings: RetentionSettings) -> float:
    """``retention_runs``, or 0 (off): when the settings do not carry the runs rule, or (with a
    warning) when the runs migrations never ran."""
    if not isinstance(settings, RunsRetentionSettings) or settings.retention_runs <= 0:
        return 0.0
    if not runs_schema.in_use(engine):
        if "retention_runs" in settings.model_fields_set:  # the default (30 d) is no request
            log.warning("retention_runs is set but the runs tables were never set up here "
                        "(outbox db upgrade --runs); ignored")
        return 0.0
    return settings.retention_runs


def render(report: dict[str, Any]) -> str:
    """The report as lines ``table  count`` (``off`` for a rule that is off)."""
    verb = "would prune" if report["dry_run"] else "pruned"
    lines = [f"{'table':<20} {verb}"]
    for table, count in report["pruned"].items():
        lines.append(f"{table:<20} {'off' if count is None else count}")
    kept = report["kept_receipts"]
    lines.append(f"old receipts kept: {kept['dead_letter_exists']} (dead letter exists), "
                 f"{kept['above_trim_floor']} (not below the stream's trim floor)")
    return "\n".join(lines)
