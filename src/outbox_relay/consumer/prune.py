"""Retention of the inbox: prune receipts and aggregate heads older than ``retention_inbox``.

A receipt is what makes a redelivered event a ``duplicate`` instead of a second application,
so a receipt is pruned only when its event cannot come back and nobody needs its record:

(a) **Never a dead receipt whose dead letter still exists.** A receipt that is not ``applied``
    or ``superseded`` (``dead``, and any outcome a later release adds, such as a trimmed
    entry's ``lost``) is the database side of a letter in the dead-letter stream of its
    partition (:func:`shared.keys.dead_letter_key`); replaying that letter relies on it. Before
    deleting such receipts, the pruner reads that stream's letters (``XRANGE`` in pages, sent
    by :mod:`consumer.letter_streams`: the original ``id`` field, ``dlq.group``, ``dlq.stream``
    and ``dlq.entry_id``) and keeps every
    receipt whose letter is still there, matched by group and event id, or by group and stream
    entry (a ``lost`` letter may know no event id); a letter without ``dlq.group`` protects the
    receipts of every group. A letter only disappears later (replay, dead-letter retention);
    the receipt goes at a later pass.
(b) **Only when the event cannot come back.** Besides its age (``created_at_ms`` older than
    ``retention_inbox`` by the database's clock):

    * with trimming (``stream_trim``, the default, as the relays run), the receipt's entry id
      must be below its stream's trim floor (``outbox_stream_trims``, raised by the relay
      after each trim; ids compared as numbers): every group acknowledged it, the stream no
      longer holds it, and a repair never refills it. No floor row, or ``0-0`` (never
      trimmed), keeps every receipt of that stream — so does an inbox in another database than
      the outbox: run those consumers with ``stream_trim`` off to prune by age;
    * without trimming, age alone decides: the settings refuse ``retention_inbox <
      retention_delivered + stream_keep_s``, so by then the outbox row a repair could refill
      is gone;
    * in both cases, a receipt whose event's outbox row (same database) is not marked delivered
      stays: the relay may append it again under the same id (it died after its ``XADD``,
      and Redis then lost the entry).

**Heads** (``outbox_inbox_heads``: each aggregate's applied revision) are pruned when they have
not moved for ``retention_inbox`` (``updated_at_ms``, set by every raise of the head): an event
of such an aggregate older than its head could only come from a redelivery, which (b) rules out
by then; a head that moves again is written afresh.

Every transaction deletes at most ``batch`` rows. Receipts are decided in two steps: candidates
are read (no lock held while Redis is read), then deleted in one short transaction that
re-checks their age (a replayed dead receipt is rewritten with a new time and is not deleted)
and, on PostgreSQL, takes the rows with ``FOR UPDATE SKIP LOCKED``: several consumers (of any
groups) can prune at once and each receipt is deleted, and counted, once. Heads are deleted
in one statement per batch, with the same lock clause on PostgreSQL.

Every SQL statement of inbox retention is here; this module sends no Redis command itself
(the letters are read by :mod:`consumer.letter_streams`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy import Connection, Engine, and_, delete, func, or_, select, tuple_

from outbox_relay.consumer import letter_streams
from outbox_relay.consumer.ordering import APPLIED, SUPERSEDED
from outbox_relay.shared.db import db_now_ms, is_postgres
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.schema import (
    consumer_retries,
    inbox,
    inbox_heads,
    outbox,
    stream_trims,
)

log = logging.getLogger(__name__)

# Outcomes that settle an event for good: no letter stands for them.
SETTLED = frozenset({APPLIED, SUPERSEDED})
LETTER_PAGE = 500
KEYS_PER_STATEMENT = 5_000


@dataclass
class PruneStats:
    """Counters of the consumer's retention task since start (exported as metrics)."""

    passes: int = 0
    receipts: int = 0  # inbox receipts deleted
    heads: int = 0  # aggregate heads deleted
    runs: int = 0  # terminal runs deleted (when retention_runs is on)


