"""The least work the job can take: the strongest simple serial loop, and Redis alone.

:func:`drain_baseline` is the yardstick every relay ratio of the report uses: what a careful
engineer writes without any framework, one connection, one transaction per batch::

    BEGIN                                   -- SQLite: BEGIN IMMEDIATE
    SELECT <cols> FROM outbox_events
     WHERE partition = p AND delivered_at_ms IS NULL
     ORDER BY seq LIMIT n FOR UPDATE SKIP LOCKED     -- SQLite: no lock clause
    XADD key * <fields> … (one pipelined batch, server-chosen ids)
    UPDATE outbox_events SET delivered_at_ms = now WHERE seq = ANY(ids)  -- SQLite: IN (…)
    COMMIT

It has none of the relay's guarantees (no lease, no fencing, no explicit ids: a crash between
the ``XADD`` and the ``COMMIT`` duplicates the batch; the transaction is held open across the
Redis round trip), which is exactly why it is the yardstick. What makes it strong (each kept
because it measured faster, see bench/PERFORMANCE.md, round 5):

* the raw driver connection (psycopg 3 / sqlite3), not SQLAlchemy; PostgreSQL statements are
  prepared on their first execution (``prepare_threshold=0``), results come back in binary,
  the id array goes as one binary parameter (psycopg's text dumper ran a regex per element:
  0.9 ms per 500 ids, binary 0.2 ms);
* on PostgreSQL the claim reads ``partition BETWEEN p AND p … ORDER BY partition, seq``: the
  same rows as ``partition = p … ORDER BY seq``, but a form only the pending index
  ``(partition, seq) WHERE delivered_at_ms IS NULL`` serves in order. With ``partition = p``
  the planner walks the primary key and filters (its statistics, taken before the drain, say
  every row is pending; autovacuum is off on the bench machine): the claim then reads every
  delivered row again, 90 ms per claim half-way through a 50,000-row drain instead of 1 to 8 ms.
  The relay's claim uses the same form;
* the entries are the relay's, byte for byte (the CloudEvents fields of
  :func:`outbox_relay.shared.envelope.encode_fields`, the time formatted once per second),
  each ``XADD`` packed by hiredis and the whole batch sent with one ``send_packed_command``
  and read back reply by reply on the same connection (redis-py's pipeline object cost
  5 to 8 ms more per 500 entries).

:func:`redis_ceiling` sends the same batches from Python with no database at all.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import hiredis
import psycopg
import redis

from bench.env import Target, outbox_rows
from outbox_relay.shared import keys

COLUMNS = (
    "seq, event_id, stream, type, source, aggregate_type, aggregate_id, revision, payload, "
    "headers, created_at_ms"
)
PG_CLAIM = (
    f"SELECT {COLUMNS} FROM outbox_events WHERE partition BETWEEN %(p)s AND %(p)s "
    "AND delivered_at_ms IS NULL ORDER BY partition, seq LIMIT %(n)s FOR UPDATE SKIP LOCKED"
)
PG_MARK = "UPDATE outbox_events SET delivered_at_ms = %s WHERE seq = ANY(%b)"
SQLITE_CLAIM = (
    f"SELECT {COLUMNS} FROM outbox_events WHERE partition = ? AND delivered_at_ms IS NULL "
    "ORDER BY seq LIMIT ?"
)
PHASES = ("claim", "xadd", "mark", "commit")

Phases = MutableMapping[str, float]


class TimeText:
    """RFC 3339 text of epoch milliseconds, exactly as ``encode_fields`` writes it
    (``datetime.isoformat``: microseconds, none when zero, ``Z``); the seconds part is
    formatted once per distinct second."""

    def __init__(self) -> None:
        self._second = -1
        self._text = ""

    def __call__(self, ms: int) -> str:
        second, frac = divmod(ms, 1000)
        if second != self._second:
            self._second = second
            self._text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._text}.{frac:03d}000Z" if frac else f"{self._text}Z"


def xadd_command(key: str, r: Any, iso: Callable[[int], str]) -> tuple[Any, ...]:
    """``XADD key * <fields>`` for a row of :data:`COLUMNS` (the relay's fields, in order)."""
    _seq, event_id, _stream, type_, source, agg_type, agg_id, revision, payload, headers, ms = r
    if agg_type is not None and agg_id is not None and revision is not None and headers == "{}":
        return ("XADD", key, "*", "specversion", "1.0", "id", event_id, "source", source,
                "type", type_, "time", iso(ms), "datacontenttype", "application/json",
                "data", payload, "subject", agg_id, "aggregatetype", agg_type,
                "aggregateid", agg_id, "revision", str(revision))
    fields: list[Any] = ["specversion", "1.0", "id", event_id, "source", source, "type", type_,
                         "time", iso(ms), "datacontenttype", "application/json", "data", payload]
    if agg_id is not None:
        fields += ("subject", agg_id)
    if agg_type is not None:
        fields += ("aggregatetype", agg_type)
    if agg_id is not None:
        fields += ("aggregateid", agg_id)
    if revision is not None:
        fields += ("revision", str(revision))
    if headers and headers != "{}":
        parsed = json.loads(headers)
        if parsed.get("traceparent") is not None:
            fields += ("traceparent", parsed["traceparent"])
            if parsed.get("tracestate"):
                fields += ("tracestate", parsed["tracestate"])
    return ("XADD", key, "*", *fields)


class _Sender:
    """One pipelined ``XADD`` batch on one redis-py connection: packed by hiredis, sent at
    once, the replies read back in order."""

    def __init__(self, client: redis.Redis) -> None:
        self.pool = client.connection_pool
        self.conn: Any = self.pool.get_connection()

    def send(self, commands: list[tuple[Any, ...]]) -> None:
        pack = hiredis.pack_command
        try:
            self.conn.send_packed_command([b"".join([pack(c) for c in commands])],
                                          check_health=False)
            read = self.conn.read_response
            for _ in commands:
                read()  # raises on an error reply
        except BaseException:
            self.conn.disconnect()  # replies may be left unread: never reuse the socket
            raise

    def close(self) -> None:
        self.pool.release(self.conn)


def drain_baseline(
    target: Target, partition: int, batch_size: int, phases: Phases | None = None
) -> int:
    """Drain one partition with the strong serial loop; returns the rows delivered.

    ``phases`` (optional) accumulates seconds per phase of the loop (:data:`PHASES`): the
    claim statement with its fetch, building and sending the ``XADD`` batch with its replies,
    the mark statement, the commit.
    """
    if target.kind == "postgresql":
        return _drain_postgres(target, partition, batch_size, phases)
    return _drain_sqlite(target, partition, batch_size, phases)


def _drain_postgres(target: Target, partition: int, n: int, phases: Phases | None) -> int:
    url = target.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg.connect(url, prepare_threshold=0)
    cur = conn.cursor(binary=True)
    sender = _Sender(target.redis)
    key_of = _key_cache(target.prefix, partition)
    iso = TimeText()
    clock = time.perf_counter
    done = 0
    try:
        while True:
            t0 = clock()
            cur.execute(PG_CLAIM, {"p": partition, "n": n})
            rows = cur.fetchall()
            t1 = clock()
            if rows:
                sender.send([xadd_command(key_of(r[2]), r, iso) for r in rows])
            t2 = clock()
            if rows:
                cur.execute(PG_MARK, (time.time_ns() // 1_000_000, [r[0] for r in rows]))
            t3 = clock()
            conn.commit()
            if phases is not None:
                _add(phases, t0, t1, t2, t3, clock())
            if not rows:
                return done
            done += len(rows)
    finally:
        sender.close()
        conn.close()


def _drain_sqlite(target: Target, partition: int, n: int, phases: Phases | None) -> int:
    path = target.engine.url.database
    assert path
    conn = sqlite3.connect(path, isolation_level=None)  # we say BEGIN and COMMIT ourselves
    for pragma in ("journal_mode=WAL", "synchronous=FULL", "busy_timeout=30000"):
        conn.execute(f"PRAGMA {pragma}")  # as the relay's engine (shared/db.py)
    cur = conn.cursor()
    sender = _Sender(target.redis)
    key_of = _key_cache(target.prefix, partition)
    iso = TimeText()
    clock = time.perf_counter
    marks: dict[int, str] = {}
    done = 0
    try:
        while True:
            t0 = clock()
            cur.execute("BEGIN IMMEDIATE")
            cur.execute(SQLITE_CLAIM, (partition, n))
            rows = cur.fetchall()
            t1 = clock()
            if rows:
                sender.send([xadd_command(key_of(r[2]), r, iso) for r in rows])
            t2 = clock()
            if rows:
                count = len(rows)
                sql = marks.get(count) or marks.setdefault(count, (
                    "UPDATE outbox_events SET delivered_at_ms = ? WHERE seq IN "
                    f"({','.join('?' * count)})"))
                cur.execute(sql, (time.time_ns() // 1_000_000, *[r[0] for r in rows]))
            t3 = clock()
            cur.execute("COMMIT")
            if phases is not None:
                _add(phases, t0, t1, t2, t3, clock())
            if not rows:
                return done
            done += len(rows)
    finally:
        sender.close()
        conn.close()


def _key_cache(prefix: str, partition: int) -> Callable[[str], str]:
    cache: dict[str, str] = {}

    def key_of(stream: str) -> str:
        key = cache.get(stream)
        if key is None:
            key = cache[stream] = keys.stream_key(prefix, stream, partition)
        return key

    return key_of


def _add(phases: Phases, t0: float, t1: float, t2: float, t3: float, t4: float) -> None:
    for name, start, end in zip(PHASES, (t0, t1, t2, t3), (t1, t2, t3, t4), strict=True):
        phases[name] = phases.get(name, 0.0) + end - start


def redis_ceiling(target: Target, count: int, batch_size: int) -> float:
    """Events/s of the baseline's ``XADD`` batches (same fields, same sending) from Python
    alone: rows already in memory, no database."""
    cols = COLUMNS.split(", ")
    rows = [tuple(r[c] if c != "seq" else i for c in cols)
            for i, r in enumerate(outbox_rows(count, 1))]
    key = keys.stream_key(target.prefix, "ceiling", 0)
    sender = _Sender(target.redis)
    iso = TimeText()
    try:
        start = time.perf_counter()
        for i in range(0, len(rows), batch_size):
            sender.send([xadd_command(key, r, iso) for r in rows[i : i + batch_size]])
        elapsed = time.perf_counter() - start
    finally:
        sender.close()
    target.redis.delete(key)
    return count / elapsed
