"""What a claim writes once its batch is decided (consumer/inbox.py): receipts, heads, retries.

In the claim's transaction, after the decisions and the handlers: a receipt per applied,
superseded or dead event (with its fingerprint), one more duplicate counted on the receipt a
duplicate matched, the aggregates' heads raised to the revisions applied, and the retry rows
upserted for a ``failed`` event with its next attempt time (deleted once it is settled). Each
is one set-based statement whatever the batch size: on PostgreSQL the receipts come as one
JSON array per column (:func:`_receipts_sql`) and the heads through ``json_to_recordset(...)``
(:func:`shared.db.json_recordset`); SQLite runs an ``executemany`` (a loop in C).

One write prepares a claim instead: a dead-letter replay first deletes the group's ``dead``
(or ``lost``) receipt of its event (:func:`reopen_dead_receipt`), so the claim decides again.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    String,
    bindparam,
    column,
    delete,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect

from outbox_relay.consumer.lost import LOST
from outbox_relay.consumer.ordering import (
    APPLIED,
    CONFLICTING_DUPLICATE,
    DEAD,
    DUPLICATE,
    FAILED,
    SUPERSEDED,
    WAITING,
    Ledger,
    Outcome,
    aggregate_key,
)
from outbox_relay.shared.db import IN_FLIGHT, is_postgres, json_recordset, now_ms
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.schema import consumer_retries, inbox, inbox_heads


def write(conn: Connection, group: str, outcomes: list[Outcome], ledger: Ledger, *,
          in_flight: bool = False) -> None:
    """Write what the claim decided. ``in_flight``: ``conn`` is in psycopg's pipeline mode
    (the claim's optimistic path, consumer/pipelining.py) and nobody reads these statements'
    results: they are sent and left in flight, so the claim's writes, the handlers' and the
    end of its pipeline are one round trip; an error is raised where the pipeline ends."""
    options = IN_FLIGHT if in_flight else None
    receipted = [
        o for o in outcomes
        # a conflicting duplicate leaves the receipt it conflicts with as it is
        if o.outcome in (APPLIED, SUPERSEDED, DEAD) and o.error != CONFLICTING_DUPLICATE
    ]
    if receipted:
        _insert_receipts(conn, group, receipted, ledger.now_ms, options)
    duplicates = [o.delivery.event.id for o in outcomes if o.outcome == DUPLICATE]
    if duplicates:
        conn.execute(
            update(inbox)
            .where(inbox.c.group_name == group, inbox.c.event_id == bindparam("b_id"))
            .values(duplicates=inbox.c.duplicates + 1),
            [{"b_id": i} for i in duplicates], execution_options=options,
        )
    applied_heads = _applied_heads(outcomes)
    if applied_heads:
        _upsert_heads(conn, group, applied_heads, options)
    _write_retries(conn, group, outcomes, ledger, options)


def _write_retries(conn: Connection, group: str, outcomes: list[Outcome], ledger: Ledger,
                   options: dict[str, Any] | None = None) -> None:
    """Upsert the retry row of every ``failed`` event that retries (its attempts and next
    attempt time); delete the rows of events this claim settled (applied, dead, superseded,
    duplicate). A replay's failure writes none: its letter, not a pending entry, is its
    record."""
    r = consumer_retries.c
    failed = [o for o in outcomes if o.outcome == FAILED and o.retry_at_ms is not None]
    if failed:
        first = {i: s.first_failed_ms for i, s in ledger.retries.items()}
        rows = [{"group_name": group, "event_id": o.delivery.event.id,
                 "stream_key": o.delivery.key, "entry_id": o.delivery.entry_id,
                 "attempts": o.attempts,
                 "first_failed_at_ms": first.get(o.delivery.event.id, ledger.now_ms),
                 "next_attempt_at_ms": o.retry_at_ms, "last_error": (o.error or "")[:64],
                 "updated_at_ms": ledger.now_ms} for o in failed]
        ins = (postgresql.insert if is_postgres(conn) else sqlite.insert)(consumer_retries)
        conn.execute(ins.on_conflict_do_update(
            index_elements=["group_name", "event_id"],
            set_={c: ins.excluded[c] for c in ("stream_key", "entry_id", "attempts",
                                               "next_attempt_at_ms", "last_error",
                                               "updated_at_ms")}), rows,
            execution_options=options)
    settled = [o.delivery.event.id for o in outcomes
               if o.outcome not in (FAILED, WAITING) and o.delivery.event.id in ledger.retries]
    if settled:
        conn.execute(consumer_retries.delete().where(r.group_name == group,
                                                     r.event_id.in_(settled)),
                     execution_options=options)


def _applied_heads(outcomes: Iterable[Outcome]) -> dict[tuple[str, str], int]:
    best: dict[tuple[str, str], int] = {}
    for o in outcomes:
        head = aggregate_key(o.delivery.event)
        rev = o.delivery.event.revision
        if o.outcome == APPLIED and head is not None and rev is not None:
            best[head] = max(best.get(head, -1), rev)
    return best


# Receipt columns that vary within a batch (group and time are the same for all of it), and
# what each is taken from.
_RECEIPT_COLUMNS: tuple[tuple[str, Callable[[Outcome], Any]], ...] = (
    ("event_id", lambda o: o.delivery.event.id),
    ("event_type", lambda o: o.delivery.event.type),
    ("aggregate_type", lambda o: o.delivery.event.aggregatetype),
    ("aggregate_id", lambda o: o.delivery.event.aggregateid),
    ("revision", lambda o: o.delivery.event.revision),
    ("stream_key", lambda o: o.delivery.key),
    ("entry_id", lambda o: o.delivery.entry_id),
    ("outcome", lambda o: o.outcome),
    ("reason", lambda o: o.error),
    ("fingerprint", lambda o: o.delivery.fingerprint),
)


def _insert_receipts(conn: Connection, group: str, receipted: list[Outcome], now: int,
                     options: dict[str, Any] | None = None) -> None:
    """Insert a batch's receipts: one statement on PostgreSQL, ``executemany`` on SQLite.

    On PostgreSQL each column goes as one JSON array, zipped by the server
    (:func:`_receipts_sql`): a list of values per column is built and serialized by
    ``json.dumps`` (in C) at ~0.8 µs a receipt, against ~3 µs for a dict per receipt and
    ``json_to_recordset`` (keys written 500 times; bench/PERFORMANCE.md). psycopg's
    ``executemany`` sent one pipelined statement per row (a third of a claim's time).
    SQLite's ``executemany`` loops in C.
    """
    if not is_postgres(conn):
        conn.execute(inbox.insert(), [
            {"group_name": group, "created_at_ms": now,
             **{name: get(o) for name, get in _RECEIPT_COLUMNS}}
            for o in receipted
        ])
        return
    params: dict[str, Any] = {"b_group": group, "b_now": now}
    for name, get in _RECEIPT_COLUMNS:
        params[f"b_{name}"] = json.dumps([get(o) for o in receipted])
    conn.exec_driver_sql(_receipts_sql(conn.dialect), params, execution_options=options)


@functools.cache
def _receipts_sql(dialect: Dialect) -> str:
    """``INSERT INTO outbox_inbox … SELECT … FROM ROWS FROM (json_array_elements_text(:col),
    …)``: one JSON array per column, zipped row by row (PostgreSQL; ``ROWS FROM`` pads a
    shorter array with NULLs, and every array has one value per receipt). Text SQL: Core has
    no ``ROWS FROM``; the names come from the table, quoted by the dialect."""
    quote = dialect.identifier_preparer.quote
    names = [name for name, _ in _RECEIPT_COLUMNS]
    arrays = ", ".join(f"json_array_elements_text(%(b_{name})s::json)" for name in names)
    # Text goes into the string columns by assignment (too long a value is an error, never
    # cut: an explicit ``::varchar(n)`` would cut it); anything else is cast from text.
    values = ", ".join(
        f"given.{quote(name)}" if isinstance(inbox.c[name].type, String)
        else f"given.{quote(name)}::{inbox.c[name].type.compile(dialect=dialect)}"
        for name in names)
    columns = ", ".join(quote(name) for name in ("group_name", *names, "created_at_ms"))
    table = dialect.identifier_preparer.format_table(inbox)
    given = ", ".join(quote(name) for name in names)
    return (f"INSERT INTO {table} ({columns}) SELECT %(b_group)s, {values}, %(b_now)s "
            f"FROM ROWS FROM ({arrays}) AS given({given})")


def _upsert_heads(conn: Connection, group: str, heads: dict[tuple[str, str], int],
                  options: dict[str, Any] | None = None) -> None:
    """Raise each aggregate's applied revision (never lower it); keys are distinct. A raised
    head's ``updated_at_ms`` is now (retention prunes heads that stopped moving)."""
    ordered = sorted(heads.items())
    now = now_ms()
    if not is_postgres(conn):
        sql, order = _sqlite_heads_sql(conn.dialect)
        rows = [{"b_group": group, "b_type": t, "b_id": i, "b_rev": r, "b_now": now}
                for (t, i), r in ordered]
        conn.exec_driver_sql(sql, [tuple(row[name] for name in order) for row in rows])
        return
    conn.exec_driver_sql(_heads_sql(conn.dialect), {
        "b_group": group, "b_now": now,
        "b_heads": json.dumps([{"t": t, "i": i, "r": r} for (t, i), r in ordered]),
    }, execution_options=options)


@functools.cache
def _heads_sql(dialect: Dialect) -> str:
    """:func:`_heads_query` compiled once per dialect: SQLAlchemy cannot cache-key an
    ``ON CONFLICT … DO UPDATE … WHERE`` statement, so it compiled this one on every claim (a
    sixth of a small claim's CPU in a profile at 1,000 events/s)."""
    return str(_heads_query().compile(dialect=dialect))


@functools.cache
def _sqlite_heads_sql(dialect: Dialect) -> tuple[str, tuple[str, ...]]:
    """The SQLite upsert of :func:`_upsert_heads` compiled once per dialect (as
    :func:`_heads_sql`), with its parameters' names in the order the driver takes them
    (SQLite's drivers are positional, ``?``); run as an ``executemany``, one row per head."""
    upsert = sqlite.insert(inbox_heads).values(
        group_name=bindparam("b_group", type_=String),
        aggregate_type=bindparam("b_type", type_=String),
        aggregate_id=bindparam("b_id", type_=String),
        revision=bindparam("b_rev", type_=BigInteger),
        updated_at_ms=bindparam("b_now", type_=BigInteger),
    )
    compiled = upsert.on_conflict_do_update(
        index_elements=["group_name", "aggregate_type", "aggregate_id"],
        set_={"revision": upsert.excluded.revision,
              "updated_at_ms": upsert.excluded.updated_at_ms},
        where=inbox_heads.c.revision < upsert.excluded.revision,
    ).compile(dialect=dialect)
    assert compiled.positiontup is not None, "SQLite's paramstyle is positional"
    return str(compiled), tuple(compiled.positiontup)


def _heads_query() -> Any:
    """The PostgreSQL upsert of :func:`_upsert_heads`."""
    given = json_recordset(
        "b_heads", column("t", String), column("i", String), column("r", BigInteger)
    )
    ins = postgresql.insert(inbox_heads).from_select(
        ["group_name", "aggregate_type", "aggregate_id", "revision", "updated_at_ms"],
        select(bindparam("b_group", type_=String), given.c.t, given.c.i, given.c.r,
               bindparam("b_now", type_=BigInteger)),
    )
    return ins.on_conflict_do_update(
        index_elements=["group_name", "aggregate_type", "aggregate_id"],
        set_={"revision": ins.excluded.revision, "updated_at_ms": ins.excluded.updated_at_ms},
        where=inbox_heads.c.revision < ins.excluded.revision,
    )


def reopen_dead_receipt(engine: Engine, group: str, event_id: str) -> int:
    """Delete the group's ``dead`` (or ``lost``: consumer/lost.py) receipt of ``event_id`` so
    the claim can decide again (a dead-letter replay, :func:`consumer.dead_letters.replay`).

    Its own transaction, just before the replay's claim; it touches nothing but a ``dead`` or
    ``lost`` outcome. Returns rows deleted (0 or 1).
    """
    with translate_errors(), engine.begin() as conn:
        result = conn.execute(
            delete(inbox).where(
                inbox.c.group_name == group,
                inbox.c.event_id == event_id,
                inbox.c.outcome.in_((DEAD, LOST)),
            )
        )
        return int(result.rowcount or 0)
