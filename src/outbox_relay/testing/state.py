"""What the test kit reads and moves: every statement and Redis command of the kit.

Reads tell :meth:`testing.Outbox.drain` whether anything is left (undelivered outbox rows,
pending or unread entries of the group, retrying events) and give a test the receipts and
dead letters to assert on. One write moves the clock: :func:`advance` makes time pass for
what waits on it (a retry's next attempt, a delayed event) by moving those times back. The
kit's own resources are made and removed here too: a PostgreSQL schema per kit
(:func:`create_schema`, :func:`drop_schema`) and its keys on a real Redis
(:func:`forget_keys`).

Why one module touches both the database and Redis: a test asks one question, "is anything
left?", whose answer spans both sides (an undelivered row, an unread entry, a retry due), and
the kit inspects the relay's and the consumer's state from outside, as a test would, rather
than through either daemon. It is test tooling, not a daemon: no component imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy import Engine, create_engine, func, select, text, update

from outbox_relay.consumer import dead_letters, group_status, streams
from outbox_relay.shared.schema import consumer_retries, inbox, outbox


@dataclass(frozen=True)
class Receipt:
    """One event's record in the group's inbox: ``outcome`` is ``applied``, ``superseded`` or
    ``dead`` (then ``reason`` says why: ``rejected``, ``out_of_order``, ``unknown_type`` …)."""

    event_id: str
    type: str | None
    aggregate_id: str | None
    revision: int | None
    outcome: str
    reason: str | None
    duplicates: int  # redeliveries found in the inbox and acknowledged without applying
    stream_key: str
    entry_id: str


@dataclass(frozen=True)
class DeadLetter:
    """One letter of a dead-letter stream, as ``outbox dlq list`` shows it."""

    event_id: str
    type: str
    reason: str
    message: str
    group: str
    stream_key: str
    entry_id: str


@dataclass(frozen=True)
class Retrying:
    """An event whose handler failed and that waits for its next attempt."""

    event_id: str
    attempts: int
    next_attempt_at_ms: int
    last_error: str | None


@dataclass(frozen=True)
class Backlog:
    """What is left to deliver and apply; :attr:`settled` when nothing is."""

    undelivered: int
    next_available_ms: int | None  # earliest available_at of an undelivered row
    pending: dict[str, int]  # stream key -> entries read by the group, not acknowledged
    unread: dict[str, int]  # stream key -> entries the group has not read
    retrying: list[Retrying]

    @property
    def settled(self) -> bool:
        """Nothing undelivered, pending or unread, and no retry outstanding."""
        return not (self.undelivered or any(self.pending.values())
                    or any(self.unread.values()) or self.retrying)

    def describe(self) -> str:
        """One line per thing still left, for the error a test sees."""
        lines = []
        if self.undelivered:
            lines.append(f"{self.undelivered} undelivered outbox row(s)")
        lines += [f"{n} pending on {k}" for k, n in self.pending.items() if n]
        lines += [f"{n} unread on {k}" for k, n in self.unread.items() if n]
        lines += [f"retrying {r.event_id} (attempt {r.attempts}, last error {r.last_error})"
                  for r in self.retrying]
        return "; ".join(lines) or "nothing"


def backlog(engine: Engine, client: redis.Redis, group: str, stream_keys: list[str]) -> Backlog:
    """What is left, read from the outbox, the group's retry rows and its streams."""
    o, r = outbox.c, consumer_retries.c
    with engine.connect() as conn:
        count, first = conn.execute(select(func.count(), func.min(o.available_at_ms))
                                    .where(o.delivered_at_ms.is_(None))).one()
        retrying = [Retrying(*row) for row in conn.execute(
            select(r.event_id, r.attempts, r.next_attempt_at_ms, r.last_error)
            .where(r.group_name == group).order_by(r.next_attempt_at_ms, r.event_id))]
    pending: dict[str, int] = {}
    unread: dict[str, int] = {}
    for key in stream_keys:
        pending[key], unread[key] = _group_backlog(client, key, group)
    return Backlog(int(count), None if first is None else int(first), pending, unread, retrying)