@dataclass
class InboxPruned:
    """What one pass did (dry-run: would do). ``more``: stopped at its bound, call again soon."""

    receipts: int = 0
    heads: int = 0
    retries: int = 0  # retry rows nobody touched for the retention (their entry is gone)
    kept_letter: int = 0
    kept_floor: int = 0
    kept_undelivered: int = 0
    more: bool = False


@dataclass
class _Letters:
    """What the letters of one dead-letter stream stand for: ``(group, event id)`` and
    ``(group, stream key, entry id)`` (a ``lost`` letter may know no event id); ``""`` as the
    group of a letter without ``dlq.group`` (it stands for every group)."""

    events: set[tuple[str, str]] = field(default_factory=set)
    entries: set[tuple[str, str, str]] = field(default_factory=set)

    def has(self, group: str, event_id: str, stream_key: str, entry_id: str) -> bool:
        return any(
            (g, event_id) in self.events or (g, stream_key, entry_id) in self.entries
            for g in (group, "")
        )


class InboxPruner:
    """Prunes receipts and heads, in bounded passes; remembers where the receipts scan stopped.

    Old receipts that must stay (a) or (b) are stepped over by a cursor
    ``(created_at_ms, group_name, event_id)`` kept between passes, so a pile of kept receipts
    never stalls the pass; the cursor starts over once a scan reaches the newest old receipt.
    A pass that stopped at its bound asks to be run again soon (``more``) only if it deleted
    something, so a pile of receipts that must stay is read at the normal interval.
    """

    def __init__(
        self, engine: Engine, client: redis.Redis, retention_s: float, *, batch: int,
        below_trim_floor: bool = True,
    ) -> None:
        self.engine = engine
        self.below_trim_floor = below_trim_floor
        self.client = client
        self.retention_ms = int(retention_s * 1000)
        self.batch = batch
        self._cursor: tuple[int, str, str] | None = None
        self._postgres = is_postgres(engine)

    def prune(self, *, max_batches: int | None = None, dry_run: bool = False) -> InboxPruned:
        """One pass: at most ``max_batches`` receipt transactions and as many head ones
        (``None``: until nothing old is left). Off (returns zeros) when the retention is 0.

        ``dry_run`` counts what would be deleted (every old row, unbounded) and deletes nothing.
        """
        out = InboxPruned()
        if self.retention_ms <= 0:
            return out
        with translate_errors():
            with self.engine.connect() as conn:
                cutoff = int(conn.execute(select(db_now_ms(self._postgres))).scalar_one())
                cutoff -= self.retention_ms
                floors = _floors(conn)
            self._receipts(out, cutoff, floors, max_batches, dry_run)
            self._heads(out, cutoff, max_batches, dry_run)
            self._retries(out, cutoff, max_batches, dry_run)
        return out

    # -- receipts -------------------------------------------------------------------------------

    def _receipts(
        self, out: InboxPruned, cutoff: int, floors: dict[tuple[str, int], tuple[int, int]],
        max_batches: int | None, dry_run: bool,
    ) -> None:
        if dry_run:
            self._cursor = None
        letters: dict[str, _Letters] = {}  # read once per pass and dead-letter stream
        done = deleted = 0
        while max_batches is None or done < max_batches:
            rows = self._candidates(cutoff)
            done += 1
            full = len(rows) == self.batch
            self._cursor = (rows[-1].created_at_ms, rows[-1].group_name,
                            rows[-1].event_id) if full else None
            chosen: list[tuple[str, str]] = []
            undelivered = self._undelivered([r.event_id for r in rows])
            for r in rows:
                if not _below_floor(r.stream_key, r.entry_id, floors, self.below_trim_floor):
                    out.kept_floor += 1
                elif r.event_id in undelivered:
                    out.kept_undelivered += 1
                elif r.outcome not in SETTLED and self._lettered(letters, r):
                    out.kept_letter += 1
                else:
                    chosen.append((r.group_name, r.event_id))
            deleted += len(chosen) if dry_run else self._delete_receipts(chosen, cutoff)
            if not full:
                break
        out.receipts += deleted
        # Soon again only if this pass deleted something: a pass that met only receipts that
        # must stay goes on from its cursor at the next interval, not in a tight loop.
        out.more = self._cursor is not None and deleted > 0

    def _undelivered(self, event_ids: list[str]) -> set[str]:
        """The events among ``event_ids`` whose outbox row (same database) is not marked
        delivered: the relay may still append them again (under the same id after a Redis
        loss), so their receipts stay."""
        found: set[str] = set()
        with self.engine.connect() as conn:
            for i in range(0, len(event_ids), KEYS_PER_STATEMENT):
                found |= set(conn.execute(
                    select(outbox.c.event_id).where(
                        outbox.c.event_id.in_(event_ids[i : i + KEYS_PER_STATEMENT]),
                        outbox.c.delivered_at_ms.is_(None),
                    )
                ).scalars())
        return found

    def _candidates(self, cutoff: int) -> list[Any]:
        """The next ``batch`` receipts older than ``cutoff`` after the cursor, oldest first."""
        c = inbox.c
        where = [c.created_at_ms < cutoff]
        if self._cursor is not None:
            at, group, event_id = self._cursor
            where += [c.created_at_ms >= at,
                      or_(c.created_at_ms > at, tuple_(c.group_name, c.event_id) > (group,
                                                                                    event_id))]
        query = (
            select(c.group_name, c.event_id, c.stream_key, c.entry_id, c.outcome,
                   c.created_at_ms)
            .where(*where)
            .order_by(c.created_at_ms, c.group_name, c.event_id)
            .limit(self.batch)
        )
        with self.engine.connect() as conn:
            return list(conn.execute(query).all())

    def _delete_receipts(self, chosen: list[tuple[str, str]], cutoff: int) -> int:
        """Delete the chosen receipts in one transaction (statements of at most ``KEYS_PER_
        STATEMENT`` keys: both drivers cap the bound parameters of one statement)."""
        c = inbox.c
        key = tuple_(c.group_name, c.event_id)
        deleted = 0
        with self.engine.begin() as conn:
            for i in range(0, len(chosen), KEYS_PER_STATEMENT):
                # The age is checked again: a dead receipt a replay rewrote meanwhile is new.
                mine = and_(key.in_(chosen[i : i + KEYS_PER_STATEMENT]), c.created_at_ms < cutoff)
                if self._postgres:
                    locked = select(c.group_name, c.event_id).where(mine).with_for_update(
                        skip_locked=True)
                    statement = delete(inbox).where(key.in_(locked))
                else:
                    statement = delete(inbox).where(mine)
                deleted += int(conn.execute(statement).rowcount or 0)
        return deleted

    def _lettered(self, letters: dict[str, _Letters], r: Any) -> bool:
        """Whether the dead-letter stream of the receipt's partition holds its letter."""
        dead_key = f"{r.stream_key}{letter_streams.DEAD_SUFFIX}"
        if dead_key not in letters:
            letters[dead_key] = read_letters(self.client, dead_key)
        return letters[dead_key].has(r.group_name, r.event_id, r.stream_key, r.entry_id)

    # -- heads ----------------------------------------------------------------------------------

    def _heads(
        self, out: InboxPruned, cutoff: int, max_batches: int | None, dry_run: bool
    ) -> None:
        h = inbox_heads.c
        out.heads += self._delete_old(
            inbox_heads, (h.group_name, h.aggregate_type, h.aggregate_id), h.updated_at_ms,
            cutoff, out, max_batches, dry_run)

    def _delete_old(
        self, table: Any, key_columns: tuple[Any, ...], age: Any, cutoff: int,
        out: InboxPruned, max_batches: int | None, dry_run: bool,
    ) -> int:
        """Delete the rows of ``table`` whose ``age`` column is below ``cutoff``, oldest first,
        ``batch`` rows per transaction (skipping rows another pruner holds, on PostgreSQL),
        at most ``max_batches`` transactions (then ``out.more``); rows deleted, or with
        ``dry_run`` rows that would be."""
        old = age < cutoff
        if dry_run:
            with self.engine.connect() as conn:
                return int(conn.execute(
                    select(func.count()).select_from(table).where(old)).scalar_one())
        picked = select(*key_columns).where(old).order_by(age).limit(self.batch)
        if self._postgres:
            picked = picked.with_for_update(skip_locked=True)
        statement = delete(table).where(tuple_(*key_columns).in_(picked))
        total = done = 0
        while max_batches is None or done < max_batches:
            with self.engine.begin() as conn:
                deleted = int(conn.execute(statement).rowcount or 0)
            total += deleted
            done += 1
            if deleted < self.batch:
                return total
        out.more = True
        return total


    # -- retry rows -----------------------------------------------------------------------------

    def _retries(
        self, out: InboxPruned, cutoff: int, max_batches: int | None, dry_run: bool
    ) -> None:
        """Retry rows (``outbox_consumer_retries``) not written for the whole retention.

        A claim that settles an event deletes its row, and a consumer retrying an entry
        rewrites it at every attempt (the longest wait between two is
        ``OUTBOX_RETRY_MAX_DELAY_S``). A row untouched for the retention belongs to an entry
        no consumer will claim again: it vanished (a trim, Redis lost it, its group was
        destroyed), or nobody consumed the group for that long, in which case the event's
        attempts start over at its next failure. Kept, such rows would grow without bound."""
        r = consumer_retries.c
        out.retries += self._delete_old(consumer_retries, (r.group_name, r.event_id),
                                        r.updated_at_ms, cutoff, out, max_batches, dry_run)


