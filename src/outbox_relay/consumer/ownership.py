"""Every SQL statement of consumer leases: one owner per consumer group and partition stream.

Like a Kafka partition assignment, and like the relay's partition leases (relay/leases.py): the
consumers of a group lease the partition streams they read, a lease row per group and
``(stream, partition)`` with an owner, an expiry and a fencing epoch that every takeover bumps.
Each consumer heartbeats a node row; the live nodes of a group decide the fair share.

Why: with two consumers reading one partition stream, one could apply an aggregate's revision
N+1 while N sat in the pending list of the other, which had died (issue #9). With one owner per
partition stream, an aggregate's entries are read, retried and taken over by one consumer, in id
order. The claim transaction re-checks the lease (:func:`check`), so a consumer that lost its
lease without noticing (a pause, a partition from the database) cannot commit anything.

Heartbeats, the fair share, takes and releases are the one lease algorithm every component uses
(:mod:`shared.leases`, with :data:`CONSUMER_LEASES`); what is the consumers' own is the claim's
fence (:func:`check`), the sweep of abandoned heartbeats (:func:`forget_nodes`), the listing
for ``outbox status`` and the in-process read timing (:class:`Leases`). Each function runs one
short transaction (or, for :func:`check`, one step of the caller's). Expiries are written and
compared with the database's clock (:func:`shared.db.db_now_ms`). Row locks are always taken
in ``(stream, partition)`` order, so a rebalance and a claim never deadlock on PostgreSQL.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Integer,
    String,
    bindparam,
    delete,
    func,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect

from outbox_relay.shared import leases as shared_leases
from outbox_relay.shared.db import DriverStatement, db_now_ms, is_postgres
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.errors import LeaseLostError
from outbox_relay.shared.leases import LeaseTable
from outbox_relay.shared.schema import consumer_leases as leases
from outbox_relay.shared.schema import consumer_nodes as nodes

log = logging.getLogger(__name__)

Key = tuple[str, int]  # (logical stream, partition)


class PartitionLostError(LeaseLostError):
    """A claim found that this consumer no longer owns, at its epoch, some partition streams."""

    def __init__(self, group: str, lost: Iterable[Key]) -> None:
        self.keys = sorted(lost)
        names = ", ".join(f"{s}:{p}" for s, p in self.keys)
        super().__init__(f"group {group} no longer owns {names} here")


CONSUMER_LEASES = LeaseTable(
    leases=leases, nodes=nodes, key_columns=("stream", "partition"), node_column="consumer",
    scope_columns=("group_name",),
)
"""Consumer leases, scoped by group, for the one lease algorithm (:mod:`shared.leases`)."""


def _row(group: str, key: Key) -> Any:
    return CONSUMER_LEASES.row_of({"group_name": group}, key)


def acquire(
    engine: Engine, group: str, consumer: str, keys: list[Key], ttl_ms: int
) -> dict[Key, int]:
    """Heartbeat this consumer and take its fair share of ``keys``; return ``{key: epoch}``.

    Fair share is ``ceil(len(keys) / live consumers of the group)``: the one lease algorithm
    (:func:`shared.leases.acquire`). Leases we hold within our share are renewed (same epoch);
    above it, released (another consumer takes them on its next call); below it, free or
    expired leases are taken, bumping their epoch (the fence: a claim of the previous owner at
    the old epoch is refused from then on). A lease we held but let expire comes back under a
    new epoch too, so the caller treats it as new.

    On PostgreSQL, taking a lease whose previous owner is inside a claim waits for that claim's
    row lock (:func:`check`), so the takeover happens after that commit.
    """
    got = shared_leases.acquire(engine, CONSUMER_LEASES, {"group_name": group}, consumer,
                                keys, ttl_ms)
    return {(str(k[0]), int(k[1])): epoch for k, epoch in got.items()}


def release(engine: Engine, group: str, consumer: str, held: dict[Key, int]) -> None:
    """Give our leases back and remove our heartbeat at shutdown, so the others take our
    partition streams at once instead of after the lease expires."""
    shared_leases.release(engine, CONSUMER_LEASES, {"group_name": group}, consumer, held)


def forget_nodes(engine: Engine, expired_for_ms: int, *, limit: int = 1_000) -> int:
    """Delete up to ``limit`` heartbeat rows, of any group, that expired more than
    ``expired_for_ms`` ago; return how many (group hygiene, :mod:`consumer.hygiene`).

    :func:`acquire` already deletes its own group's rows soon after they expire; what it leaves
    are the rows of groups no consumer runs any more (a crash skips :func:`release`). Deleting
    an expired row never changes a fair share (only live rows count), and a consumer that comes
    back writes its row again. On PostgreSQL rows locked by a concurrent heartbeat are skipped
    (``FOR UPDATE SKIP LOCKED``), so this never waits for, nor deadlocks with, :func:`acquire`.
    """
    with translate_errors(), engine.begin() as conn:
        cutoff = shared_leases.db_now(conn) - expired_for_ms
        query = (select(nodes.c.group_name, nodes.c.consumer)
                 .where(nodes.c.expires_at_ms < cutoff).limit(limit))
        if is_postgres(conn):
            query = query.with_for_update(skip_locked=True)
        found = [tuple(r) for r in conn.execute(query)]
        if not found:
            return 0
        result = conn.execute(delete(nodes).where(
            tuple_(nodes.c.group_name, nodes.c.consumer).in_(found),
            nodes.c.expires_at_ms < cutoff))
        return int(result.rowcount or 0)


def check(
    conn: Connection, group: str, consumer: str, held: dict[Key, int], *, ttl_ms: int
) -> None:
    """The fence of a claim: inside its transaction, verify that ``consumer`` still owns every
    key of the batch at the given epoch, and extend those leases.

    Raises :class:`PartitionLostError` naming the keys that are no longer ours (the claim
    then rolls back). An expired lease that nobody took over still passes: its epoch proves
    no one else read the partition stream since. On PostgreSQL the rows are locked
    (``SELECT … ORDER BY … FOR UPDATE``, in key order) until the claim commits, so a takeover
    waits for it; on SQLite, ``BEGIN IMMEDIATE`` already serializes the two transactions.
    """
    if not held:
        return
    wanted = sorted(held)
    if is_postgres(conn):  # one statement: lock in key order, extend ours, say whose they are
        streams, parts = zip(*wanted, strict=True)
        ours = {(stream, partition): epoch for stream, partition, epoch in
                _fence_statement(conn.dialect).execute(conn, {
                    "b_group": group, "b_consumer": consumer, "b_ttl": ttl_ms,
                    "b_streams": list(streams), "b_parts": list(parts)})}
        lost = [k for k in wanted if ours.get(k) != held[k]]
        if lost:
            raise PartitionLostError(group, lost)
        return
    where = (leases.c.group_name == group, or_(*(_row(group, k) for k in wanted)))
    query = (select(leases.c.stream, leases.c.partition, leases.c.owner, leases.c.epoch)
             .where(*where).order_by(leases.c.stream, leases.c.partition))
    if is_postgres(conn):
        query = query.with_for_update()
    found = {(r.stream, r.partition): (r.owner, r.epoch) for r in conn.execute(query)}
    lost = [k for k in wanted if found.get(k) != (consumer, held[k])]
    if lost:
        raise PartitionLostError(group, lost)
    conn.execute(update(leases).where(*where, leases.c.owner == consumer)
                 .values(expires_at_ms=db_now_ms(is_postgres(conn)) + ttl_ms))


@functools.cache
def _fence_statement(dialect: Dialect) -> DriverStatement:
    """:func:`check` on PostgreSQL in one statement, built once (its key arrays sent in
    binary)::

        WITH locked AS MATERIALIZED (SELECT stream, partition, owner, epoch
            FROM <leases> JOIN unnest(:streams, :parts) … WHERE group_name = :group
            ORDER BY stream, partition FOR UPDATE OF <leases>)
        UPDATE <leases> SET expires_at_ms = <now> + :ttl FROM locked
        WHERE <the same row> AND locked.owner = :consumer
        RETURNING locked.stream, locked.partition, locked.epoch

    The batch's lease rows are locked in key order (as every takeover locks them), whoever
    holds them; ours are extended and come back with their epoch. A key that does not come
    back, or with another epoch, is lost (the claim rolls back, the extension with it)."""
    given = func.unnest(
        bindparam("b_streams", type_=postgresql.ARRAY(String)),
        bindparam("b_parts", type_=postgresql.ARRAY(Integer)),
    ).table_valued("s", "p", name="given").render_derived()
    group = bindparam("b_group", type_=String)
    locked = (
        select(leases.c.stream, leases.c.partition, leases.c.owner, leases.c.epoch)
        .select_from(leases.join(given, (leases.c.stream == given.c.s)
                                 & (leases.c.partition == given.c.p)))
        .where(leases.c.group_name == group)
        .order_by(leases.c.stream, leases.c.partition)
        .with_for_update(of=leases)
        .cte("locked")
        .prefix_with("MATERIALIZED")
    )
    extend = (
        update(leases)
        .where(leases.c.group_name == group, leases.c.stream == locked.c.stream,
               leases.c.partition == locked.c.partition,
               locked.c.owner == bindparam("b_consumer", type_=String))
        .values(expires_at_ms=db_now_ms(True) + bindparam("b_ttl", type_=BigInteger))
        .returning(locked.c.stream, locked.c.partition, locked.c.epoch)
    )
    return DriverStatement(extend, dialect, binary=("b_streams", "b_parts"))


def owners(engine: Engine) -> list[dict[str, Any]]:
    """Every consumer lease, for ``outbox status``: group, stream, partition, owner (None
    when free or expired), epoch, and how long the lease has left
    (:func:`shared.leases.holders`)."""
    return [{"group": h.pop("group_name"), **h}
            for h in shared_leases.holders(engine, CONSUMER_LEASES)]


class Leases:
    """The partition streams one consumer owns, and whether it may still read each of them.

    Timing, with ``ttl`` the lease lifetime: leases are renewed every ``ttl/3``; a key is read
    only while less than ``ttl/2`` has passed since the start of its last successful renewal.
    A blocking read issued just before that cut-off returns within ``block_ms < ttl/4``
    (settings enforce it), so by ``3/4 ttl``: before the lease can expire and another
    consumer take the key over. Times are this process's monotonic clock, measured from
    *before* the renewal transaction, so they undershoot the database's expiry.

    Disabled (``enabled=False``, for tests and benchmarks that build one consumer by hand),
    every key is held at epoch 0, always readable, and claims are not fenced.
    """

    def __init__(
        self, engine: Engine, group: str, consumer: str, ids: dict[str, Key], ttl_ms: int,
        *, enabled: bool = True,
    ) -> None:
        self.engine, self.group, self.consumer = engine, group, consumer
        self.ids = ids  # stream key -> (stream, partition), in reading order
        self.ttl_ms = ttl_ms
        self.enabled = enabled
        self.held: dict[str, int] = {} if enabled else dict.fromkeys(ids, 0)
        self._renewed_at = -math.inf

    def due(self) -> bool:
        """True when a renewal is due (a third of the ttl after the last one)."""
        return self.enabled and time.monotonic() >= self._renewed_at + self.ttl_ms / 3000

    def renew(self) -> list[str]:
        """Heartbeat and rebalance (:func:`acquire`); return the keys newly owned, or owned
        under a new epoch, whose pending entries the caller must take over first."""
        started = time.monotonic()
        got = acquire(self.engine, self.group, self.consumer, list(self.ids.values()),
                      self.ttl_ms)
        held = {k: got[i] for k, i in self.ids.items() if i in got}
        new = [k for k, e in held.items() if self.held.get(k) != e]
        gone = [k for k in self.held if k not in held]
        if new or gone:
            log.info("consumer %s of group %s now owns %d partition stream(s): +%s -%s",
                     self.consumer, self.group, len(held), new or "[]", gone or "[]")
        self.held, self._renewed_at = held, started
        return new

    def readable(self) -> list[str]:
        """The keys this consumer may issue a read for now, in reading order."""
        if self.enabled and time.monotonic() - self._renewed_at >= self.ttl_ms / 2000:
            return []
        return [k for k in self.ids if k in self.held]

    def idle_wait_s(self) -> float:
        """How long a consumer with nothing to read waits before trying again (until the next
        renewal is due; never a busy loop, never longer than a third of the ttl)."""
        next_renewal = self._renewed_at + self.ttl_ms / 3000 - time.monotonic()
        return min(max(next_renewal, 0.01), self.ttl_ms / 3000)

    def fence(self, stream_keys: Iterable[str]) -> Callable[[Connection], None] | None:
        """The claim-transaction check for a batch of these keys (None when disabled)."""
        if not self.enabled:
            return None
        keys = list(stream_keys)
        held = {self.ids[k]: self.held[k] for k in keys if k in self.held}
        missing = [self.ids[k] for k in keys if k not in self.held]

        def fenced(conn: Connection) -> None:
            if missing:
                raise PartitionLostError(self.group, missing)
            check(conn, self.group, self.consumer, held, ttl_ms=self.ttl_ms)

        return fenced

    def drop(self, lost: Iterable[Key]) -> list[str]:
        """Stop reading the given keys (their leases were taken over); their stream keys."""
        gone = set(lost)
        dropped = [k for k, i in self.ids.items() if i in gone and k in self.held]
        for k in dropped:
            del self.held[k]
        return dropped

    def release(self) -> None:
        """Give every held lease back (shutdown)."""
        if self.enabled:
            release(self.engine, self.group, self.consumer,
                    {self.ids[k]: e for k, e in self.held.items()})
            self.held = {}