def unread(client: redis.Redis, group: str, stream_keys: list[str]) -> int:
    """Entries ``group`` has not read on ``stream_keys`` (Redis only: cheap between reads)."""
    return sum(_group_backlog(client, key, group)[1] for key in stream_keys)


def _group_backlog(client: redis.Redis, key: str, group: str) -> tuple[int, int]:
    """``(pending, unread)`` of ``group`` on one stream (no stream: nothing)."""
    if not client.exists(key):
        return 0, 0
    newest: Any = client.xrevrange(key, "+", "-", count=1)
    infos: Any = client.xinfo_groups(key)
    for info in infos:
        if streams.text(info["name"]) == group:
            left = group_status.unread(info, newest)
            return int(info["pending"]), int(client.xlen(key)) if left is None else left
    return 0, int(client.xlen(key))  # the group does not exist yet: everything is unread


def outbox_streams(engine: Engine) -> list[str]:
    """Every logical stream the outbox has a row for."""
    with engine.connect() as conn:
        return sorted(conn.execute(select(outbox.c.stream).distinct()).scalars())


def advance(engine: Engine, group: str, delta_ms: int) -> None:
    """Let ``delta_ms`` pass for what waits on the clock: the group's retry rows (next
    attempt and first failure, so a retry horizon comes closer as it would) and undelivered
    outbox rows (``available_at``). Relative order is kept: every time moves by the same
    amount."""
    r, o = consumer_retries.c, outbox.c
    with engine.begin() as conn:
        conn.execute(update(consumer_retries).where(r.group_name == group).values(
            next_attempt_at_ms=r.next_attempt_at_ms - delta_ms,
            first_failed_at_ms=r.first_failed_at_ms - delta_ms,
            updated_at_ms=r.updated_at_ms - delta_ms))
        conn.execute(update(outbox).where(o.delivered_at_ms.is_(None)).values(
            available_at_ms=o.available_at_ms - delta_ms))


def receipts(engine: Engine, group: str) -> list[Receipt]:
    """The group's inbox, in the order its entries were claimed."""
    i = inbox.c
    with engine.connect() as conn:
        rows = conn.execute(select(i.event_id, i.event_type, i.aggregate_id, i.revision,
                                   i.outcome, i.reason, i.duplicates, i.stream_key,
                                   i.entry_id, i.created_at_ms).where(i.group_name == group))
        found = [(row[-1], _id_key(row.entry_id), Receipt(*row[:-1])) for row in rows]
    return [receipt for _at, _id, receipt in sorted(found, key=lambda t: (t[0], t[1]))]


def letters(client: redis.Redis, prefix: str, group: str) -> list[DeadLetter]:
    """The dead letters of ``group`` under ``prefix``, oldest first in each dead-letter
    stream."""
    found = []
    for letter in dead_letters.list_letters(client, prefix, count=1_000_000):
        if letter.group != group:
            continue
        fields = {_text(k): _text(v) for k, v in letter.fields.items()}
        found.append(DeadLetter(fields.get("id", ""), fields.get("type", ""), letter.reason,
                                letter.meta.get("message", ""), letter.group,
                                letter.meta.get("stream", ""), letter.meta.get("entry_id", "")))
    return found


def _text(value: bytes) -> str:
    return value.decode(errors="backslashreplace")  # a foreign entry may hold anything


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms or 0), int(seq or 0)


def create_schema(url: str, schema: str) -> None:
    """``CREATE SCHEMA`` on the PostgreSQL database of ``url`` (a connection of its own)."""
    _admin(url, f'CREATE SCHEMA "{schema}"')


def drop_schema(url: str, schema: str) -> None:
    """``DROP SCHEMA … CASCADE`` of what :func:`create_schema` made, if it is still there."""
    _admin(url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _admin(url: str, statement: str) -> None:
    """Run one schema statement on an engine of its own, disposed of at once."""
    admin = create_engine(url)
    try:
        with admin.begin() as conn:
            conn.execute(text(statement))
    finally:
        admin.dispose()


def forget_keys(client: redis.Redis, prefix: str) -> None:
    """Delete every key under ``prefix`` (the kit's own, on a real Redis)."""
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        client.delete(key)
