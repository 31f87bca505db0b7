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

import functools
import hashlib
import json
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Integer,
    String,
    bindparam,
    cast,
    column,
    func,
    literal,
    select,
    true,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
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
            conn.execute(_lock_query(), {"b_keys": sorted({_lock_key(group, d) for d in batch})})
        seen, heads, below = _lookup(conn, group, batch)
        ledger = Ledger(seen, heads, set(blocked or ()), below)
        outcomes, ledger = decide_batch(conn, batch, ledger, handlers, group)
        _write(conn, group, outcomes)
    if blocked is not None:
        blocked |= ledger.blocked
    return outcomes

def _existing(conn: Connection, group: str, event_ids: list[str]) -> dict[str, str | None]:
    """The group's receipts among ``event_ids`` (SQLite; PostgreSQL reads them in
    :func:`_lookup_query`): id -> the reason of a ``dead`` one, else None."""
    rows = conn.execute(select(inbox.c.event_id, inbox.c.outcome, inbox.c.reason).where(
        inbox.c.group_name == group, inbox.c.event_id.in_(set(event_ids))))
    return {i: (reason or DEAD) if outcome == DEAD else None for i, outcome, reason in rows}


def _lookup(
    conn: Connection, group: str, batch: list[Delivery]
) -> tuple[dict[str, str | None], dict[AggregateKey, int], frozenset[str]]:
    """What the claim decides from: the group's receipts among the batch's events
    (:func:`_existing`), the applied revisions of its aggregates (:func:`_heads`), and the
    deliveries without a receipt below their stream's trim floor (``resurrected``).

    On PostgreSQL one statement (:func:`_lookup_query`), where three round trips were most of
    a small claim's waiting. One statement reads one snapshot, and that is what the floor
    check needs: a receipt is pruned only below the floor its pruner read (committed before
    the prune), and floors only rise, so a receipt missing from this snapshot because it was
    pruned has its floor in it. An inbox in another database than the outbox has no floors:
    nothing is below, and its receipts are never pruned by floor (consumer/prune.py).
    """
    aggregates = {k for d in batch if (k := aggregate_key(d.event))}
    wanted: dict[tuple[str, int], list[Delivery]] = {}
    for d in batch:
        partition = partition_of(d.key)
        if partition is not None and not d.replay:
            wanted.setdefault(partition, []).append(d)
    if not is_postgres(conn):
        seen = _existing(conn, group, [d.event.id for d in batch])
        floors = _floors(conn, wanted) if wanted else {}
        return seen, _heads(conn, group, aggregates), _below(wanted, floors, seen)
    types, ids = zip(*sorted(aggregates), strict=True) if aggregates else ((), ())
    streams, parts = zip(*sorted(wanted), strict=True) if wanted else ((), ())
    params = {"b_group": group, "b_ids": sorted({d.event.id for d in batch}),
              "b_types": list(types), "b_aids": list(ids), "b_streams": list(streams),
              "b_parts": list(parts)}
    seen, heads, floors = {}, {}, {}
    for kind, a, b, c, n in conn.execute(_lookup_query(), params):
        if kind == "r":
            seen[a] = (c or DEAD) if b == DEAD else None
        elif kind == "h":
            heads[(a, b)] = n
        else:
            floors[(a, int(b))] = c
    return seen, heads, _below(wanted, floors, seen)


def _below(
    wanted: dict[tuple[str, int], list[Delivery]], floors: dict[tuple[str, int], str],
    seen: dict[str, str | None],
) -> frozenset[str]:
    """The event ids of deliveries without a receipt whose entry id is below their stream's
    trim floor: ``resurrected``, never applied again."""
    below: set[str] = set()
    for pair, floor_id in floors.items():
        floor = entry_key(floor_id)
        if floor is None:
            continue
        below.update(d.event.id for d in wanted.get(pair, ()) if d.event.id not in seen
                     and (entry := entry_key(d.entry_id)) is not None and entry < floor)
    return frozenset(below)


def _floors(
    conn: Connection, wanted: dict[tuple[str, int], list[Delivery]]
) -> dict[tuple[str, int], str]:
    """The trim floors of the batch's partition streams (SQLite; read after the receipts, in
    the same transaction, for the reason :func:`_lookup` gives)."""
    pair = tuple_(stream_trims.c.stream, stream_trims.c.partition)
    rows = conn.execute(select(stream_trims.c.stream, stream_trims.c.partition,
                               stream_trims.c.floor_entry_id).where(pair.in_(list(wanted))))
    return {(stream, partition): floor for stream, partition, floor in rows}


@functools.cache
def _lock_query() -> Any:
    """``SELECT pg_advisory_xact_lock(unnest(:b_keys))``, built once (built per claim with
    the keys inline, it was compiled and cache-keyed anew every time)."""
    keys = bindparam("b_keys", type_=postgresql.ARRAY(BigInteger))
    return select(func.pg_advisory_xact_lock(func.unnest(keys)))