def read_letters(client: redis.Redis, dead_key: str) -> _Letters:
    """What every letter in ``dead_key`` stands for (see :class:`_Letters`), read in pages
    (:func:`consumer.letter_streams.walk`)."""
    found = _Letters()
    for page in letter_streams.walk(client, dead_key, LETTER_PAGE):
        for _id, fields in page:
            group = _text(fields.get(b"dlq.group"))
            if b"id" in fields:
                found.events.add((group, _text(fields[b"id"])))
            if b"dlq.stream" in fields and b"dlq.entry_id" in fields:
                found.entries.add((group, _text(fields[b"dlq.stream"]),
                                   _text(fields[b"dlq.entry_id"])))
    return found


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode("utf-8", "backslashreplace")


def entry_key(entry_id: str) -> tuple[int, int] | None:
    """``"1700000000000-3"`` → ``(1700000000000, 3)``, the order Redis sorts ids in; ``None``
    when it is not an entry id. (The relay has its own parser; the consumer never imports it.)"""
    ms, sep, seq = entry_id.partition("-")
    if not (ms.isascii() and ms.isdigit() and (not sep or (seq.isascii() and seq.isdigit()))):
        return None
    return int(ms), int(seq or 0)


def partition_of(stream_key: str) -> tuple[str, int] | None:
    """``(stream, partition)`` from the hash tag ``{stream:partition}`` closing a partition
    stream key, whatever its prefix; ``None`` if it has none."""
    _head, brace, tag = stream_key.rpartition("{")
    if not brace or not tag.endswith("}"):
        return None
    stream, _, part = tag[:-1].rpartition(":")
    if not stream or not (part.isascii() and part.isdigit()):
        return None
    return stream, int(part)


def _floors(conn: Connection) -> dict[tuple[str, int], tuple[int, int]]:
    """Every trim floor, parsed; a floor that does not parse protects nothing below ``0-0``."""
    rows = conn.execute(select(stream_trims.c.stream, stream_trims.c.partition,
                               stream_trims.c.floor_entry_id))
    return {(s, p): entry_key(f) or (0, 0) for s, p, f in rows}


def _below_floor(
    stream_key: str, entry_id: str, floors: dict[tuple[str, int], tuple[int, int]],
    trimming: bool,
) -> bool:
    """Condition (b). With trimming (the relays trim: ``stream_trim``): the entry id is below
    its stream's trim floor (no row, or ``0-0``: never trimmed, nothing is below). Without:
    True (age alone decides, with the settings' ``retention_inbox`` bound)."""
    if not trimming:
        return True
    partition = partition_of(stream_key)
    floor = floors.get(partition) if partition is not None else None
    if floor is None:
        return False
    entry = entry_key(entry_id)
    return entry is not None and entry < floor

