"""The relay's partition leases and their fence: heartbeats, the fair share, renewal, release.

Every relay node heartbeats (``relay_nodes``) and holds ``ceil(partitions / live nodes)``
partition leases (``relay_leases``); taking a lease bumps its epoch, the fence every write of
the partition checks. Heartbeats, the fair share, takes and releases are the one lease
algorithm every component uses (:mod:`shared.leases`, with :data:`RELAY_LEASES`). What is the
relay's own is the fence: :func:`fence` fences and extends a lease in the caller's transaction
in one fused statement (the relay runs it in every take and settle); the take and settle of
:mod:`relay.store` and the repair's writes (:mod:`relay.repair_store`) start with it, so a relay
that lost its lease cannot mark anything.

Lease expiries are written and compared with the database's clock
(:func:`shared.db.db_now_ms`), never a relay host's: of two relay hosts whose clocks differ by
more than the lease TTL, the one ahead would otherwise see the other's leases and heartbeat as
expired and take its partitions, back and forth (issue #25). No public function here takes a
lease's "now" from its caller.
"""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Integer,
    String,
    bindparam,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Dialect

from outbox_relay.relay import entry_ids
from outbox_relay.relay.outgoing import Batch, first_sendable, load_batches, sendable
from outbox_relay.shared import leases
from outbox_relay.shared.db import DriverStatement, db_now_ms, is_postgres
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.errors import LeaseLostError
from outbox_relay.shared.leases import LeaseTable
from outbox_relay.shared.schema import relay_leases, relay_nodes

RELAY_LEASES = LeaseTable(
    leases=relay_leases, nodes=relay_nodes, key_columns=("partition",), node_column="node_id",
    new_row={"last_entry_id": entry_ids.ZERO},
)
"""The relay's partition leases, for the one lease algorithm (:mod:`shared.leases`)."""


def database_now(engine: Engine) -> int:
    """The database's clock (epoch ms), for a relay task that compares times other relay hosts
    wrote or that entry ids carry (the trim's keep-for cutoff and its "group missing since"):
    those come from the database's clock, so a relay host whose own clock is off must not
    judge them by it."""
    with translate_errors(), engine.connect() as conn:
        return leases.db_now(conn)


def acquire_leases(engine: Engine, node_id: str, partitions: int, ttl_ms: int) -> dict[int, int]:
    """Heartbeat this node and take its fair share of partitions; return ``{partition: epoch}``.

    Fair share is ``ceil(partitions / live relays)``: :func:`shared.leases.acquire`, the one
    lease algorithm (the database's clock, key order, row-count checked takes and renewals). A
    relay above its share releases the extra partitions; below it, takes free or expired ones,
    bumping their epoch (the fence of :func:`fence`).
    """
    got = leases.acquire(engine, RELAY_LEASES, {}, node_id,
                         [(p,) for p in range(partitions)], ttl_ms)
    return {key[0]: epoch for key, epoch in got.items()}


def release_leases(engine: Engine, node_id: str, held: dict[int, int]) -> None:
    """Give our partitions back at shutdown so another relay need not wait for expiry (in
    partition order, the order every rebalance locks them in: :func:`shared.leases.release`)."""
    leases.release(engine, RELAY_LEASES, {}, node_id, {(p,): e for p, e in held.items()})


def holders(engine: Engine) -> list[dict[str, Any]]:
    """Each partition's owner (``None`` when free or expired), fencing epoch and how long its
    lease has left (``expires_in_ms``), for ``outbox status``: the listing every lease kind
    shares (:func:`shared.leases.holders`), by the database's clock."""
    return leases.holders(engine, RELAY_LEASES)


def renew_lease(engine: Engine, partition: int, node_id: str, epoch: int, ttl_ms: int) -> None:
    """Prove (and extend) that we still own ``partition`` at ``epoch``; else LeaseLostError.
    Both by the database's clock, as every lease test (:func:`_ours_bound`)."""
    with translate_errors(), engine.begin() as conn:
        _check_lease(conn, partition, node_id, epoch, ttl_ms)


def take_free_lease(engine: Engine, partition: int, node_id: str, ttl_ms: int) -> int | None:
    """Take ``partition`` if no live relay holds it (bumping the epoch); its epoch, or None.

    For one-off tools (``outbox reconcile``): a live relay's partition is left alone, "live" by
    the database's clock (:func:`shared.leases.take_free`)."""
    return leases.take_free(engine, RELAY_LEASES, {}, node_id, (partition,), ttl_ms)


