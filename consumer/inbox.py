"""Every SQL statement of the consumer: the claim transaction (inbox, heads, handlers).

One transaction per batch. On PostgreSQL it first takes transaction-scoped advisory locks on
the batch's aggregates (sorted, so two consumers cannot deadlock), which serializes any two
claims that touch the same aggregate: the duplicate and stale checks below then read settled
rows. SQLite's ``BEGIN IMMEDIATE`` already serializes whole transactions.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    String,
    bindparam,
    cast,
    column,
    exc,
    func,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql import Select

from consumer.handlers import Handlers
from shared.db import is_postgres, json_recordset, now_ms, translate_errors
from shared.envelope import Event
from shared.schema import inbox, inbox_heads

log = logging.getLogger(__name__)

APPLIED, DUPLICATE, STALE, DEAD, FAILED = "applied", "duplicate", "stale", "dead", "failed"


@dataclass(frozen=True)
class Delivery:
    """A valid entry to claim: where it came from and what it says."""

    key: str
    entry_id: str
    event: Event
    deliveries: int
    dead_reason: str | None = None  # set when it must be recorded as dead, not applied


@dataclass(frozen=True)
class Outcome:
    """What the claim decided for one delivery; ``failed`` ones stay pending."""

    delivery: Delivery
    outcome: str
    error: str | None = None


def _head_key(event: Event) -> tuple[str, str] | None:
    if event.aggregateid is None or event.revision is None:
        return None
    return (event.aggregatetype or "", event.aggregateid)


def _lock_key(group: str, d: Delivery) -> int:
    head = _head_key(d.event)
    raw = "\0".join((group, *head)) if head else f"{group}\0event\0{d.event.id}"
    return int.from_bytes(hashlib.blake2b(raw.encode(), digest_size=8).digest(), "big", signed=True)


class _HandlerFailed(Exception):
    """A handler on the optimistic path raised: redo the batch with a savepoint per handler."""

    def __init__(self, delivery: Delivery, error: str) -> None:
        super().__init__(error)
        self.delivery, self.error = delivery, error


def claim(engine: Engine, group: str, batch: list[Delivery], handlers: Handlers) -> list[Outcome]:
    """Claim a batch durably; return one outcome per delivery, in order.

    Guarantees, in one transaction: an event id already in the group's inbox is a
    ``duplicate`` (its counter goes up, nothing else happens); an event whose revision is not
    newer than the aggregate's last applied one is ``stale``; otherwise the handler runs and the
    receipt and the handler's writes commit together (``applied``), or its writes roll back and
    the entry is ``failed`` (no receipt: it will be retried).

    Optimistic path: the batch's handlers run inside ONE savepoint (a savepoint per handler
    cost two round trips per event, most of a claim's time). If a handler raises, that
    savepoint rolls back, callbacks scheduled with ``Handlers.after_commit`` are dropped, and
    the batch is decided again with a savepoint per handler; the entry whose handler raised is
    ``failed`` without running again. So the outcomes are those of the per-handler path.
    Consequence for handler authors: a handler that ran *before* a failing neighbour in its
    batch runs twice in that claim; only the second run's writes commit. Effects outside
    ``conn`` belong in ``after_commit`` (delivery is at least once anyway).
    """
    if not batch:
        return []
    with translate_errors(), engine.begin() as conn:
        if is_postgres(conn):
            lock_keys = sorted({_lock_key(group, d) for d in batch})
            array = cast(lock_keys, postgresql.ARRAY(BigInteger))
            conn.execute(select(func.pg_advisory_xact_lock(func.unnest(array))))
        seen = _existing(conn, group, [d.event.id for d in batch])
        heads = _heads(conn, group, {k for d in batch if (k := _head_key(d.event))})
        outcomes = _decide_batch(conn, batch, seen, heads, handlers)
        _write(conn, group, outcomes)
        return outcomes


def _decide_batch(
    conn: Connection,
    batch: list[Delivery],
    seen: set[str],
    heads: dict[Any, int],
    handlers: Handlers,
) -> list[Outcome]:
    """Decide every delivery: optimistically under one savepoint, else one per handler."""
    if len(batch) > 1:
        try:
            with conn.begin_nested():
                return _decide_all(conn, batch, set(seen), dict(heads), handlers, False)
        except _HandlerFailed as failure:
            handlers.take_after_commit(set())  # rolled back: every handler runs again
            _log_failure(failure.delivery.event, failure.error)
            return [
                Outcome(d, FAILED, failure.error) if d is failure.delivery
                else _decide(conn, d, seen, heads, handlers, True)
                for d in batch
            ]
    return _decide_all(conn, batch, seen, heads, handlers, True)


def _decide_all(
    conn: Connection,
    batch: list[Delivery],
    seen: set[str],
    heads: dict[Any, int],
    handlers: Handlers,
    savepoints: bool,
) -> list[Outcome]:
    return [_decide(conn, d, seen, heads, handlers, savepoints) for d in batch]


def _existing(conn: Connection, group: str, event_ids: list[str]) -> set[str]:
    if not is_postgres(conn):
        rows = conn.execute(select(inbox.c.event_id).where(
            inbox.c.group_name == group, inbox.c.event_id.in_(set(event_ids))
        ))
        return {r[0] for r in rows}
    given = func.unnest(
        bindparam("b_ids", sorted(set(event_ids)), type_=postgresql.ARRAY(String))
    ).table_valued("id", name="given").render_derived()
    found = _probe(
        select(inbox.c.event_id).where(
            inbox.c.group_name == group, inbox.c.event_id == given.c.id
        )
    )
    return {r[0] for r in conn.execute(select(found.c.event_id).select_from(given).join(
        found, true()
    ))}


def _heads(conn: Connection, group: str, aggregates: set[tuple[str, str]]) -> dict[Any, int]:
    if not aggregates:
        return {}
    columns = (inbox_heads.c.aggregate_type, inbox_heads.c.aggregate_id, inbox_heads.c.revision)
    if not is_postgres(conn):
        keys = tuple_(inbox_heads.c.aggregate_type, inbox_heads.c.aggregate_id)
        query = select(*columns).where(inbox_heads.c.group_name == group,
                                       keys.in_(list(aggregates)))
        return {(t, i): rev for t, i, rev in conn.execute(query)}
    types, ids = zip(*sorted(aggregates), strict=True)
    given = func.unnest(
        bindparam("b_types", list(types), type_=postgresql.ARRAY(String)),
        bindparam("b_ids", list(ids), type_=postgresql.ARRAY(String)),
    ).table_valued("t", "i", name="given").render_derived()
    found = _probe(select(*columns).where(
        inbox_heads.c.group_name == group,
        inbox_heads.c.aggregate_type == given.c.t,
        inbox_heads.c.aggregate_id == given.c.i,
    ))
    rows = conn.execute(select(*found.c).select_from(given).join(found, true()))
    return {(t, i): rev for t, i, rev in rows}


def _probe(query: Select[Any]) -> Any:
    """``LATERAL (<query> LIMIT 1)``: one primary-key probe per given key (PostgreSQL).

    A plain join or ``= ANY(:ids)`` left the plan to the statistics; when they were stale
    (a table that grew since its last ANALYZE: autovacuum lagging, or off) PostgreSQL scanned
    every receipt of the group per batch (28 ms, and the heads hash join 66 ms, for 500 keys
    at 200,000 rows, measured with ``EXPLAIN ANALYZE``). The LIMIT
    keeps the subquery from being flattened into a join the planner could reorder.
    """
    return query.limit(1).lateral("found")


def _decide(
    conn: Connection,
    d: Delivery,
    seen: set[str],
    heads: dict[Any, int],
    handlers: Handlers,
    savepoints: bool = True,
) -> Outcome:
    event = d.event
    if event.id in seen:
        return Outcome(d, DUPLICATE)
    head = _head_key(event)
    if d.dead_reason is not None:
        seen.add(event.id)
        return Outcome(d, DEAD, d.dead_reason)
    if head is not None and event.revision is not None and heads.get(head, -1) >= event.revision:
        seen.add(event.id)
        return Outcome(d, STALE)
    handler = handlers.get(event.type)
    if handler is None:
        seen.add(event.id)
        return Outcome(d, DEAD, "unknown_type")
    if not savepoints:
        try:
            handler(conn, event)
        except Exception as err:
            if _connection_lost(err):
                raise
            raise _HandlerFailed(d, type(err).__name__) from err
    else:
        try:
            with conn.begin_nested():
                handler(conn, event)
        except Exception as err:  # the handler's own failure: only its savepoint rolls back
            if _connection_lost(err):
                raise  # not the handler's fault: the whole claim fails and is retried
            _log_failure(event, type(err).__name__)
            return Outcome(d, FAILED, type(err).__name__)
    seen.add(event.id)
    if head is not None and event.revision is not None:
        heads[head] = event.revision
    return Outcome(d, APPLIED)


def _log_failure(event: Event, error: str) -> None:
    log.warning("handler for %s failed on %s: %s", event.type, event.id, error)
    log.debug("handler error", exc_info=True)


def _connection_lost(err: Exception) -> bool:
    """A database failure under the handler (connection killed, server gone), as opposed to the
    handler's own error: the transaction cannot go on, so no other entry may be decided in it."""
    if isinstance(err, exc.DBAPIError):
        return bool(err.connection_invalidated) or isinstance(
            err, exc.OperationalError | exc.InterfaceError
        )
    return isinstance(err, exc.PendingRollbackError | exc.ResourceClosedError)


