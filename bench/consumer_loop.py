"""The consumer's yardstick: a hand-written loop, and the handlers the bench compares with it.

:func:`drain_loop` is what a careful engineer writes for "apply each event once, with one row
of effect" without any framework, one Redis connection and one raw database connection::

    XREADGROUP GROUP g c COUNT <batch> STREAMS <key> >
    BEGIN                                                   -- SQLite: BEGIN IMMEDIATE
    INSERT INTO outbox_inbox (group_name, event_id, stream_key, entry_id, outcome,
                              created_at_ms)
    SELECT … FROM unnest(:ids, :keys, :entries) ON CONFLICT DO NOTHING RETURNING event_id
    INSERT INTO bench_effects (event_id, aggregate_id, n)
    SELECT … FROM unnest(…)                                 -- only the events just received
    COMMIT
    XACK <key> g <ids…>                                     -- one per stream key, one round trip

It has none of the consumer's guarantees (no validation of the entries, no per-aggregate
order or heads, no retries, dead letters, leases or fencing; one failing event fails the whole
batch), which is exactly why it is the yardstick. What makes it strong, as in
:mod:`bench.baseline`: the raw driver connection, statements prepared on their first
execution (``prepare_threshold=0``) with binary array parameters, one statement per table per
batch. On SQLite the receipts already present are read first (one ``json_each`` query, under
``BEGIN IMMEDIATE`` nothing else writes), then both inserts are one ``executemany`` each.

The receipts go to the product's own ``outbox_inbox`` table (same primary key and index as the
consumer's), the effects to :data:`effects`, which the handlers compared with it write too:

* ``one-row`` (:func:`one_row_handler`): ``Handlers.register(type, fn)``, one ``INSERT`` of one
  row per event through the claim's connection, as a user's handler does (``one-row
  unpipelined``: the same with ``Handlers(pipeline=False)``);
* ``batch`` (:func:`batch_handler`): ``Handlers.register_batch(type, fn)``, all the claim's
  events of the type in one ``executemany`` insert;
* ``no-op``: the bench's usual handler, nothing written (the claim's own cost).
* ``async one-row``: the one-row handler as ``async def`` (the claim on an async engine).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from typing import Any

import psycopg
import redis
from sqlalchemy import BigInteger, Column, Connection, MetaData, String, Table, insert
from sqlalchemy.ext.asyncio import AsyncConnection

from bench.env import Target
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared.envelope import Event

_meta = MetaData()
effects = Table(
    "bench_effects", _meta,
    Column("event_id", String(512), primary_key=True),
    Column("aggregate_id", String(256), nullable=False),
    Column("n", BigInteger, nullable=False),
)
INSERT_EFFECT = insert(effects)  # built once: SQLAlchemy caches its compiled form

VARIANTS = ("loop", "no-op", "one-row", "one-row unpipelined", "batch", "async one-row")
"""The rows of the comparison, in the order of the first round (the second is reversed).
``one-row unpipelined``: the one-row handler with ``Handlers(pipeline=False)`` (each insert
waits for its result): what pipelining its inserts gains (consumer/pipelining.py)."""


def create_effects(target: Target) -> None:
    _meta.create_all(target.engine)


def _noop(_conn: Connection, _event: Event) -> None:
    """Nothing: only the claim's own cost."""


def one_row_handler(conn: Connection, event: Event) -> None:
    """One effect row per event, written with the claim's connection."""
    conn.execute(INSERT_EFFECT, {"event_id": event.id, "aggregate_id": event.aggregateid,
                                 "n": event.data["n"]})


async def async_one_row_handler(conn: AsyncConnection, event: Event) -> None:
    """The one-row handler as ``async def`` (consumer/async_handlers.py)."""
    await conn.execute(INSERT_EFFECT, {"event_id": event.id, "aggregate_id": event.aggregateid,
                                       "n": event.data["n"]})


def batch_handler(conn: Connection, events: list[Event]) -> None:
    """The same rows for all the claim's events of the type: one ``executemany`` insert."""
    conn.execute(INSERT_EFFECT, [{"event_id": e.id, "aggregate_id": e.aggregateid,
                                  "n": e.data["n"]} for e in events])


def handlers_for(variant: str, event_type: str) -> Handlers:
    """The registry of one compared row (``no-op``, ``one-row``, ``one-row unpipelined``,
    ``batch``, ``async one-row``). Any other name raises ``ValueError``: ``loop`` is no
    registry (:func:`drain_loop`), and an unknown row measured as another would be
    reported under the wrong name."""
    handlers = Handlers(pipeline=variant != "one-row unpipelined")
    if variant == "batch":
        handlers.register_batch(event_type, batch_handler)
    elif variant == "async one-row":
        handlers.register(event_type, async_one_row_handler)
    elif variant == "no-op":
        handlers.register(event_type, _noop)
    elif variant in ("one-row", "one-row unpipelined"):
        handlers.register(event_type, one_row_handler)
    else:
        raise ValueError(f"no handler row {variant!r}: one of {VARIANTS[1:]}")
    return handlers


