"""The broker data-loss repair's queries (relay/repair.py): what the streams should hold.

Read-only queries of the delivered rows (:func:`delivered_counts`, :func:`newest_delivered_id`,
:func:`delivered_rows`, :func:`accounted_ids`) and of the ids the relay assigned
(:func:`last_assigned`), plus the two writes to a partition's last assigned id
(:func:`raise_last_assigned`, :func:`reset_unreachable_last`), fenced by the lease
(:func:`relay.leases.fence`) by the database's clock. The repair's Redis commands are in
:mod:`relay.repair_streams`.

Entry ids are "<13-digit ms>-<seq>": their text sorts like the numbers except within one
millisecond, so SQL narrows by text and Python finishes with entry_ids.parse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, bindparam, func, select

from outbox_relay.relay import entry_ids, leases
from outbox_relay.relay.outgoing import OutboxRow, record
from outbox_relay.relay.stream_book import trim_floor
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.schema import outbox, relay_leases, stream_trims

_HAS_ID = outbox.c.entry_id.is_not(None)
"""Named in every lookup by entry id below: ``ix_outbox_events_stream_entry`` is partial on it
(migration 0009), and a planner uses a partial index only where the query implies its
predicate (tests/integration/test_stream_entry_index.py checks each lookup's plan)."""


def delivered_counts(engine: Engine, partitions: list[int]) -> dict[tuple[str, int], int]:
    """``{(stream, partition): delivered rows at or above its trim floor}`` for the known
    streams (:func:`relay.stream_book.register_streams`) of the given partitions: what the
    stream should hold, or have held (rows below the floor were trimmed on purpose,
    relay/trim.py).

    One index range per stream (``ix_outbox_events_stream_entry``, entry ids at or above the
    floor), so the cost follows what the streams hold, not the whole outbox history.
    """
    if not partitions:
        return {}
    count = (
        select(func.count())
        .select_from(outbox)
        .where(
            outbox.c.stream == bindparam("b_stream"),
            outbox.c.partition == bindparam("b_partition"),
            outbox.c.entry_id >= bindparam("b_floor"),
            _HAS_ID,
            outbox.c.delivered_at_ms.is_not(None),
        )
    )
    with translate_errors(), engine.connect() as conn:
        known = conn.execute(
            select(stream_trims.c.stream, stream_trims.c.partition,
                   stream_trims.c.floor_entry_id)
            .where(stream_trims.c.partition.in_(partitions))
        ).all()
        # One statement per stream with its floor as a value: the planner then ranges over
        # the index (a join on the floor column made PostgreSQL scan every delivered row).
        return {
            (stream, partition): int(conn.execute(
                count, {"b_stream": stream, "b_partition": partition, "b_floor": floor}
            ).scalar_one())
            for stream, partition, floor in known
        }


def newest_delivered_id(engine: Engine, stream: str, partition: int) -> str | None:
    """The greatest entry id of a delivered row of ``(stream, partition)``, or None."""
    delivered = (
        outbox.c.stream == stream,
        outbox.c.partition == partition,
        _HAS_ID,
        outbox.c.delivered_at_ms.is_not(None),
    )
    with translate_errors(), engine.connect() as conn:
        top_text = conn.execute(
            select(outbox.c.entry_id).where(*delivered).order_by(outbox.c.entry_id.desc()).limit(1)
        ).scalar_one_or_none()
        if top_text is None:
            return None
        # Text order is id order across ms (a fixed-width ms) but not within one ("…-9" above
        # "…-10"): read every id of the top's ms and take the greatest. The range is bounded
        # by the next ms, not by "<ms>.": collations that ignore punctuation (glibc's
        # en_US.UTF-8, a common default) compare "<ms>-10" with "<ms>." as "<ms>10" with
        # "<ms>", and that bound left out every id of the ms (tests/integration/
        # test_entry_id_collation.py). The prefix test keeps the read exact in any collation.
        ms = top_text.partition("-")[0]
        same = f"{ms}-"
        upper = f"{int(ms) + 1:0{len(ms)}d}-"
        same_ms = [entry_id for entry_id in conn.execute(
            select(outbox.c.entry_id).where(
                *delivered, outbox.c.entry_id >= same, outbox.c.entry_id < upper)
        ).scalars() if entry_id.startswith(same)]
        newest: str = max(same_ms, key=entry_ids.parse, default=top_text)
        return newest


def delivered_rows(
    engine: Engine, stream: str, partition: int, after: str = entry_ids.ZERO
) -> list[OutboxRow]:
    """Delivered rows of ``(stream, partition)`` with an entry id greater than ``after`` and
    at or above the stream's trim floor, in entry id order: what a refill appends, under the
    ids the stream first had them (never what was trimmed on purpose)."""
    floor = trim_floor(engine, stream, partition)
    if entry_ids.greater(floor, after):
        after = entry_ids.format_id(entry_ids.parse(floor)[0], 0)
        lowest_ok = floor  # rows equal to the floor id are kept too
    else:
        lowest_ok = ""
    after_ms = entry_ids.parse(after)[0]
    with translate_errors(), engine.connect() as conn:
        rows = conn.execute(
            select(outbox).where(
                outbox.c.stream == stream,
                outbox.c.partition == partition,
                outbox.c.delivered_at_ms.is_not(None),
                outbox.c.entry_id >= f"{after_ms:013d}-",
                _HAS_ID,
            )
        ).all()
    found = [_to_row(r, r.entry_id) for r in rows
             if r.entry_id == lowest_ok or entry_ids.greater(r.entry_id, after)]
    return sorted(found, key=lambda r: entry_ids.parse(r.entry_id))


def _to_row(r: Any, entry_id: str) -> OutboxRow:
    return OutboxRow(
        seq=r.seq, event_id=r.event_id, stream=r.stream, partition=r.partition,
        aggregate_type=r.aggregate_type, aggregate_id=r.aggregate_id, revision=r.revision,
        type=r.type, source=r.source, payload=r.payload, headers=r.headers,
        created_at_ms=r.created_at_ms, entry_id=entry_id,
    )


def last_assigned(engine: Engine, partition: int) -> str:
    """The greatest entry id the relay ever assigned in ``partition`` (its lease row's
    ``last_entry_id``): every take records its batch's ids here before any ``XADD``, so no
    entry the relay appended to a stream of the partition is above it."""
    with translate_errors(), engine.connect() as conn:
        last = conn.execute(select(relay_leases.c.last_entry_id)
                            .where(relay_leases.c.partition == partition)).scalar_one_or_none()
    return last or entry_ids.ZERO


ID_PART_MAX = 2**64 - 1  # the largest ms (and seq) of a Redis stream entry id


def reset_unreachable_last(
    engine: Engine, partition: int, node_id: str, epoch: int, ttl_ms: int
) -> tuple[str, str] | None:
    """Set back a last assigned id whose next batch id cannot exist (its ms is the largest a
    stream id may have, or above), fenced by the lease; ``(old, new)``, or None if in reach.

    Only a foreign stream top adopted by an earlier relay version (a gap behind the maximum id)
    leaves such a value; every batch taken after it got an id Redis refuses, so no entry holds
    one. The new value is the greatest id the relay's entries can have: the delivered rows'
    ids and the recorded batches' (those with an invalid id dropped: never appended, their
    rows are taken again); entries above it are then foreign
    (:func:`relay.repair.settle_foreign`). If the relay's own entries are out of reach too,
    nothing changes (the partition stays visibly refused, ``redis_error``). The lease is fenced
    by the database's clock (:func:`relay.leases.fence`)."""
    if entry_ids.parse(last_assigned(engine, partition))[0] < ID_PART_MAX:
        return None
    with translate_errors(), engine.begin() as conn:
        lease = leases.fence(conn, partition, node_id, epoch, ttl_ms)
        assert lease is not None
        last, batches, _ = lease
        if entry_ids.parse(last)[0] < ID_PART_MAX:
            return None
        kept = [b for b in batches if b.ms <= ID_PART_MAX]  # the others never landed
        delivered = conn.execute(select(outbox.c.entry_id).where(
            outbox.c.partition.between(partition, partition),
            outbox.c.delivered_at_ms.is_not(None), _HAS_ID)).scalars()
        ids = [*delivered, *(entry_ids.format_id(b.ms, b.last_seq) for b in kept)]
        new = max(ids, key=entry_ids.parse, default=entry_ids.ZERO)
        if entry_ids.parse(new)[0] >= ID_PART_MAX:  # entries of ours up there: nothing to do
            return None
        record(conn, partition, epoch, kept, new)
        return last, new


def accounted_ids(engine: Engine, stream: str, partition: int, ids: Sequence[str]) -> set[str]:
    """The ``ids`` that an outbox row of ``(stream, partition)`` holds as its entry id
    (delivered or not): entries the relay may have appended under them are its own."""
    found: set[str] = set()
    with translate_errors(), engine.connect() as conn:
        for start in range(0, len(ids), 500):
            found |= set(conn.execute(
                select(outbox.c.entry_id).where(
                    outbox.c.stream == stream, outbox.c.partition == partition,
                    _HAS_ID,
                    outbox.c.entry_id.in_(list(ids[start : start + 500])))).scalars())
    return found


def raise_last_assigned(
    engine: Engine, partition: int, node_id: str, epoch: int, ttl_ms: int, top: str
) -> bool:
    """Raise the partition's last assigned entry id to ``top`` (never lower it), fenced by
    the lease (by the database's clock, :func:`relay.leases.fence`); whether it changed. The
    next batch's ids then go above ``top``."""
    with translate_errors(), engine.begin() as conn:
        lease = leases.fence(conn, partition, node_id, epoch, ttl_ms)
        assert lease is not None
        last, batches, _ = lease
        if not entry_ids.greater(top, last):
            return False
        record(conn, partition, epoch, batches, top)
        return True