def _write(conn: Connection, group: str, outcomes: list[Outcome]) -> None:
    now = now_ms()
    receipts = [
        {
            "group_name": group,
            "event_id": o.delivery.event.id,
            "event_type": o.delivery.event.type,
            "aggregate_type": o.delivery.event.aggregatetype,
            "aggregate_id": o.delivery.event.aggregateid,
            "revision": o.delivery.event.revision,
            "stream_key": o.delivery.key,
            "entry_id": o.delivery.entry_id,
            "outcome": o.outcome,
            "reason": o.error,
            "created_at_ms": now,
        }
        for o in outcomes
        if o.outcome in (APPLIED, STALE, DEAD)
    ]
    if receipts:
        _insert_receipts(conn, receipts)
    duplicates = [o.delivery.event.id for o in outcomes if o.outcome == DUPLICATE]
    if duplicates:
        conn.execute(
            update(inbox)
            .where(inbox.c.group_name == group, inbox.c.event_id == bindparam("b_id"))
            .values(duplicates=inbox.c.duplicates + 1),
            [{"b_id": i} for i in duplicates],
        )
    applied_heads = _applied_heads(outcomes)
    if applied_heads:
        _upsert_heads(conn, group, applied_heads)


def _applied_heads(outcomes: Iterable[Outcome]) -> dict[tuple[str, str], int]:
    best: dict[tuple[str, str], int] = {}
    for o in outcomes:
        head = _head_key(o.delivery.event)
        rev = o.delivery.event.revision
        if o.outcome == APPLIED and head is not None and rev is not None:
            best[head] = max(best.get(head, -1), rev)
    return best