def _check_lease(conn: Connection, partition: int, node_id: str, epoch: int, ttl_ms: int) -> None:
    result = conn.execute(_renew_query(is_postgres(conn)),
                          lease_params(partition, node_id, epoch, ttl_ms))
    if result.rowcount != 1:
        raise LeaseLostError(f"partition {partition} is no longer ours (epoch {epoch})")


def lease_params(partition: int, node_id: str, epoch: int, ttl_ms: int) -> dict[str, Any]:
    """The parameters of :func:`_ours_bound` (and of the lease's new expiry, the database's
    clock plus ``b_ttl``: :func:`_new_expiry`)."""
    return {"b_part": partition, "b_node": node_id, "b_epoch": epoch, "b_ttl": ttl_ms}


def _ours_bound(postgres: bool) -> tuple[Any, ...]:
    """The lease row of partition ``b_part`` as long as node ``b_node`` holds it at epoch
    ``b_epoch`` (the fence) and it has not expired by the database's clock
    (:func:`lease_params`). Not by the relay host's clock: a host whose clock runs ahead of
    another's by more than the TTL would see that relay's lease as expired (issue #25)."""
    return (
        relay_leases.c.partition == bindparam("b_part", type_=Integer),
        relay_leases.c.owner == bindparam("b_node", type_=String),
        relay_leases.c.epoch == bindparam("b_epoch", type_=BigInteger),
        relay_leases.c.expires_at_ms > db_now_ms(postgres),
    )


def _new_expiry(postgres: bool) -> Any:
    """A renewed lease's expiry: the database's clock plus ``b_ttl`` (:func:`lease_params`),
    the clock every relay host compares it with."""
    return db_now_ms(postgres) + bindparam("b_ttl", type_=BigInteger)


@functools.cache
def _fence_query(postgres: bool, idle_skip: bool) -> Any:
    """The fence of :func:`fence`, a statement built once per dialect and form: the relay runs
    it in every take and settle, and building and cache-keying the fence, mark and record
    statements on each call took 15-20 % of the relay thread's profile (SQLAlchemy memoizes
    the cache key of a statement object it sees again; a new object is keyed anew, a tree
    walk). Parameters: :func:`lease_params`."""
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
    :func:`lease_params`."""
    return select(relay_leases.c.partition).where(*_ours_bound(postgres))


@functools.cache
def fence_statement(dialect: Dialect, idle_skip: bool) -> DriverStatement:
    """:func:`fence`'s statement compiled once for the driver (every take and settle runs
    it; the pipelined take of relay/store.py sends it on psycopg's connection itself).
    Parameters: :func:`lease_params`; its row (or none): :func:`fence`'s."""
    return DriverStatement(_fence_query(dialect.name == "postgresql", idle_skip), dialect)


@functools.cache
def held_statement(dialect: Dialect) -> DriverStatement:
    """Whether the lease is ours (a read, :func:`fence`'s test after an idle skip), compiled
    once for the driver. Parameters: :func:`lease_params`."""
    return DriverStatement(_lease_held(dialect.name == "postgresql"), dialect)


@functools.cache
def fence_cte() -> Any:
    """The steady fence of :func:`fence` as a PostgreSQL CTE named ``fence`` (its columns:
    ``last_entry_id``, ``inflight``, ``now_ms``), for a statement that writes only when the
    fence passes, in the same round trip (:func:`relay.store._settle`). Parameters:
    :func:`lease_params`."""
    return (
        update(relay_leases).where(*_ours_bound(True))
        .values(expires_at_ms=_new_expiry(True))
        .returning(relay_leases.c.last_entry_id, relay_leases.c.inflight,
                   db_now_ms(True).label("now_ms"))
        .cte("fence")
    )


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
    params = lease_params(partition, node_id, epoch, ttl_ms)
    found = fence_statement(conn.dialect, idle_skip).execute(conn, params).first()
    if found is not None:
        return str(found[0]), load_batches(found[1]), int(found[2])
    if not idle_skip or held_statement(conn.dialect).execute(conn, params).first() is None:
        raise LeaseLostError(f"partition {partition} is no longer ours (epoch {epoch})")
    return None
