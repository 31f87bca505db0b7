"""Retention of the outbox: delete delivered rows older than ``retention_delivered``.

What is guaranteed:

* **Never an undelivered row.** Every statement requires ``delivered_at_ms IS NOT NULL`` and
  older than the cut-off; a row the relay has not settled has ``delivered_at_ms`` NULL.
* **Bounded transactions.** Each transaction deletes at most ``batch`` rows, oldest delivery
  first (the partial index ``ix_outbox_events_delivered``), so neither the relay's own takes
  and settles nor a producer ever waits behind one long delete.
* **Several pruners at once** (every relay of a deployment runs one; ``outbox prune`` besides):
  on PostgreSQL each batch picks its rows with ``FOR UPDATE SKIP LOCKED``, so two pruners take
  different rows instead of queueing on the same ones, and each row is deleted (and counted)
  once. SQLite serializes whole transactions (``BEGIN IMMEDIATE``), so it needs no lock clause.
* **One clock.** The cut-off is the database's clock (:func:`shared.db.db_now_ms`) minus the
  retention, read once per pass, so a host whose clock is off prunes neither early nor late by
  its own error.

* **Only what no group still needs** (with ``stream_trim``, the default): a row is pruned only
  below its stream's trim floor (relay/trim.py: every group acknowledged it and the stream no
  longer holds it). A row above the floor may be the only copy left to refill a stream after a
  Redis loss, for a group that has not read it yet. With trimming off, age alone decides: a
  group lagging longer than ``retention_delivered`` then loses what Redis loses.

A pruned row can no longer be refilled by a repair: that is why the consumer's receipts must
outlive it (``retention_inbox >= retention_delivered + stream_keep_s``, checked by the
settings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, delete, func, select

from outbox_relay.shared.db import db_now_ms, delete_in_batches, is_postgres
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.schema import outbox, stream_trims


@dataclass
class PruneStats:
    """Counters of the relay's retention task since start (exported as metrics)."""

    passes: int = 0
    outbox_rows: int = 0  # delivered rows deleted


@dataclass(frozen=True)
class Pruned:
    """What one call did: rows deleted (or, dry-run, that would be) and whether more remain."""

    rows: int
    more: bool  # stopped at ``max_batches`` with a full last batch: call again soon


def prune_delivered(
    engine: Engine,
    retention_s: float,
    *,
    batch: int,
    max_batches: int | None = None,
    dry_run: bool = False,
    below_trim_floor: bool = True,
) -> Pruned:
    """Delete delivered rows older than ``retention_s`` seconds, ``batch`` rows per transaction,
    at most ``max_batches`` transactions (``None``: until none is left).

    ``dry_run`` counts the rows that would be deleted (all of them, not bounded by
    ``max_batches``) and changes nothing. ``retention_s`` of 0 means the rule is off.
    """
    if retention_s <= 0:
        return Pruned(0, False)
    with translate_errors():
        cutoff = _cutoff_ms(engine, retention_s)
        old: tuple[Any, ...] = (outbox.c.delivered_at_ms.is_not(None),
                                outbox.c.delivered_at_ms < cutoff)
        if below_trim_floor:
            # Only what every group acknowledged and the relay trimmed: a row above the floor
            # may still be needed to refill the stream after a Redis loss (a lagging group).
            # Floors are "<ms>-0" and ids have 13-digit ms, so text order is id order here.
            floor = (
                select(stream_trims.c.floor_entry_id)
                .where(stream_trims.c.stream == outbox.c.stream,
                       stream_trims.c.partition == outbox.c.partition)
                .scalar_subquery()
            )
            old += (outbox.c.entry_id < floor,)
        if dry_run:
            with engine.connect() as conn:
                return Pruned(int(conn.execute(select(func.count()).where(*old)).scalar_one()),
                              False)
        picked = (
            select(outbox.c.seq).where(*old).order_by(outbox.c.delivered_at_ms).limit(batch)
        )
        if is_postgres(engine):
            picked = picked.with_for_update(skip_locked=True)
        statement = delete(outbox).where(outbox.c.seq.in_(picked.scalar_subquery()))
        rows, more = delete_in_batches(engine, statement, batch, max_batches)
        return Pruned(rows, more)


def _cutoff_ms(engine: Engine, retention_s: float) -> int:
    with engine.connect() as conn:
        now = int(conn.execute(select(db_now_ms(is_postgres(engine)))).scalar_one())
    return now - int(retention_s * 1000)
