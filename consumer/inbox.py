"""Every SQL statement of the consumer: the claim transaction (inbox, heads, handlers).

One transaction per batch. On PostgreSQL it first takes transaction-scoped advisory locks on
the batch's aggregates (sorted, so two consumers cannot deadlock), which serializes any two
claims that touch the same aggregate: the duplicate and order checks below then read settled
rows. SQLite's ``BEGIN IMMEDIATE`` already serializes whole transactions.

The decisions (order per aggregate, whose fault an error is) are made by
:mod:`consumer.ordering`, whose outcome vocabulary this module re-exports: ``inbox.APPLIED``,
``inbox.Delivery``, ``inbox.claim`` are what the daemon and dead-letter replay use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    String,
    bindparam,
    cast,
    column,
    func,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql import Select

from outbox_relay.consumer.handlers import Handlers
from outbox_relay.consumer.ordering import (
    APPLIED,
    DEAD,
    DUPLICATE,
    FAILED,
    OUT_OF_ORDER,
    RESURRECTED,
    SUPERSEDED,
    WAITING,
    AggregateKey,
    Delivery,
    Ledger,
    Outcome,
    aggregate_key,
    decide_batch,
)
from outbox_relay.consumer.prune import entry_key, partition_of
from outbox_relay.shared.db import is_postgres, json_recordset, now_ms, translate_errors
from outbox_relay.shared.schema import inbox, inbox_heads, stream_trims

__all__ = [
    "APPLIED", "DEAD", "DUPLICATE", "FAILED", "OUT_OF_ORDER", "RESURRECTED", "SUPERSEDED",
    "WAITING",
    "AggregateKey", "Delivery", "Outcome", "aggregate_key", "claim",
]


def _lock_key(group: str, d: Delivery) -> int:
    head = aggregate_key(d.event)
    raw = "\0".join((group, *head)) if head else f"{group}\0event\0{d.event.id}"
    return int.from_bytes(hashlib.blake2b(raw.encode(), digest_size=8).digest(), "big", signed=True)


def claim(
    engine: Engine,
    group: str,
    batch: list[Delivery],
    handlers: Handlers,
    *,
    blocked: set[AggregateKey] | None = None,
    check: Callable[[Connection], None] | None = None,
) -> list[Outcome]:
    """Claim a batch durably; return one outcome per delivery, in order.

    Guarantees, in one transaction (first ``check(conn)``, the caller's fence: if it raises,
    nothing is decided): see the module docstring for the order of the decisions. An applied
    event's receipt and its handler's writes commit together; a failing handler's writes roll
    back alone and the entry is ``failed`` (no receipt: it is retried). ``blocked`` holds the
    strict aggregates with an earlier entry failing or waiting; after the commit, the key of
    every strict delivery that ended ``failed`` or ``waiting`` is added to it.

    Errors: only a lost connection (or SQLite's ``database is locked``, contention) fails the
    whole claim (``UnavailableError``: retried); any other error raised in a handler, a bad
    statement or a statement timeout included, is that handler's failure.

    Optimistic path: the batch's handlers run inside ONE savepoint (a savepoint per handler
    cost two round trips per event, most of a claim's time). If a handler raises, that
    savepoint rolls back, callbacks scheduled with ``Handlers.after_commit`` are dropped, and
    the batch is decided again with a savepoint per handler; the entry whose handler raised is
    ``failed`` without running again (and blocks its later strict deliveries, as on the
    per-handler path). So the outcomes are those of the per-handler path.
    Consequence for handler authors: a handler that ran *before* a failing neighbour in its
    batch runs twice in that claim; only the second run's writes commit. Effects outside
    ``conn`` belong in ``after_commit`` (delivery is at least once anyway).
    """
    if not batch:
        return []
    with translate_errors(), engine.begin() as conn:
        if check is not None:
            check(conn)
        if is_postgres(conn):
            lock_keys = sorted({_lock_key(group, d) for d in batch})
            array = cast(lock_keys, postgresql.ARRAY(BigInteger))
            conn.execute(select(func.pg_advisory_xact_lock(func.unnest(array))))
        seen = _existing(conn, group, [d.event.id for d in batch])
        ledger = Ledger(
            seen,
            _heads(conn, group, {k for d in batch if (k := aggregate_key(d.event))}),
            set(blocked or ()),
            _below_floor(conn, [d for d in batch if d.event.id not in seen and not d.replay]),
        )
        outcomes, ledger = decide_batch(conn, batch, ledger, handlers, group)
        _write(conn, group, outcomes)
    if blocked is not None:
        blocked |= ledger.blocked
    return outcomes

def _existing(conn: Connection, group: str, event_ids: list[str]) -> dict[str, str | None]:
    """The group's receipts among ``event_ids``: id -> the reason of a ``dead`` one, else None."""
    columns = (inbox.c.event_id, inbox.c.outcome, inbox.c.reason)
    if not is_postgres(conn):
        rows = conn.execute(select(*columns).where(
            inbox.c.group_name == group, inbox.c.event_id.in_(set(event_ids))
        ))
    else:
        given = func.unnest(
            bindparam("b_ids", sorted(set(event_ids)), type_=postgresql.ARRAY(String))
        ).table_valued("id", name="given").render_derived()
        found = _probe(
            select(*columns).where(inbox.c.group_name == group, inbox.c.event_id == given.c.id)
        )
        rows = conn.execute(select(*found.c).select_from(given).join(found, true()))
    return {i: (reason or DEAD) if outcome == DEAD else None for i, outcome, reason in rows}


def _below_floor(conn: Connection, unseen: list[Delivery]) -> frozenset[str]:
    """The event ids of ``unseen`` (deliveries without a receipt) whose entry id is below their
    stream's trim floor (``outbox_stream_trims``): ``resurrected``, never applied again.

    Read after the receipts, in the same transaction: a receipt is pruned only below the floor
    its pruner read, and floors only rise, so a receipt missing from :func:`_existing` had its
    floor committed before this read sees it. An inbox in another database than the outbox
    has no floors: nothing is below, and its receipts are never pruned by floor
    (consumer/prune.py)."""
    wanted: dict[tuple[str, int], list[Delivery]] = {}
    for d in unseen:
        partition = partition_of(d.key)
        if partition is not None:
            wanted.setdefault(partition, []).append(d)
    if not wanted:
        return frozenset()
    pair = tuple_(stream_trims.c.stream, stream_trims.c.partition)
    rows = conn.execute(select(stream_trims.c.stream, stream_trims.c.partition,
                               stream_trims.c.floor_entry_id).where(pair.in_(list(wanted))))
    below: set[str] = set()
    for stream, partition, floor_id in rows:
        floor = entry_key(floor_id)
        if floor is None:
            continue
        below.update(d.event.id for d in wanted[(stream, partition)]
                     if (entry := entry_key(d.entry_id)) is not None and entry < floor)
    return frozenset(below)


def _heads(
    conn: Connection, group: str, aggregates: set[AggregateKey]
) -> dict[AggregateKey, int]:
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
        if o.outcome in (APPLIED, SUPERSEDED, DEAD)
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
        head = aggregate_key(o.delivery.event)
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
    """Raise each aggregate's applied revision (never lower it); keys are distinct. A raised
    head's ``updated_at_ms`` is now (retention prunes heads that stopped moving)."""
    ordered = sorted(heads.items())
    now = now_ms()
    if not is_postgres(conn):
        upsert = sqlite.insert(inbox_heads)
        conn.execute(
            upsert.on_conflict_do_update(
                index_elements=["group_name", "aggregate_type", "aggregate_id"],
                set_={"revision": upsert.excluded.revision,
                      "updated_at_ms": upsert.excluded.updated_at_ms},
                where=inbox_heads.c.revision < upsert.excluded.revision,
            ),
            [
                {"group_name": group, "aggregate_type": t, "aggregate_id": i, "revision": r,
                 "updated_at_ms": now}
                for (t, i), r in ordered
            ],
        )
        return
    given = json_recordset(
        "b_heads", column("t", String), column("i", String), column("r", BigInteger)
    )
    ins = postgresql.insert(inbox_heads).from_select(
        ["group_name", "aggregate_type", "aggregate_id", "revision", "updated_at_ms"],
        select(bindparam("b_group", type_=String), given.c.t, given.c.i, given.c.r,
               bindparam("b_now", type_=BigInteger)),
    )
    conn.execute(
        ins.on_conflict_do_update(
            index_elements=["group_name", "aggregate_type", "aggregate_id"],
            set_={"revision": ins.excluded.revision, "updated_at_ms": ins.excluded.updated_at_ms},
            where=inbox_heads.c.revision < ins.excluded.revision,
        ),
        {"b_group": group, "b_now": now,
         "b_heads": [{"t": t, "i": i, "r": r} for (t, i), r in ordered]},
    )
