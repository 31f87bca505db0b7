"""The producer's statements: the outbox insert of one event or of a list, and its undo.

Each insert is ``INSERT … ON CONFLICT (event_id) DO NOTHING RETURNING …``, so a duplicate id
returns no row instead of aborting the caller's PostgreSQL transaction. On PostgreSQL with
``notify`` the insert is a CTE selected together with ``pg_notify`` (queued in the transaction,
delivered only on commit), still one round trip: one notification per event for
:func:`one_event`, one per distinct partition of the inserted rows for :func:`many_events`.

SQLAlchemy cannot cache the compiled form of an ``INSERT`` inside a CTE (the statement has no
cache key), so ``connection.execute`` compiled it on every enqueue: half of the producer's added
cost (bench/PERFORMANCE.md). Each statement is compiled here once per driver (and row count),
and sent as text with ``exec_driver_sql``.
"""

from __future__ import annotations

import functools
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    ClauseElement,
    Delete,
    Dialect,
    String,
    bindparam,
    delete,
    func,
    select,
    true,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.compiler import SQLCompiler

from outbox_relay.shared.db import db_now_ms
from outbox_relay.shared.schema import outbox

COLUMNS = (
    "event_id", "stream", "partition", "aggregate_type", "aggregate_id", "revision", "type",
    "source", "payload", "headers", "created_at_ms",
)
"""The columns the producer fills; ``available_at_ms`` is the database's clock + ``delay_ms``."""

ROWS_PER_STATEMENT = 500
"""The most rows :func:`many_events` puts in one statement (6,000 parameters: under SQLite's
32,766 and PostgreSQL's 65,535); a longer list is sent as several statements."""


def one_event(dialect: Dialect, params: dict[str, Any], notify: bool) -> tuple[str, Any]:
    """The insert of one event (returns its ``seq``, no row if the id exists) and its
    parameters in the driver's own style; ``pg_notify`` of ``notify_channel`` with
    ``notify_payload`` when ``notify`` and the database is PostgreSQL."""
    notify = notify and dialect.name == "postgresql"
    sql, order = _compiled(dialect.name, dialect.driver, dialect, notify, 0)
    if order is None:
        return sql, params
    return sql, tuple(params[name] for name in order)


def many_events(
    dialect: Dialect, rows: list[dict[str, Any]], notify: bool, channel: str
) -> list[tuple[str, Any]]:
    """The inserts of ``rows`` (:data:`ROWS_PER_STATEMENT` a statement, in list order), each
    returning the ``event_id`` of the rows it inserted; with ``notify`` on PostgreSQL, each
    notifies ``channel`` once per distinct partition it inserted into."""
    notify = notify and dialect.name == "postgresql"
    calls = []
    for start in range(0, len(rows), ROWS_PER_STATEMENT):
        chunk = rows[start:start + ROWS_PER_STATEMENT]
        params = {f"{name}_{i}": row[name] for i, row in enumerate(chunk)
                  for name in (*COLUMNS, "delay_ms")}
        if notify:
            params["notify_channel"] = channel
        sql, order = _compiled(dialect.name, dialect.driver, dialect, notify, len(chunk))
        calls.append((sql, params if order is None else tuple(params[n] for n in order)))
    return calls


def forget(event_ids: list[str]) -> Delete:
    """Delete rows this transaction just inserted (an :meth:`Producer.enqueue_many` that found
    a duplicate takes back the rest of its list)."""
    return delete(outbox).where(outbox.c.event_id.in_(event_ids))


@functools.lru_cache(maxsize=256)
def _compiled(
    name: str, driver: str, dialect: Dialect, notify: bool, rows: int
) -> tuple[str, tuple[str, ...] | None]:
    """A statement compiled once per (dialect, driver, notify, row count; 0: :func:`one_event`):
    SQL text and, for a positional paramstyle, the parameter names in order."""
    postgres = name == "postgresql"
    statement = _insert_one(postgres, notify) if rows == 0 else _insert_many(
        postgres, notify, rows)
    compiled = cast(SQLCompiler, statement.compile(dialect=dialect))
    order = tuple(compiled.positiontup or ()) if compiled.positional else None
    return compiled.string, order


def _values(postgres: bool, suffix: str = "") -> dict[str, Any]:
    """One row's values as bind parameters named ``<column><suffix>``."""
    values: dict[str, Any] = {
        column: bindparam(column + suffix, type_=outbox.c[column].type) for column in COLUMNS
    }
    # Delivery order is decided by times of one clock, the database's (a producer host whose
    # clock is off must not delay an event behind a later one of its aggregate).
    values["available_at_ms"] = db_now_ms(postgres) + bindparam(
        "delay_ms" + suffix, type_=BigInteger())
    return values


def _insert(postgres: bool, values: Any) -> Any:
    dialect_insert = postgresql.insert if postgres else sqlite.insert
    return dialect_insert(outbox).values(values).on_conflict_do_nothing(
        index_elements=["event_id"])


def _insert_one(postgres: bool, notify: bool) -> ClauseElement:
    """``INSERT … RETURNING seq``; with ``notify``, selected together with ``pg_notify``."""
    ins = _insert(postgres, _values(postgres)).returning(outbox.c.seq)
    if not notify:
        return cast(ClauseElement, ins)
    cte = ins.cte("ins")
    woken = func.pg_notify(
        bindparam("notify_channel", type_=String()), bindparam("notify_payload", type_=String())
    )
    return select(cte.c.seq, woken).select_from(cte)


def _insert_many(postgres: bool, notify: bool, rows: int) -> ClauseElement:
    """A multi-row ``INSERT … RETURNING event_id``; with ``notify``, the CTE ``ins`` joined with
    the count of one ``pg_notify`` per distinct partition it inserted into (the join makes
    PostgreSQL run the notifying CTE; a CTE nobody reads is not run)."""
    ins = _insert(postgres, [_values(postgres, f"_{i}") for i in range(rows)])
    if not notify:
        return cast(ClauseElement, ins.returning(outbox.c.event_id))
    cte = ins.returning(outbox.c.event_id, outbox.c.partition).cte("ins")
    parts = select(cte.c.partition).distinct().subquery("parts")
    woken = select(func.pg_notify(bindparam("notify_channel", type_=String()),
                                  parts.c.partition.cast(String())).label("w")).subquery(
        "woken")
    count = select(func.count().label("n")).select_from(woken).subquery("notified")
    return select(cte.c.event_id).select_from(cte.join(count, true()))
