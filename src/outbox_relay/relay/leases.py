"""The relay's partition leases and their fence: heartbeats, the fair share, renewal, release.

Every relay node heartbeats (``relay_nodes``) and holds ``ceil(partitions / live nodes)``
partition leases (``relay_leases``); taking a lease bumps its epoch, the fence every write of
the partition checks. :func:`fence` fences and extends a lease in the caller's transaction: the
take and settle of :mod:`relay.store` and the repair's writes (:mod:`relay.repair_store`) start
with it, so a relay that lost its lease cannot mark anything.

Lease expiries (of partition leases and of relay node heartbeats) are written and compared with
the database's clock (:func:`shared.db.db_now_ms`), never a relay host's, as the consumers'
leases are (consumer/ownership.py): of two relay hosts whose clocks differ by more than the
lease TTL, the one ahead would otherwise see the other's leases and heartbeat as expired and
take its partitions, back and forth (issue #25). No public function here takes a lease's "now"
from its caller.
"""

from __future__ import annotations

import functools
import math
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
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from outbox_relay.relay import entry_ids
from outbox_relay.relay.outgoing import Batch, first_sendable, load_batches, sendable
from outbox_relay.shared.db import db_now_ms, is_postgres
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.errors import LeaseLostError
from outbox_relay.shared.schema import relay_leases, relay_nodes


def _upsert(conn: Connection) -> Any:
    return postgresql.insert if is_postgres(conn) else sqlite.insert


def _db_now(conn: Connection) -> int:
    """The database's clock (epoch ms), read once in the caller's transaction: every relay host
    compares lease and heartbeat expiries with the same clock, whatever its own says (a host
    ahead by more than the TTL saw every other relay as expired and took all partitions)."""
    return int(conn.execute(select(db_now_ms(is_postgres(conn)))).scalar_one())


def database_now(engine: Engine) -> int:
    """The database's clock (epoch ms), for a relay task that compares times other relay hosts
    wrote or that entry ids carry (the trim's keep-for cutoff and its "group missing since"):
    those come from the database's clock, so a relay host whose own clock is off must not
    judge them by it."""
    with translate_errors(), engine.connect() as conn:
        return _db_now(conn)


def acquire_leases(engine: Engine, node_id: str, partitions: int, ttl_ms: int) -> dict[int, int]:
    """Heartbeat this node and take its fair share of partitions; return ``{partition: epoch}``.

    Fair share is ``ceil(partitions / live nodes)``. A node above its share releases the extra
    partitions; a node below it takes free or expired ones, bumping their epoch (the fence).
    Heartbeats, the live count and lease expiries all use the database's clock, read once
    here (:func:`_db_now`, inside the transaction: on SQLite after ``BEGIN IMMEDIATE`` got the
    write lock), not the relay host's: hosts' clocks may differ by more than the TTL. On
    PostgreSQL the lease rows' lock may be waited for after that read: an older "now" only
    writes expiries a little shorter and sees leases expire a little later, never takes a
    live one.
    """
    with translate_errors(), engine.begin() as conn:
        now = _db_now(conn)
        ins = _upsert(conn)
        conn.execute(
            ins(relay_nodes)
            .values(node_id=node_id, expires_at_ms=now + ttl_ms)
            .on_conflict_do_update(
                index_elements=["node_id"], set_={"expires_at_ms": now + ttl_ms}
            )
        )
        conn.execute(delete(relay_nodes).where(relay_nodes.c.expires_at_ms < now - 10 * ttl_ms))
        live = conn.execute(
            select(func.count()).where(relay_nodes.c.expires_at_ms > now)
        ).scalar_one()
        conn.execute(
            ins(relay_leases).on_conflict_do_nothing(index_elements=["partition"]),
            [
                {"partition": p, "owner": None, "epoch": 0, "expires_at_ms": 0,
                 "last_entry_id": entry_ids.ZERO}
                for p in range(partitions)
            ],
        )
        query = select(relay_leases).where(relay_leases.c.partition < partitions)
        if is_postgres(conn):
            query = query.with_for_update()
        rows = conn.execute(query.order_by(relay_leases.c.partition)).all()
        return _rebalance(conn, rows, node_id, math.ceil(partitions / max(live, 1)), ttl_ms, now)