PG_RECEIPTS = (
    "INSERT INTO outbox_inbox (group_name, event_id, stream_key, entry_id, outcome, "
    "created_at_ms) SELECT %(g)s, u.e, u.k, u.i, 'applied', %(now)s "
    "FROM unnest(%(ids)b::text[], %(keys)b::text[], %(entries)b::text[]) AS u(e, k, i) "
    "ON CONFLICT DO NOTHING RETURNING event_id"
)
PG_EFFECTS = (
    "INSERT INTO bench_effects (event_id, aggregate_id, n) "
    "SELECT * FROM unnest(%b::text[], %b::text[], %b::bigint[])"
)
SQLITE_SEEN = (
    "SELECT event_id FROM outbox_inbox WHERE group_name = ? "
    "AND event_id IN (SELECT value FROM json_each(?))"
)
SQLITE_RECEIPTS = (
    "INSERT INTO outbox_inbox (group_name, event_id, stream_key, entry_id, outcome, "
    "created_at_ms) VALUES (?, ?, ?, ?, 'applied', ?) ON CONFLICT DO NOTHING"
)
SQLITE_EFFECTS = "INSERT INTO bench_effects (event_id, aggregate_id, n) VALUES (?, ?, ?)"

# One parsed entry: (stream key, entry id, event id, aggregate id, n).
Parsed = tuple[str, str, str, str, int]
Apply = Callable[[list[Parsed]], None]


def drain_loop(
    target: Target, client: redis.Redis, stream_keys: list[str], group: str, batch: int,
    until: int, *, ready: Callable[[int | None], None] | None = None,
) -> int:
    """Claim with the hand-written loop until ``until`` events are applied; returns them.

    ``ready`` is called once everything is connected, with the PostgreSQL backend's pid
    (None on SQLite), just before the first read: the caller starts its clock there.
    """
    if target.kind == "postgresql":
        return _drain_postgres(target, client, stream_keys, group, batch, until, ready)
    return _drain_sqlite(target, client, stream_keys, group, batch, until, ready)


def _drain_postgres(
    target: Target, client: redis.Redis, stream_keys: list[str], group: str, batch: int,
    until: int, ready: Callable[[int | None], None] | None,
) -> int:
    url = target.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg.connect(url, prepare_threshold=0)
    cur = conn.cursor()

    def apply(rows: list[Parsed]) -> None:
        cur.execute(PG_RECEIPTS, {"g": group, "now": time.time_ns() // 1_000_000,
                                  "ids": [r[2] for r in rows], "keys": [r[0] for r in rows],
                                  "entries": [r[1] for r in rows]})
        new = {r[0] for r in cur.fetchall()}
        fresh = rows if len(new) == len(rows) else [r for r in rows if r[2] in new]
        if fresh:
            cur.execute(PG_EFFECTS, ([r[2] for r in fresh], [r[3] for r in fresh],
                                     [r[4] for r in fresh]))
        conn.commit()

    try:
        if ready is not None:
            ready(conn.info.backend_pid)
        return _loop(client, stream_keys, group, batch, until, apply)
    finally:
        conn.close()


def _drain_sqlite(
    target: Target, client: redis.Redis, stream_keys: list[str], group: str, batch: int,
    until: int, ready: Callable[[int | None], None] | None,
) -> int:
    path = target.engine.url.database
    assert path
    conn = sqlite3.connect(path, isolation_level=None)  # we say BEGIN and COMMIT ourselves
    for pragma in ("journal_mode=WAL", "synchronous=FULL", "busy_timeout=30000"):
        conn.execute(f"PRAGMA {pragma}")  # as the consumer's engine (shared/db.py)
    cur = conn.cursor()

    def apply(rows: list[Parsed]) -> None:
        now = time.time_ns() // 1_000_000
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(SQLITE_SEEN, (group, json.dumps([r[2] for r in rows])))
        seen = {r[0] for r in cur.fetchall()}
        fresh = [r for r in rows if r[2] not in seen] if seen else rows
        cur.executemany(SQLITE_RECEIPTS, [(group, r[2], r[0], r[1], now) for r in fresh])
        cur.executemany(SQLITE_EFFECTS, [(r[2], r[3], r[4]) for r in fresh])
        cur.execute("COMMIT")

    try:
        if ready is not None:
            ready(None)
        return _loop(client, stream_keys, group, batch, until, apply)
    finally:
        conn.close()


def _loop(
    client: redis.Redis, stream_keys: list[str], group: str, batch: int, until: int,
    apply: Apply,
) -> int:
    streams = dict.fromkeys(stream_keys, ">")
    done = 0
    while done < until:
        reply: Any = client.xreadgroup(group, "loop", streams, count=batch,  # type: ignore[arg-type]
                                       block=20)
        rows: list[Parsed] = []
        acks: dict[str, list[bytes]] = {}
        for raw_key, items in reply or []:
            key = raw_key.decode()
            ids = acks.setdefault(key, [])
            for entry_id, fields in items:
                ids.append(entry_id)
                rows.append((key, entry_id.decode(), fields[b"id"].decode(),
                             fields[b"aggregateid"].decode(), json.loads(fields[b"data"])["n"]))
        if not rows:
            continue
        apply(rows)
        pipe = client.pipeline(transaction=False)
        for key, ids in acks.items():
            pipe.xack(key, group, *ids)
        pipe.execute()
        done += len(rows)
    return done
