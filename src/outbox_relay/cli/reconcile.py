"""``outbox reconcile``: the broker-repair check on demand, and runs that nothing will wake.

1. **Streams**: every ``(stream, partition)`` the outbox delivered to is compared with Redis
   (:func:`relay.repair.compare`). A stream that is behind is repaired under a partition lease
   taken for the purpose; a partition leased by a live relay is left to that relay, which runs
   the same repair on its own every few seconds. The lease's epoch fences the repair in Redis
   (:mod:`relay.fence`): a relay that takes the partition meanwhile stops it unharmed.
2. **Stuck runs** (when the database has the runs tables): active (queued or in a stage), no
   live execution lease, no undelivered outbox event, unchanged for ``--stuck-after-s``.
   Nothing will ever wake such a run (its event was dead-lettered, trimmed, or lost with a
   broker that had no persistence before the outbox knew). Each gets a ``run.resume`` through
   the run store, by compare-and-set, exactly as the sweeper does for expired leases.

``--dry-run`` reports without writing; ``--json`` prints the report as JSON. Exit status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Any

import redis
from sqlalchemy import Engine

from outbox_relay.cli import options
from outbox_relay.relay import leases, repair, repair_store
from outbox_relay.runs import pipeline as rs
from outbox_relay.runs import schema as runs_schema
from outbox_relay.runs.errors import InvalidTransitionError
from outbox_relay.runs.settings import RunSettings
from outbox_relay.runs.store import store_for
from outbox_relay.shared import db
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.errors import (
    ConflictError,
    LeaseLostError,
    NotFoundError,
)
from outbox_relay.shared.leases import db_now
from outbox_relay.shared.redaction import redact_url
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.settings import CommonSettings

LEASE_TTL_MS = 30_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's own flags (settings flags are added by the caller)."""
    parser.add_argument("--dry-run", action="store_true", help="report only, change nothing")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--stuck-after-s", type=float, default=60.0,
                        help="a run unchanged for this long can be stuck (default 60)")
    parser.add_argument("--limit", type=int, default=1000, help="stuck runs handled (default 1000)")


def main(args: argparse.Namespace) -> int:
    """Run both checks, print the report."""
    settings = options.load_settings(CommonSettings, args)
    engine = db.existing_engine(settings.database_url)
    db.check_schema(engine)
    uses_runs = runs_schema.in_use(engine)
    if uses_runs:
        runs_schema.MIGRATIONS.check(engine)
    client = connect_redis(settings.redis_url)
    report = {
        "database_url": redact_url(settings.database_url),
        "dry_run": args.dry_run,
        "streams": check_streams(engine, client, settings, dry_run=args.dry_run),
        # None: this database has no runs tables (the application does not use runs)
        "stuck_runs": check_runs(engine, settings, dry_run=args.dry_run,
                                 stuck_after_ms=int(args.stuck_after_s * 1000), limit=args.limit)
        if uses_runs else None,
    }
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def check_streams(
    engine: Engine, client: redis.Redis, settings: CommonSettings, *, dry_run: bool
) -> list[dict[str, Any]]:
    """Compare every delivered-to stream with Redis; repair those behind (unless dry run)."""
    node = f"reconcile:{socket.gethostname()}:{os.getpid()}"
    counts = repair_store.delivered_counts(engine, list(range(settings.partitions)))
    out = []
    for (stream, partition), delivered in sorted(counts.items()):
        f = repair.compare(engine, client, settings.key_prefix, stream, partition, delivered)
        item: dict[str, Any] = {
            "key": f.key, "delivered": delivered, "length": f.state.length,
            "top": f.state.top, "newest_delivered": f.newest, "behind": f.reason,
            "action": None, "repaired_entries": 0,
        }
        if f.reason is not None and not dry_run:
            epoch = leases.take_free_lease(engine, partition, node, LEASE_TTL_MS)
            if epoch is None:
                item["action"] = "left to the relay holding the partition"
            else:
                try:
                    how, n = repair.repair(engine, client, f, epoch=epoch)
                    item["action"], item["repaired_entries"] = how, n
                except LeaseLostError:
                    item["action"] = "stopped: a relay took the partition meanwhile"
                finally:
                    leases.release_leases(engine, node, {partition: epoch})
        out.append(item)
    return out


def check_runs(
    engine: Engine, settings: CommonSettings, *, dry_run: bool, stuck_after_ms: int, limit: int
) -> list[dict[str, Any]]:
    """Report stuck runs; give each a ``run.resume`` (unless dry run)."""
    run_store = store_for(settings, source="outbox-reconcile")
    max_attempts = RunSettings.model_fields["run_max_attempts"].default
    out = []
    with translate_errors(), engine.connect() as conn:
        now = db_now(conn)  # the clock run leases and updated_at_ms are written with
        stuck = run_store.stuck(conn, now=now, stuck_after_ms=stuck_after_ms, limit=limit)
    for run_id, revision, status in stuck:
        item: dict[str, Any] = {"id": run_id, "revision": revision, "status": status,
                                "action": None}
        if not dry_run:
            try:
                with translate_errors(), engine.begin() as conn:
                    row = run_store.resume(conn, run_id, revision, max_attempts=max_attempts)
                item["action"] = "failed" if row.status == rs.FAILED else "resumed"
            except (ConflictError, NotFoundError, InvalidTransitionError):
                item["action"] = "changed meanwhile"
        out.append(item)
    return out


def render(report: dict[str, Any]) -> str:
    """Plain-text report."""
    lines = [f"reconcile {report['database_url']}{' (dry run)' if report['dry_run'] else ''}"]
    behind = [s for s in report["streams"] if s["behind"]]
    lines.append(f"streams: {len(report['streams'])} checked, {len(behind)} behind")
    for s in behind:
        lines.append(f"  {s['key']}: {s['behind']} (length {s['length']}, top {s['top']}, "
                     f"newest delivered {s['newest_delivered']}) -> {s['action'] or 'none'}"
                     f" ({s['repaired_entries']} entries)")
    if report["stuck_runs"] is None:
        lines.append("stuck runs: not checked (no runs tables: `outbox db upgrade --runs` "
                     "creates them)")
        return "\n".join(lines)
    lines.append(f"stuck runs: {len(report['stuck_runs'])}")
    for r in report["stuck_runs"]:
        lines.append(f"  {r['id']} ({r['status']}, revision {r['revision']}) -> "
                     f"{r['action'] or 'none'}")
    return "\n".join(lines)