def _rebalance(
    conn: Connection, rows: Any, node_id: str, fair: int, ttl_ms: int, now: int
) -> dict[int, int]:
    """Renew, release and take leases (``rows``, locked) for a share of ``fair``; ``now`` is
    the database's clock :func:`acquire_leases` read."""
    mine = [r for r in rows if r.owner == node_id and r.expires_at_ms > now]
    free = [r for r in rows if r.owner is None or r.expires_at_ms <= now]
    held: dict[int, int] = {}
    for r in mine[:fair]:
        conn.execute(
            update(relay_leases)
            .where(relay_leases.c.partition == r.partition, relay_leases.c.epoch == r.epoch)
            .values(expires_at_ms=now + ttl_ms)
        )
        held[r.partition] = r.epoch
    for r in mine[fair:]:
        conn.execute(
            update(relay_leases)
            .where(relay_leases.c.partition == r.partition, relay_leases.c.epoch == r.epoch)
            .values(owner=None, expires_at_ms=0)
        )
    for r in free[: max(fair - len(held), 0)]:
        result = conn.execute(
            update(relay_leases)
            .where(relay_leases.c.partition == r.partition, relay_leases.c.epoch == r.epoch)
            .values(owner=node_id, epoch=r.epoch + 1, expires_at_ms=now + ttl_ms)
        )
        if result.rowcount == 1:
            held[r.partition] = r.epoch + 1
    return held


def release_leases(engine: Engine, node_id: str, leases: dict[int, int]) -> None:
    """Give our partitions back at shutdown so another relay need not wait for expiry.

    Rows are locked in partition order, as :func:`acquire_leases` locks them: in the order the
    leases were won (kept ones first) a release could wait on a row that an acquiring relay
    holds while that relay waits on one the release holds (a deadlock PostgreSQL breaks by
    failing one of the two)."""
    with translate_errors(), engine.begin() as conn:
        for partition, epoch in sorted(leases.items()):
            conn.execute(
                update(relay_leases)
                .where(
                    relay_leases.c.partition == partition,
                    relay_leases.c.owner == node_id,
                    relay_leases.c.epoch == epoch,
                )
                .values(owner=None, expires_at_ms=0)
            )
        conn.execute(delete(relay_nodes).where(relay_nodes.c.node_id == node_id))


def renew_lease(engine: Engine, partition: int, node_id: str, epoch: int, ttl_ms: int) -> None:
    """Prove (and extend) that we still own ``partition`` at ``epoch``; else LeaseLostError.
    Both by the database's clock, as every lease test (:func:`_ours_bound`)."""
    with translate_errors(), engine.begin() as conn:
        _check_lease(conn, partition, node_id, epoch, ttl_ms)


def take_free_lease(engine: Engine, partition: int, node_id: str, ttl_ms: int) -> int | None:
    """Take ``partition`` if no live relay holds it (bumping the epoch); its epoch, or None.

    For one-off tools (``outbox reconcile``): a live relay's partition is left alone. "Live"
    by the database's clock (:func:`_db_now`), the one the relays' leases use: a tool on a
    host whose clock is ahead must not take a partition a relay holds.
    """
    with translate_errors(), engine.begin() as conn:
        now = _db_now(conn)
        row = conn.execute(
            select(relay_leases).where(relay_leases.c.partition == partition)
        ).first()
        if row is None:
            conn.execute(
                relay_leases.insert().values(
                    partition=partition, owner=node_id, epoch=1, expires_at_ms=now + ttl_ms,
                    last_entry_id=entry_ids.ZERO,
                )
            )
            return 1
        if row.owner is not None and row.expires_at_ms > now:
            return None
        result = conn.execute(
            update(relay_leases)
            .where(relay_leases.c.partition == partition, relay_leases.c.epoch == row.epoch)
            .values(owner=node_id, epoch=row.epoch + 1, expires_at_ms=now + ttl_ms)
        )
        return row.epoch + 1 if result.rowcount == 1 else None


def _check_lease(conn: Connection, partition: int, node_id: str, epoch: int, ttl_ms: int) -> None:
    result = conn.execute(_renew_query(is_postgres(conn)),
                          _lease_params(partition, node_id, epoch, ttl_ms))
    if result.rowcount != 1:
        raise LeaseLostError(f"partition {partition} is no longer ours (epoch {epoch})")


