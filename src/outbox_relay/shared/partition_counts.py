"""The partition count of each stream, recorded at its first write and checked by everyone.

Events are spread over ``OUTBOX_PARTITIONS`` partitions by a hash of their aggregate; a
producer, relay or consumer configured with another count writes, claims or reads other
partitions, and events are stranded in silence (a producer with 8 and a relay with 4: half the
rows are never delivered, the relay exits idle). So the first write of a stream records its
count in ``outbox_streams``, and every component compares its own count with what is recorded:
a producer at its first event of a stream (once per process), relays and consumers at start and
every :data:`CHECK_INTERVAL_S`. A mismatch is ``invalid_config``, naming both counts.
"""

from __future__ import annotations

import threading
import weakref

from sqlalchemy import Connection, Engine, select
from sqlalchemy.dialects import postgresql, sqlite

from outbox_relay.shared.db import now_ms
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.errors import ConfigError
from outbox_relay.shared.schema import consumer_leases, streams

CHECK_INTERVAL_S = 30.0
"""How often the daemons compare their count with the recorded ones."""

# Per engine (weakly: a disposed engine is forgotten), the (stream, count) pairs known to
# agree. Keyed by the engine object, whose hash is its identity: hashing its URL cost 12 µs.
_checked: weakref.WeakKeyDictionary[Engine, set[tuple[str, int]]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def record_or_check(conn: Connection, stream: str, partitions: int) -> None:
    """In the caller's transaction: record ``stream``'s count if it has none yet, else check
    it equals ``partitions``. Once it agreed, a process does not ask again."""
    engine = conn.engine
    known = _checked.get(engine)
    if known is not None and (stream, partitions) in known:
        return
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    conn.execute(insert(streams).values(stream=stream, partitions=partitions,
                                        created_at_ms=now_ms()).on_conflict_do_nothing())
    recorded = conn.execute(
        select(streams.c.partitions).where(streams.c.stream == stream)
    ).scalar_one()
    _refuse([(stream, recorded)], partitions, "this producer")
    with _lock:
        _checked.setdefault(engine, set()).add((stream, partitions))


def check(engine: Engine, partitions: int, who: str, names: list[str] | None = None) -> None:
    """Raise ``invalid_config`` if a recorded stream (of ``names``, or any) has a count other
    than ``partitions``."""
    query = select(streams.c.stream, streams.c.partitions).where(
        streams.c.partitions != partitions)
    if names is not None:
        query = query.where(streams.c.stream.in_(names))
    with translate_errors(), engine.connect() as conn:
        _refuse([(r.stream, r.partitions) for r in conn.execute(query)], partitions, who)


def _refuse(recorded: list[tuple[str, int]], partitions: int, who: str) -> None:
    wrong = [(s, n) for s, n in recorded if n != partitions]
    if wrong:
        listed = ", ".join(f"{s} has {n}" for s, n in sorted(wrong))
        raise ConfigError(
            f"partition count mismatch: {who} is configured with OUTBOX_PARTITIONS="
            f"{partitions}, but the database records {listed} (set at the stream's first "
            "write; every producer, relay and consumer must use the same count)"
        )


def known_partitions(engine: Engine) -> set[tuple[str, int]]:
    """Every ``(stream, partition)`` the database knows: each recorded stream's partitions and
    every partition stream a consumer group has leased (streams a foreign producer writes).

    How operator commands find our streams without walking Redis's whole keyspace (``SCAN``
    is one walk per master on Redis Cluster, and sees nothing of a master that is failing
    over): the list does not depend on where a key lives."""
    with translate_errors(), engine.connect() as conn:
        recorded = conn.execute(select(streams.c.stream, streams.c.partitions)).all()
        leased = conn.execute(
            select(consumer_leases.c.stream, consumer_leases.c.partition).distinct()).all()
    return ({(stream, p) for stream, count in recorded for p in range(count)}
            | {(r.stream, r.partition) for r in leased})
