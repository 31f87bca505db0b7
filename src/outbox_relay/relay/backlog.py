"""What the relay's gauges, its progress line and ``outbox status`` read of the outbox backlog.

One statement over the pending rows (the partial index ``ix_outbox_events_pending`` holds only
undelivered rows, so its cost follows the backlog, not the table), in a read-only transaction
of its own, never on the relay's loop thread. How long a row has waited is measured with the
database's clock (:func:`shared.db.db_now_ms`), the clock that wrote its ``available_at_ms``,
so a relay or status host whose clock is off reads the same age.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, func, select

from outbox_relay.shared.db import db_now_ms, is_postgres, now_ms
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.schema import outbox


@dataclass(frozen=True)
class PartitionBacklog:
    """Undelivered rows of one stream partition, when the oldest became deliverable, and the
    database's clock when they were counted (``now_ms``)."""

    stream: str
    partition: int
    rows: int
    oldest_available_at_ms: int
    now_ms: int

    @property
    def waited_ms(self) -> int:
        """How long the oldest row has been deliverable, by the database's clock (0 if none is
        due yet)."""
        return max(self.now_ms - self.oldest_available_at_ms, 0)


def backlog(engine: Engine) -> list[PartitionBacklog]:
    """Undelivered rows per (stream, partition), with the earliest ``available_at_ms``.

    ``available_at_ms`` rather than ``created_at_ms``: a delayed event is not late before it is
    due, so "oldest undelivered age" measures how long deliverable work has waited.
    """
    query = (
        select(outbox.c.stream, outbox.c.partition, func.count(),
               func.min(outbox.c.available_at_ms))
        .where(outbox.c.delivered_at_ms.is_(None))
        .group_by(outbox.c.stream, outbox.c.partition)
    )
    with translate_errors(), engine.connect() as conn:
        rows = conn.execute(query).all()
        now = int(conn.execute(select(db_now_ms(is_postgres(conn)))).scalar_one())
    return [PartitionBacklog(r[0], int(r[1]), int(r[2]), int(r[3]), now) for r in rows]


def summary(engine: Engine) -> dict[str, Any]:
    """The whole outbox for ``outbox status``: rows undelivered and delivered, the age of the
    oldest undelivered one (from its ``created_at_ms``, the producer host's clock, so read with
    this host's; ``None`` when none), and the undelivered rows by last error."""
    with translate_errors(), engine.connect() as conn:
        undelivered, oldest = conn.execute(
            select(func.count(), func.min(outbox.c.created_at_ms)).where(
                outbox.c.delivered_at_ms.is_(None)
            )
        ).one()
        delivered = conn.execute(
            select(func.count()).where(outbox.c.delivered_at_ms.is_not(None))
        ).scalar_one()
        errors: dict[str, int] = {
            code: count
            for code, count in conn.execute(
                select(outbox.c.last_error, func.count())
                .where(outbox.c.delivered_at_ms.is_(None), outbox.c.last_error.is_not(None))
                .group_by(outbox.c.last_error)
            ).all()
        }
    return {
        "undelivered": undelivered,
        "delivered": delivered,
        "oldest_undelivered_age_s": round((now_ms() - oldest) / 1000, 3) if oldest else None,
        "errors": errors,
    }


REFUSALS = ("redis_oom", "redis_acl", "redis_wrongtype", "redis_not_ready", "redis_error")
"""The codes of an append Redis refused (relay/append.py ``error_code``): the rows' stream
backs off (relay/refusals.py) until Redis accepts it."""


def refused(engine: Engine) -> list[dict[str, object]]:
    """Per (stream, partition, reason): undelivered rows whose last append Redis refused, and
    the most attempts any has had (``outbox status``: the streams backing off, and why)."""
    query = (
        select(outbox.c.stream, outbox.c.partition, outbox.c.last_error, func.count(),
               func.max(outbox.c.attempts))
        .where(outbox.c.delivered_at_ms.is_(None), outbox.c.last_error.in_(REFUSALS))
        .group_by(outbox.c.stream, outbox.c.partition, outbox.c.last_error)
        .order_by(outbox.c.stream, outbox.c.partition)
    )
    with translate_errors(), engine.connect() as conn:
        rows = conn.execute(query).all()
    return [{"stream": r[0], "partition": int(r[1]), "reason": r[2], "rows": int(r[3]),
             "max_attempts": int(r[4])} for r in rows]


def refused_lines(report: list[dict[str, object]] | None) -> list[str]:
    """The ``outbox status`` lines of :func:`refused` (none for an older report)."""
    return [f"relay: stream {r['stream']}:{r['partition']} refused by Redis ({r['reason']}): "
            f"{r['rows']} rows wait, retried with backoff (up to {r['max_attempts']} attempts)"
            for r in report or []]