def _lease_params(partition: int, node_id: str, epoch: int, ttl_ms: int) -> dict[str, Any]:
    """The parameters of :func:`_ours_bound` (and of the lease's new expiry, the database's
    clock plus ``b_ttl``: :func:`_new_expiry`)."""
    return {"b_part": partition, "b_node": node_id, "b_epoch": epoch, "b_ttl": ttl_ms}


def _ours_bound(postgres: bool) -> tuple[Any, ...]:
    """The lease row of partition ``b_part`` as long as node ``b_node`` holds it at epoch
    ``b_epoch`` (the fence) and it has not expired by the database's clock
    (:func:`_lease_params`). Not by the relay host's clock: a host whose clock runs ahead of
    another's by more than the TTL would see that relay's lease as expired (issue #25)."""
    return (
        relay_leases.c.partition == bindparam("b_part", type_=Integer),
        relay_leases.c.owner == bindparam("b_node", type_=String),
        relay_leases.c.epoch == bindparam("b_epoch", type_=BigInteger),
        relay_leases.c.expires_at_ms > db_now_ms(postgres),
    )


def _new_expiry(postgres: bool) -> Any:
    """A renewed lease's expiry: the database's clock plus ``b_ttl`` (:func:`_lease_params`),
    the clock every relay host compares it with."""
    return db_now_ms(postgres) + bindparam("b_ttl", type_=BigInteger)


@functools.cache
def _fence_query(postgres: bool, idle_skip: bool) -> Any:
    """The fence of :func:`fence`, a statement built once per dialect and form: the relay runs
    it in every take and settle, and building and cache-keying the fence, mark and record
    statements on each call took 15-20 % of the relay thread's profile (SQLAlchemy memoizes
    the cache key of a statement object it sees again; a new object is keyed anew, a tree
    walk). Parameters: :func:`_lease_params`."""
    stmt = update(relay_leases).where(*_ours_bound(postgres))
    if idle_skip:
        pending = sendable(bindparam("b_part", type_=Integer), db_now_ms(postgres), None)
        stmt = stmt.where(
            or_(relay_leases.c.inflight != "[]", first_sendable(pending).is_not(None))
        )
    return stmt.values(expires_at_ms=_new_expiry(postgres)).returning(
        relay_leases.c.last_entry_id, relay_leases.c.inflight, db_now_ms(postgres)
    )


@functools.cache
def _renew_query(postgres: bool) -> Any:
    """Extend the lease if it is still ours (no row changes if not), built once per dialect."""
    return (update(relay_leases).where(*_ours_bound(postgres))
            .values(expires_at_ms=_new_expiry(postgres)))


@functools.cache
def _lease_held(postgres: bool) -> Any:
    """Whether the lease is ours (a read), built once per dialect; parameters:
    :func:`_lease_params`."""
    return select(relay_leases.c.partition).where(*_ours_bound(postgres))


def fence(
    conn: Connection, partition: int, node_id: str, epoch: int, ttl_ms: int,
    *, idle_skip: bool = False,
) -> tuple[str, list[Batch], int] | None:
    """Fence and extend our lease in one statement; the lease's last entry id and batches, and
    the database's clock (:func:`shared.db.db_now_ms`), the one "now" of the transaction that
    every availability test of it uses (a row that turns available between two statements
    must not be a sendable row to one and not a delayed one to the other).

    ``UPDATE … WHERE <lease is ours> [AND (<batches recorded> OR EXISTS (<pending row>))]
    RETURNING last_entry_id, inflight, <db now>``. With ``idle_skip``, an idle partition's take
    writes nothing (on SQLite, no WAL commit and fsync competing with producers for the write lock)
    and None comes back; the lease is still verified by a read (and extended by the relay's
    periodic :func:`acquire_leases`). Raises :class:`LeaseLostError` when fenced out.

    The lease is tested and extended by that same database clock, never the relay host's
    (hosts' clocks may differ by more than the TTL), and the caller uses the returned clock
    for whatever else the transaction timestamps (``delivered_at_ms``), so the relay has one.
    """
    postgres = is_postgres(conn)
    params = _lease_params(partition, node_id, epoch, ttl_ms)
    found = conn.execute(_fence_query(postgres, idle_skip), params).first()
    if found is not None:
        return str(found[0]), load_batches(found[1]), int(found[2])
    if not idle_skip or conn.execute(_lease_held(postgres), params).first() is None:
        raise LeaseLostError(f"partition {partition} is no longer ours (epoch {epoch})")
    return None
