"""The relay's book of its streams: which exist, how far each was trimmed, which groups read it.

Tables ``stream_trims`` (one row per ``(stream, partition)`` the relay ever delivered to, with
its trim floor: :func:`register_streams`, :func:`trim_floor`, :func:`record_trim`) and
``stream_groups`` (the consumer groups trims have seen on each, and since when one is missing:
:func:`known_groups`, :func:`record_groups`, :func:`forget_groups`). The trim
(relay/trim.py) keeps and reads them; the repair check (:mod:`relay.repair_store`) finds the
streams to check here, without scanning the outbox. :func:`unsettled_ms` tells the trim what a
recorded batch's retry still needs; :func:`trim_report` is what ``outbox status`` shows of it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, delete, select, update
from sqlalchemy.dialects import postgresql, sqlite

from outbox_relay.relay import entry_ids
from outbox_relay.relay.outgoing import load_batches
from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.schema import relay_leases, stream_groups, stream_trims


def _upsert(conn: Connection) -> Any:
    return postgresql.insert if is_postgres(conn) else sqlite.insert


def register_streams(engine: Engine, pairs: set[tuple[str, int]], now: int) -> None:
    """Make ``(stream, partition)`` pairs known (a trim row at floor ``0-0`` if none exists),
    so repair checks and trims find them without scanning the outbox."""
    if not pairs:
        return
    with translate_errors(), engine.begin() as conn:
        register_in(conn, pairs, now)


def register_in(conn: Connection, pairs: set[tuple[str, int]], now: int) -> None:
    conn.execute(
        _upsert(conn)(stream_trims).on_conflict_do_nothing(),
        [{"stream": s, "partition": p, "floor_entry_id": entry_ids.ZERO, "trimmed": 0,
          "updated_at_ms": now} for s, p in sorted(pairs)],
    )


def trim_floor(engine: Engine, stream: str, partition: int) -> str:
    """The trim floor of ``(stream, partition)`` (``"<ms>-0"``), or ``"0-0"`` if never trimmed."""
    with translate_errors(), engine.connect() as conn:
        floor = conn.execute(
            select(stream_trims.c.floor_entry_id).where(
                stream_trims.c.stream == stream, stream_trims.c.partition == partition
            )
        ).scalar_one_or_none()
    return floor or entry_ids.ZERO


def record_trim(
    engine: Engine, stream: str, partition: int, floor: str, trimmed: int, now: int
) -> None:
    """Raise the trim floor of ``(stream, partition)`` to ``floor`` (never lower it) and add
    ``trimmed`` to its count. Called after the ``XTRIM``, so the floor is never above what
    was trimmed."""
    key = (stream_trims.c.stream == stream, stream_trims.c.partition == partition)
    with translate_errors(), engine.begin() as conn:
        current = conn.execute(
            select(stream_trims.c.floor_entry_id).where(*key).with_for_update()
        ).scalar_one_or_none()
        if current is None:
            conn.execute(_upsert(conn)(stream_trims).values(
                stream=stream, partition=partition, floor_entry_id=floor, trimmed=trimmed,
                updated_at_ms=now,
            ).on_conflict_do_nothing())
            return
        higher = floor if entry_ids.greater(floor, current) else current
        conn.execute(update(stream_trims).where(*key).values(
            floor_entry_id=higher, trimmed=stream_trims.c.trimmed + trimmed, updated_at_ms=now,
        ))


def unsettled_ms(engine: Engine, partition: int) -> int | None:
    """The millisecond of the oldest batch recorded on the partition's lease row and not yet
    settled (appended or not: a relay may have died after its XADD), or None. The trim keeps
    every entry from it up: the retry of that batch must find its entries where it left them."""
    with translate_errors(), engine.connect() as conn:
        text = conn.execute(
            select(relay_leases.c.inflight).where(relay_leases.c.partition == partition)
        ).scalar_one_or_none()
    return min((b.ms for b in load_batches(text or "[]")), default=None)


def known_groups(
    engine: Engine, partitions: list[int]
) -> dict[tuple[str, int], dict[str, int | None]]:
    """The groups trims have seen on the streams of ``partitions``:
    ``{(stream, partition): {group: missing since ms, or None while present}}``."""
    if not partitions:
        return {}
    g = stream_groups.c
    with translate_errors(), engine.connect() as conn:
        rows = conn.execute(
            select(g.stream, g.partition, g.group_name, g.missing_since_ms)
            .where(g.partition.in_(partitions))
        ).all()
    found: dict[tuple[str, int], dict[str, int | None]] = {}
    for stream, partition, group, missing in rows:
        found.setdefault((stream, partition), {})[group] = missing
    return found


def record_groups(
    engine: Engine,
    stream: str,
    partition: int,
    *,
    seen: list[str],
    missing: list[str],
    forget: list[str],
    now: int,
) -> None:
    """Record what a trim found on ``(stream, partition)``: groups ``seen`` present (known from
    now on; no longer missing), groups newly ``missing`` (since ``now``, unless already), and
    groups to ``forget`` (missing too long)."""
    g = stream_groups.c
    at = (g.stream == stream, g.partition == partition)
    with translate_errors(), engine.begin() as conn:
        if seen:
            conn.execute(
                _upsert(conn)(stream_groups).on_conflict_do_nothing(),
                [{"stream": stream, "partition": partition, "group_name": name,
                  "seen_at_ms": now, "missing_since_ms": None} for name in sorted(seen)],
            )
            conn.execute(update(stream_groups).where(*at, g.group_name.in_(seen))
                         .values(seen_at_ms=now, missing_since_ms=None))
        if missing:
            conn.execute(update(stream_groups)
                         .where(*at, g.group_name.in_(missing), g.missing_since_ms.is_(None))
                         .values(missing_since_ms=now))
        if forget:
            conn.execute(delete(stream_groups).where(*at, g.group_name.in_(forget)))


def forget_groups(engine: Engine, group: str, stream: str | None = None) -> int:
    """Forget ``group`` on every partition of ``stream`` (or of every stream): trims stop
    waiting for it if it is missing (``outbox groups forget``). Rows removed. A group still
    present is simply recorded again by the next trim."""
    g = stream_groups.c
    where = [g.group_name == group] + ([g.stream == stream] if stream is not None else [])
    with translate_errors(), engine.begin() as conn:
        return conn.execute(delete(stream_groups).where(*where)).rowcount or 0


def trim_report(engine: Engine) -> dict[tuple[str, int], dict[str, Any]]:
    """Per ``(stream, partition)`` the book knows: its trim floor (``None`` until a trim
    removed something: everything below it was acknowledged and trimmed), the entries trimmed
    so far, and the known groups the last trim found missing (the stream is not trimmed until
    they are back), by name."""
    g = stream_groups.c
    with translate_errors(), engine.connect() as conn:
        trims = conn.execute(select(stream_trims)).all()
        missing = conn.execute(select(g.stream, g.partition, g.group_name)
                               .where(g.missing_since_ms.is_not(None))
                               .order_by(g.group_name)).all()
    report: dict[tuple[str, int], dict[str, Any]] = {
        (r.stream, r.partition): {"trim_floor": r.floor_entry_id if r.trimmed else None,
                                  "trimmed": r.trimmed, "missing_groups": []}
        for r in trims
    }
    for stream, partition, group in missing:
        report.setdefault((stream, partition), {"trim_floor": None, "trimmed": 0,
                                                "missing_groups": []})
        report[(stream, partition)]["missing_groups"].append(group)
    return report