# Receipt columns that vary within a batch (group and time are the same for all of it).
_RECEIPT_COLUMNS = (
    "event_id", "event_type", "aggregate_type", "aggregate_id", "revision", "stream_key",
    "entry_id", "outcome", "reason",
)


def _insert_receipts(conn: Connection, receipts: list[dict[str, Any]]) -> None:
    """Insert a batch's receipts: one statement on PostgreSQL, ``executemany`` on SQLite.

    On PostgreSQL ``INSERT … SELECT … FROM json_to_recordset(:rows)``
    (:func:`shared.db.json_recordset`), where psycopg's ``executemany`` sent one pipelined
    statement per row (a third of a claim's time). SQLite's ``executemany`` loops in C.
    """
    if not is_postgres(conn):
        conn.execute(inbox.insert(), receipts)
        return
    given = json_recordset(
        "b_rows", *(column(name, inbox.c[name].type) for name in _RECEIPT_COLUMNS)
    )
    rows = select(
        bindparam("b_group", type_=String), *(given.c[name] for name in _RECEIPT_COLUMNS),
        bindparam("b_now", type_=BigInteger),
    )
    conn.execute(
        inbox.insert().from_select(["group_name", *_RECEIPT_COLUMNS, "created_at_ms"], rows),
        {
            "b_rows": [{k: r[k] for k in _RECEIPT_COLUMNS} for r in receipts],
            "b_group": receipts[0]["group_name"],
            "b_now": receipts[0]["created_at_ms"],
        },
    )


def _upsert_heads(conn: Connection, group: str, heads: dict[tuple[str, str], int]) -> None:
    """Raise each aggregate's applied revision (never lower it); keys are distinct."""
    ordered = sorted(heads.items())
    if not is_postgres(conn):
        upsert = sqlite.insert(inbox_heads)
        conn.execute(
            upsert.on_conflict_do_update(
                index_elements=["group_name", "aggregate_type", "aggregate_id"],
                set_={"revision": upsert.excluded.revision},
                where=inbox_heads.c.revision < upsert.excluded.revision,
            ),
            [
                {"group_name": group, "aggregate_type": t, "aggregate_id": i, "revision": r}
                for (t, i), r in ordered
            ],
        )
        return
    given = json_recordset(
        "b_heads", column("t", String), column("i", String), column("r", BigInteger)
    )
    ins = postgresql.insert(inbox_heads).from_select(
        ["group_name", "aggregate_type", "aggregate_id", "revision"],
        select(bindparam("b_group", type_=String), given.c.t, given.c.i, given.c.r),
    )
    conn.execute(
        ins.on_conflict_do_update(
            index_elements=["group_name", "aggregate_type", "aggregate_id"],
            set_={"revision": ins.excluded.revision},
            where=inbox_heads.c.revision < ins.excluded.revision,
        ),
        {"b_group": group,
         "b_heads": [{"t": t, "i": i, "r": r} for (t, i), r in ordered]},
    )
