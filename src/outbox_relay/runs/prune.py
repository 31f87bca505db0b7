"""Retention of runs: delete terminal runs (``completed``, ``failed``) unchanged for
``retention_runs`` (30 days by default; ``off`` keeps them: a run's record is the user's
result, so fetch it within the window). Every consumer daemon of a database with the runs
tables runs this rule, and ``outbox prune``.

What is guaranteed:

* **Only terminal runs**, by their last change (``updated_at_ms``) against the database's
  clock minus the retention. An active run, or one waiting for answers, is never deleted,
  however old.
* **Bounded transactions**: at most ``batch`` runs per transaction; on PostgreSQL the rows are
  picked with ``FOR UPDATE SKIP LOCKED``, so several daemons (and ``outbox prune``) prune at
  once and each run is deleted once.

What a deleted run means afterwards: ``GET /runs/{id}`` answers ``not_found``; a late run event
still in a stream is skipped by the worker as ``not_found`` (a terminal run accepted no write
anyway); the run id may be used again by a new ``POST``. The run's outbox rows are the relay's
retention (``retention_delivered``).
"""

from __future__ import annotations

from sqlalchemy import Engine, delete, func, select

from outbox_relay.runs import pipeline as rs
from outbox_relay.runs.schema import runs
from outbox_relay.shared.db import db_now_ms, delete_in_batches, is_postgres
from outbox_relay.shared.db_errors import translate_errors


def prune_terminal_runs(
    engine: Engine,
    retention_s: float,
    *,
    batch: int,
    max_batches: int | None = None,
    dry_run: bool = False,
) -> tuple[int, bool]:
    """Delete terminal runs older than ``retention_s`` (0: off), ``batch`` per transaction, at
    most ``max_batches`` transactions (``None``: until none is left).

    Returns ``(runs deleted, more remain)``; ``dry_run`` counts every run that would be
    deleted and changes nothing.
    """
    if retention_s <= 0:
        return 0, False
    postgres = is_postgres(engine)
    with translate_errors():
        with engine.connect() as conn:
            cutoff = int(conn.execute(select(db_now_ms(postgres))).scalar_one())
        cutoff -= int(retention_s * 1000)
        old = (runs.c.status.in_(sorted(rs.TERMINAL)), runs.c.updated_at_ms < cutoff)
        if dry_run:
            with engine.connect() as conn:
                return int(conn.execute(select(func.count()).where(*old)).scalar_one()), False
        picked = select(runs.c.id).where(*old).order_by(runs.c.updated_at_ms).limit(batch)
        if postgres:
            picked = picked.with_for_update(skip_locked=True)
        statement = delete(runs).where(runs.c.id.in_(picked.scalar_subquery()))
        return delete_in_batches(engine, statement, batch, max_batches)
