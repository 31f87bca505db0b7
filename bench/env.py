"""Where a benchmark runs: an isolated database and Redis key prefix, and the data it uses.

A :class:`Target` is one database (a fresh PostgreSQL schema in the ``test`` database, or a
temporary SQLite file) plus a Redis key prefix of its own. Everything the benchmark creates is
removed by :meth:`Target.close`: the schema is dropped, the file deleted, every key under the
prefix deleted (``SCAN`` + ``DEL``, never ``FLUSHDB``: the Redis server is shared).

Seeding writes outbox rows directly in bulk (the rows :class:`producer.Producer` would write),
because 50,000 one-row transactions would take longer than the benchmark itself.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis
from sqlalchemy import Engine, create_engine, delete, insert, text

from outbox_relay.shared import db, keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.schema import inbox, inbox_heads, outbox, relay_leases, relay_nodes

REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_ADMIN_URL = os.environ.get(
    "OUTBOX_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
STREAM = "bench"
EVENT_TYPE = "bench.created"
SEED_COLUMNS = ("event_id", "stream", "partition", "aggregate_type", "aggregate_id", "revision",
                "type", "source", "payload", "headers", "created_at_ms", "available_at_ms")


@dataclass
class Target:
    """One database of one kind and one Redis key prefix, all private to this benchmark."""

    kind: str  # "sqlite" | "postgresql"
    url: str
    prefix: str
    engine: Engine
    redis: redis.Redis
    _cleanup: list[Any] = field(default_factory=list)

    def reset(self, partitions: int) -> None:
        """Empty the outbox, inbox and relay tables and delete this prefix's streams."""
        with self.engine.begin() as conn:
            for table in (outbox, inbox, inbox_heads, relay_leases, relay_nodes):
                conn.execute(delete(table))
            conn.execute(
                insert(relay_leases),
                [
                    {"partition": p, "owner": None, "epoch": 0, "expires_at_ms": 0,
                     "last_entry_id": "0-0"}
                    for p in range(partitions)
                ],
            )
        self.vacuum()
        delete_keys(self.redis, self.prefix)

    def vacuum(self) -> None:
        """``VACUUM ANALYZE`` the hot tables on PostgreSQL so runs do not inherit bloat."""
        if self.kind != "postgresql":
            return
        with self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            for name in ("outbox_events", "outbox_inbox", "outbox_relay_leases"):
                conn.execute(text(f"VACUUM ANALYZE {name}"))

    def seed(self, count: int, partitions: int, *, start: int = 0) -> None:
        """Insert ``count`` committed, undelivered outbox rows spread over ``partitions``.

        On the raw driver connection (``COPY`` on PostgreSQL, ``executemany`` on SQLite): the
        suite seeds a 50,000-row backlog some 60 times, and SQLAlchemy's batched ``INSERT``
        took 3 to 8 s each on PostgreSQL."""
        rows = [tuple(r[c] for c in SEED_COLUMNS)
                for r in outbox_rows(count, partitions, start=start)]
        raw = self.engine.raw_connection()
        try:
            cur = raw.cursor()
            if self.kind == "postgresql":
                with cur.copy(f"COPY outbox_events ({', '.join(SEED_COLUMNS)}) FROM STDIN") as copy:
                    for row in rows:
                        copy.write_row(row)
                raw.commit()
            else:  # the engine's connections are in autocommit mode: one explicit transaction
                marks = ", ".join("?" * len(SEED_COLUMNS))
                cur.execute("BEGIN IMMEDIATE")
                cur.executemany(f"INSERT INTO outbox_events ({', '.join(SEED_COLUMNS)}) "
                                f"VALUES ({marks})", rows)
                cur.execute("COMMIT")
        finally:
            raw.close()
        self.vacuum()

    def register_nodes(self, node_ids: list[str], now: int) -> None:
        """Pre-register relay nodes so each takes its fair share of partitions from the start."""
        with self.engine.begin() as conn:
            conn.execute(
                insert(relay_nodes),
                [{"node_id": n, "expires_at_ms": now + 3_600_000} for n in node_ids],
            )

    def count(self, sql: str) -> int:
        """A scalar query (diagnostics and end-of-run checks)."""
        with self.engine.connect() as conn:
            return int(conn.execute(text(sql)).scalar_one())

    def close(self) -> None:
        """Drop the schema / delete the file and every Redis key under the prefix."""
        delete_keys(self.redis, self.prefix)
        self.redis.close()
        self.engine.dispose()
        for action in reversed(self._cleanup):
            action()


def open_target(kind: str, workdir: str) -> Target:
    """A migrated, empty database of ``kind`` and a fresh key prefix."""
    prefix = f"bench{uuid.uuid4().hex[:10]}"
    cleanup: list[Any] = []
    if kind == "sqlite":
        folder = tempfile.mkdtemp(prefix="outbox-bench-", dir=workdir)
        cleanup.append(lambda: shutil.rmtree(folder, ignore_errors=True))
        url = f"sqlite:///{folder}/bench.db"
    else:
        schema = f"bench_{uuid.uuid4().hex[:10]}"
        admin = create_engine(PG_ADMIN_URL)
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))

        def drop() -> None:
            with admin.begin() as c:
                c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
            admin.dispose()

        cleanup.append(drop)
        url = f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"
    engine = db.make_engine(url)
    db.upgrade(engine)
    return Target(kind, url, prefix, engine, redis.Redis.from_url(REDIS_URL), cleanup)


def delete_keys(client: redis.Redis, prefix: str) -> None:
    """Delete every key under ``prefix:`` (SCAN + DEL; the server is shared)."""
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            client.delete(*batch)
            batch = []
    if batch:
        client.delete(*batch)


def outbox_rows(count: int, partitions: int, *, start: int = 0) -> Iterator[dict[str, Any]]:
    """Rows as the producer writes them: deterministic ids, a small JSON payload."""
    now = db.now_ms()
    for n in range(start, start + count):
        aggregate_id = f"order-{n}"
        yield {
            "event_id": f"{aggregate_id}:{EVENT_TYPE}:1",
            "stream": STREAM,
            "partition": keys.partition_for(aggregate_id, partitions),
            "aggregate_type": "order",
            "aggregate_id": aggregate_id,
            "revision": 1,
            "type": EVENT_TYPE,
            "source": "bench",
            "payload": json.dumps({"n": n, "sku": "A-1", "qty": 2}, separators=(",", ":")),
            "headers": "{}",
            "created_at_ms": now,
            "available_at_ms": now,
        }


def entry_fields(row: dict[str, Any]) -> dict[str, str]:
    """The CloudEvents fields the relay writes for a seeded row."""
    return Event(
        id=row["event_id"],
        source=row["source"],
        type=row["type"],
        time=datetime.fromtimestamp(row["created_at_ms"] / 1000, tz=UTC),
        subject=row["aggregate_id"],
        data=json.loads(row["payload"]),
        aggregatetype=row["aggregate_type"],
        aggregateid=row["aggregate_id"],
        revision=row["revision"],
    ).to_fields()


def fill_streams(client: redis.Redis, prefix: str, count: int, partitions: int) -> None:
    """Put ``count`` valid entries straight into the partition streams (consumer benchmarks)."""
    pipe = client.pipeline(transaction=False)
    for i, row in enumerate(outbox_rows(count, partitions)):
        key = keys.stream_key(prefix, STREAM, row["partition"])
        pipe.xadd(key, entry_fields(row))  # type: ignore[arg-type]
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
