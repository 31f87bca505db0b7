"""The least work the job can take, for reference: a hand-written serial loop and Redis alone.

:func:`drain_baseline` is what a careful engineer would write without any framework, on the raw
DB-API connection: one statement claims a batch with a lease (``UPDATE … SET available_at_ms =
lease WHERE seq IN (SELECT … ORDER BY seq LIMIT n [FOR UPDATE SKIP LOCKED]) RETURNING …``), one
pipelined ``XADD`` batch with server-chosen ids, one statement marks the batch delivered. It has
none of the relay's guarantees (no fencing, no explicit ids, so a retry duplicates), which is
exactly why it is the yardstick.

:func:`redis_ceiling` sends the same ``XADD`` batches from Python with no database at all.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from bench.env import STREAM, Target, outbox_rows
from outbox_relay.shared import keys

_COLUMNS = (
    "seq, event_id, type, source, aggregate_type, aggregate_id, revision, payload, "
    "headers, created_at_ms"
)


def _claim_sql(postgres: bool) -> str:
    lock = " FOR UPDATE SKIP LOCKED" if postgres else ""
    mark = "%s" if postgres else "?"
    return (
        f"UPDATE outbox_events SET available_at_ms = {mark} WHERE seq IN ("
        f"SELECT seq FROM outbox_events WHERE partition = {mark} AND delivered_at_ms IS NULL "
        f"AND available_at_ms <= {mark} ORDER BY seq LIMIT {mark}{lock}) RETURNING {_COLUMNS}"
    )


def _fields(r: Any) -> dict[str, str]:
    created = datetime.fromtimestamp(r[9] / 1000, tz=UTC).isoformat().replace("+00:00", "Z")
    return {
        "specversion": "1.0", "id": r[1], "source": r[3], "type": r[2], "time": created,
        "datacontenttype": "application/json", "data": r[7], "subject": r[5],
        "aggregatetype": r[4], "aggregateid": r[5], "revision": str(r[6]),
    }


def drain_baseline(target: Target, partition: int, batch_size: int) -> int:
    """Drain one partition with the hand-written loop; returns the rows delivered."""
    postgres = target.kind == "postgresql"
    raw = target.engine.raw_connection()
    key = keys.stream_key(target.prefix, STREAM, partition)
    claim_sql = _claim_sql(postgres)
    done = 0
    try:
        cur = raw.cursor()
        while True:
            now = time.time_ns() // 1_000_000
            if not postgres:
                cur.execute("BEGIN IMMEDIATE")
            cur.execute(claim_sql, (now + 30_000, partition, now, batch_size))
            rows = sorted(cur.fetchall())
            raw.commit() if postgres else cur.execute("COMMIT")
            if not rows:
                return done
            pipe = target.redis.pipeline(transaction=False)
            for r in rows:
                pipe.xadd(key, _fields(r))  # type: ignore[arg-type]
            pipe.execute()
            seqs = [r[0] for r in rows]
            if postgres:
                cur.execute(
                    "UPDATE outbox_events SET delivered_at_ms = %s WHERE seq = ANY(%s)",
                    (now, seqs),
                )
                raw.commit()
            else:
                cur.execute("BEGIN IMMEDIATE")
                marks = ",".join("?" * len(seqs))
                cur.execute(
                    f"UPDATE outbox_events SET delivered_at_ms = ? WHERE seq IN ({marks})",
                    (now, *seqs),
                )
                cur.execute("COMMIT")
            done += len(rows)
    finally:
        raw.close()


def redis_ceiling(target: Target, count: int, batch_size: int) -> float:
    """Events/s of pipelined ``XADD`` batches from Python alone (fields built per batch)."""
    rows = list(outbox_rows(count, 1))
    tuples = [
        (0, r["event_id"], r["type"], r["source"], r["aggregate_type"], r["aggregate_id"],
         r["revision"], r["payload"], r["headers"], r["created_at_ms"])
        for r in rows
    ]
    key = keys.stream_key(target.prefix, "ceiling", 0)
    start = time.perf_counter()
    for i in range(0, len(tuples), batch_size):
        pipe = target.redis.pipeline(transaction=False)
        for t in tuples[i : i + batch_size]:
            pipe.xadd(key, _fields(t))  # type: ignore[arg-type]
        pipe.execute()
    elapsed = time.perf_counter() - start
    target.redis.delete(key)
    return count / elapsed