@functools.cache
def _lookup_query() -> Any:
    """The receipts, heads and floors of a batch in one ``UNION ALL`` (PostgreSQL), built
    once. Rows are ``(kind, a, b, c, n)``: ``('r', event_id, outcome, reason, NULL)``,
    ``('h', aggregate_type, aggregate_id, NULL, revision)``, ``('f', stream, partition,
    floor_entry_id, NULL)``. Receipts and heads are probed key by key (:func:`_probe`)."""
    group = bindparam("b_group", type_=String)
    none_text, none_int = cast(None, String), cast(None, BigInteger)
    given_ids = func.unnest(bindparam("b_ids", type_=postgresql.ARRAY(String))).table_valued(
        "id", name="given_ids").render_derived()
    receipt = _probe(select(inbox.c.event_id, inbox.c.outcome, inbox.c.reason).where(
        inbox.c.group_name == group, inbox.c.event_id == given_ids.c.id))
    given_heads = func.unnest(
        bindparam("b_types", type_=postgresql.ARRAY(String)),
        bindparam("b_aids", type_=postgresql.ARRAY(String)),
    ).table_valued("t", "i", name="given_heads").render_derived()
    head = _probe(select(inbox_heads.c.aggregate_type, inbox_heads.c.aggregate_id,
                         inbox_heads.c.revision).where(
        inbox_heads.c.group_name == group,
        inbox_heads.c.aggregate_type == given_heads.c.t,
        inbox_heads.c.aggregate_id == given_heads.c.i,
    ), "head")
    given_pairs = func.unnest(
        bindparam("b_streams", type_=postgresql.ARRAY(String)),
        bindparam("b_parts", type_=postgresql.ARRAY(Integer)),
    ).table_valued("s", "p", name="given_pairs").render_derived()
    return union_all(
        select(literal("r"), receipt.c.event_id, receipt.c.outcome, receipt.c.reason, none_int)
        .select_from(given_ids).join(receipt, true()),
        select(literal("h"), head.c.aggregate_type, head.c.aggregate_id, none_text,
               head.c.revision).select_from(given_heads).join(head, true()),
        select(literal("f"), stream_trims.c.stream, cast(stream_trims.c.partition, String),
               stream_trims.c.floor_entry_id, none_int)
        .select_from(given_pairs).join(stream_trims, (stream_trims.c.stream == given_pairs.c.s)
                                       & (stream_trims.c.partition == given_pairs.c.p)),
    )


def _heads(
    conn: Connection, group: str, aggregates: set[AggregateKey]
) -> dict[AggregateKey, int]:
    """The applied revisions of ``aggregates`` (SQLite; PostgreSQL reads them in
    :func:`_lookup_query`)."""
    if not aggregates:
        return {}
    keys = tuple_(inbox_heads.c.aggregate_type, inbox_heads.c.aggregate_id)
    query = select(inbox_heads.c.aggregate_type, inbox_heads.c.aggregate_id,
                   inbox_heads.c.revision).where(inbox_heads.c.group_name == group,
                                                 keys.in_(list(aggregates)))
    return {(t, i): rev for t, i, rev in conn.execute(query)}


def _probe(query: Select[Any], name: str = "found") -> Any:
    """``LATERAL (<query> LIMIT 1)``: one primary-key probe per given key (PostgreSQL).

    A plain join or ``= ANY(:ids)`` left the plan to the statistics; when they were stale
    (a table that grew since its last ANALYZE: autovacuum lagging, or off) PostgreSQL scanned
    every receipt of the group per batch (28 ms, and the heads hash join 66 ms, for 500 keys
    at 200,000 rows, measured with ``EXPLAIN ANALYZE``). The LIMIT
    keeps the subquery from being flattened into a join the planner could reorder.
    """
    return query.limit(1).lateral(name)

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
    conn.execute(
        _receipts_query(),
        {
            "b_rows": [{k: r[k] for k in _RECEIPT_COLUMNS} for r in receipts],
            "b_group": receipts[0]["group_name"],
            "b_now": receipts[0]["created_at_ms"],
        },
    )


@functools.cache
def _receipts_query() -> Any:
    """The PostgreSQL insert of :func:`_insert_receipts`, built once."""
    given = json_recordset(
        "b_rows", *(column(name, inbox.c[name].type) for name in _RECEIPT_COLUMNS)
    )
    rows = select(
        bindparam("b_group", type_=String), *(given.c[name] for name in _RECEIPT_COLUMNS),
        bindparam("b_now", type_=BigInteger),
    )
    return inbox.insert().from_select(["group_name", *_RECEIPT_COLUMNS, "created_at_ms"], rows)


def _upsert_heads(conn: Connection, group: str, heads: dict[tuple[str, str], int]) -> None:
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
    })


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
