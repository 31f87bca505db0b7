"""Cost of the relay's periodic repair check count as the outbox grows (issue 10).

Before: one grouped ``COUNT`` over every delivered row of the relay's partitions, every 5 s.
After: one index range per known stream, from its trim floor up
(``relay.repair_store.delivered_counts``).
Fills a scratch PostgreSQL schema with ``--rows`` delivered rows (``--above`` of them above
the trim floor, i.e. still in the stream) and times both queries, best of ``--runs``.

    python -m bench.repair_check_cost --rows 1000000 --above 2000
"""

from __future__ import annotations

import argparse
import time
import uuid

from sqlalchemy import func, select, text

from outbox_relay.relay import repair_store
from outbox_relay.shared import db
from outbox_relay.shared.schema import outbox

PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--above", type=int, default=2_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    admin = db.make_engine(PG)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine = db.make_engine(f"{PG}?options=-csearch_path%3D{schema}")
    try:
        db.upgrade(engine)
        base = 1_700_000_000_000
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO outbox_events (event_id, stream, partition, type, source, payload, "
                "headers, created_at_ms, available_at_ms, entry_id, delivered_at_ms) "
                "SELECT 'e' || g, 's', 0, 't', 'b', '{}', '{}', 1, 1, "
                f"({base} + g / 500)::text || '-' || g, 2 FROM generate_series(1, {args.rows}) g"))
            floor_ms = base + (args.rows - args.above) // 500
            conn.execute(text("INSERT INTO outbox_stream_trims VALUES ('s', 0, :f, 0, 0)"),
                         {"f": f"{floor_ms}-0"})
            conn.execute(text("ANALYZE outbox_events"))

        def old() -> None:
            with engine.connect() as conn:
                conn.execute(select(outbox.c.stream, outbox.c.partition, func.count())
                             .where(outbox.c.partition.in_([0, 1, 2, 3]),
                                    outbox.c.delivered_at_ms.is_not(None))
                             .group_by(outbox.c.stream, outbox.c.partition)).all()

        def new() -> None:
            repair_store.delivered_counts(engine, [0, 1, 2, 3])

        for name, fn in (("before: grouped count over the outbox", old),
                         ("after: index range above the trim floor", new)):
            best = min(_timed(fn) for _ in range(args.runs))
            print(f"{name:<42} {best * 1000:9.2f} ms  ({args.rows:,} delivered rows, "
                  f"{args.above:,} above the floor)")
        print("counts:", repair_store.delivered_counts(engine, [0]))
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))


def _timed(fn: object) -> float:
    started = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
