"""One lease algorithm for every component that splits keys among live nodes: heartbeats, the
fair share, renewal, release and takeover, each take bumping the key's fencing epoch.

The relay leases outbox partitions (relay/leases.py); the consumers of a group lease the
partition streams they read (consumer/ownership.py). Both ask the same question ("which of
these keys may I work on, and under which epoch?") and must answer it with the same rules, so
the rules live here once (issue #25 found two copies that had drifted: one compared expiries
with the host's clock, one ignored a failed renewal, one released in another lock order):

* **One clock.** Every expiry is written and compared with the database's clock
  (:func:`db_now`, :func:`shared.db.db_now_ms`), never a host's: of two hosts whose clocks
  differ by more than the TTL, the one ahead would see the other's leases and heartbeats as
  expired and take its keys, back and forth.
* **One lock order.** Every statement that changes lease rows runs in key order (rebalance,
  release), so two nodes' rebalances, a release and a fenced write never deadlock on
  PostgreSQL; on SQLite ``BEGIN IMMEDIATE`` serializes them anyway.
* **Optimistic, row-count checked.** A renewal, a release and a take are each one
  conditional ``UPDATE … WHERE epoch = <seen> AND <still ours | free or expired>``; a key
  counts as held only when its statement changed the row. Two nodes racing for one key cannot
  both win, and a node whose renewal lost the race does not believe it still holds the key.
* **No waiting on busy rows.** Lease rows are inserted only when missing: an
  ``INSERT … ON CONFLICT`` over a row another transaction has locked (a relay's fenced take, a
  consumer's claim) waits for that transaction on PostgreSQL, which stalled renewals by up to a
  claim's length.

A :class:`LeaseTable` says where one kind of lease lives; the functions take it with the
``scope`` (column values shared by one set of competing nodes: the consumer group; none for
the relay) and keys as tuples of the key columns' values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Row,
    Table,
    and_,
    delete,
    func,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from outbox_relay.shared.db import db_now_ms, is_postgres
from outbox_relay.shared.db_errors import translate_errors

Key = tuple[Any, ...]  # the values of a lease table's key columns
Scope = Mapping[str, Any]  # the values of its scope columns ({} when it has none)


@dataclass(frozen=True)
class LeaseTable:
    """Where one kind of lease lives.

    ``leases`` has the scope columns, the key columns, ``owner``, ``epoch`` and
    ``expires_at_ms``; ``nodes`` has the scope columns, ``node_column`` and ``expires_at_ms``
    (one heartbeat row per live node). ``new_row`` holds the values a new lease row needs
    beyond those (the relay's ``last_entry_id``).
    """

    leases: Table
    nodes: Table
    key_columns: tuple[str, ...]
    node_column: str
    scope_columns: tuple[str, ...] = ()
    new_row: Mapping[str, Any] = field(default_factory=dict)

    def key_of(self, row: Any) -> Key:
        """The key of a lease row."""
        return tuple(getattr(row, c) for c in self.key_columns)

    def in_scope(self, table: Table, scope: Scope) -> list[ColumnElement[bool]]:
        """The conditions that select ``scope``'s rows of ``table`` (leases or nodes)."""
        return [table.c[c] == scope[c] for c in self.scope_columns]

    def row_of(self, scope: Scope, key: Key) -> ColumnElement[bool]:
        """The condition that selects the lease row of ``key`` in ``scope``."""
        return and_(true(), *self.in_scope(self.leases, scope),
                    *(self.leases.c[c] == v for c, v in zip(self.key_columns, key, strict=True)))

    def rows_of(self, scope: Scope, keys: Sequence[Key]) -> ColumnElement[bool]:
        """The condition that selects the lease rows of ``keys`` in ``scope``."""
        columns = [self.leases.c[c] for c in self.key_columns]
        return and_(true(), *self.in_scope(self.leases, scope),
                    tuple_(*columns).in_([tuple(k) for k in keys]))

    def key_order(self) -> list[Any]:
        """The one order in which lease rows are locked and changed."""
        return [self.leases.c[c] for c in (*self.scope_columns, *self.key_columns)]


def _upsert(conn: Connection) -> Any:
    return postgresql.insert if is_postgres(conn) else sqlite.insert


def db_now(conn: Connection) -> int:
    """The database's clock (epoch ms), read once in the caller's transaction: the clock every
    host writes and compares lease and heartbeat expiries with, whatever its own says."""
    return int(conn.execute(select(db_now_ms(is_postgres(conn)))).scalar_one())


def heartbeat(conn: Connection, table: LeaseTable, scope: Scope, node: str, ttl_ms: int,
              now: int) -> int:
    """Write ``node``'s heartbeat (alive until ``now + ttl_ms``), delete the scope's heartbeats
    expired for ten TTLs, and return how many nodes of the scope are live (this one included)."""
    nodes = table.nodes
    ins = _upsert(conn)
    index = [*table.scope_columns, table.node_column]
    conn.execute(
        ins(nodes)
        .values(**scope, **{table.node_column: node}, expires_at_ms=now + ttl_ms)
        .on_conflict_do_update(index_elements=index, set_={"expires_at_ms": now + ttl_ms})
    )
    conn.execute(delete(nodes).where(*table.in_scope(nodes, scope),
                                     nodes.c.expires_at_ms < now - 10 * ttl_ms))
    return int(conn.execute(
        select(func.count()).select_from(nodes)
        .where(*table.in_scope(nodes, scope), nodes.c.expires_at_ms > now)
    ).scalar_one())


def lease_rows(conn: Connection, table: LeaseTable, scope: Scope,
               keys: Sequence[Key]) -> list[Row[Any]]:
    """The lease rows of ``keys`` in key order, inserting (free, epoch 0) the missing ones.

    Only rows that do not exist yet are inserted: an ``INSERT … ON CONFLICT`` over an existing
    row that another transaction has locked waits for that transaction on PostgreSQL (it must
    know whether the conflict is real)."""
    if not keys:
        return []
    leases = table.leases
    query = select(leases).where(table.rows_of(scope, keys)).order_by(*table.key_order())
    rows = list(conn.execute(query).all())
    missing = sorted(set(map(tuple, keys)) - {table.key_of(r) for r in rows})
    if missing:
        conn.execute(
            _upsert(conn)(leases).on_conflict_do_nothing(
                index_elements=[*table.scope_columns, *table.key_columns]),
            [{**scope, **dict(zip(table.key_columns, k, strict=True)), **table.new_row,
              "owner": None, "epoch": 0, "expires_at_ms": 0} for k in missing],
        )
        rows = list(conn.execute(query).all())
    return rows


def rebalance(conn: Connection, table: LeaseTable, scope: Scope, node: str,
              rows: Sequence[Any], fair: int, ttl_ms: int, now: int) -> dict[Key, int]:
    """Renew, release and take leases among ``rows`` for a share of ``fair``; ``{key: epoch}``
    of the leases ``node`` holds afterwards.

    Leases held within the share are renewed at the same epoch; above it, released (another
    node takes them on its next round); below it, free or expired leases are taken at epoch + 1
    (the fence: the previous owner's fenced writes at the old epoch are refused from then on).
    One conditional UPDATE each, in key order, and only a statement that changed its row counts:
    a lease another node took meanwhile is neither renewed nor believed held.
    """
    leases = table.leases
    mine = [r for r in rows if r.owner == node and r.expires_at_ms > now]
    free = [r for r in rows if r.owner is None or r.expires_at_ms <= now]
    keep, drop = mine[:fair], mine[fair:]
    take = free[: max(fair - len(keep), 0)]
    actions = sorted([(table.key_of(r), r, "keep") for r in keep]
                     + [(table.key_of(r), r, "drop") for r in drop]
                     + [(table.key_of(r), r, "take") for r in take], key=lambda a: a[0])
    held: dict[Key, int] = {}
    for key, r, action in actions:
        stmt = update(leases).where(table.row_of(scope, key), leases.c.epoch == r.epoch)
        if action == "keep":
            result = conn.execute(stmt.where(leases.c.owner == node)
                                  .values(expires_at_ms=now + ttl_ms))
            if result.rowcount == 1:
                held[key] = r.epoch
        elif action == "drop":
            conn.execute(stmt.where(leases.c.owner == node).values(owner=None, expires_at_ms=0))
        else:
            result = conn.execute(
                stmt.where(or_(leases.c.owner.is_(None), leases.c.expires_at_ms <= now))
                .values(owner=node, epoch=r.epoch + 1, expires_at_ms=now + ttl_ms)
            )
            if result.rowcount == 1:
                held[key] = r.epoch + 1
    return held


def acquire(engine: Engine, table: LeaseTable, scope: Scope, node: str, keys: Sequence[Key],
            ttl_ms: int) -> dict[Key, int]:
    """Heartbeat ``node`` and take its fair share of ``keys``: ``{key: epoch}`` it holds.

    Fair share is ``ceil(len(keys) / live nodes of the scope)``. One short transaction; the
    database's clock is read once at its start (on SQLite after ``BEGIN IMMEDIATE`` got the
    write lock). On PostgreSQL a lease row's lock may be waited for after that read: an older
    "now" only writes expiries a little shorter and sees leases expire a little later, so it
    never takes a live lease.
    """
    wanted = sorted(set(map(tuple, keys)))
    with translate_errors(), engine.begin() as conn:
        now = db_now(conn)
        live = heartbeat(conn, table, scope, node, ttl_ms, now)
        if not wanted:
            return {}
        rows = lease_rows(conn, table, scope, wanted)
        fair = math.ceil(len(wanted) / max(live, 1))
        return rebalance(conn, table, scope, node, rows, fair, ttl_ms, now)


def release(engine: Engine, table: LeaseTable, scope: Scope, node: str,
            held: Mapping[Key, int]) -> None:
    """Give ``held`` leases back and delete ``node``'s heartbeat (shutdown), so the others take
    the keys at once instead of after the TTL. Rows change in key order, the order every
    rebalance locks them in: in another order a release could wait on a row a rebalancing node
    holds while that node waits on one the release holds (a deadlock PostgreSQL breaks by
    failing one of them)."""
    leases, nodes = table.leases, table.nodes
    with translate_errors(), engine.begin() as conn:
        for key, epoch in sorted(held.items()):
            conn.execute(
                update(leases)
                .where(table.row_of(scope, key), leases.c.owner == node, leases.c.epoch == epoch)
                .values(owner=None, expires_at_ms=0)
            )
        conn.execute(delete(nodes).where(*table.in_scope(nodes, scope),
                                         nodes.c[table.node_column] == node))


def take_free(engine: Engine, table: LeaseTable, scope: Scope, node: str, key: Key,
              ttl_ms: int) -> int | None:
    """Take the lease of ``key`` if no live node holds it (epoch + 1); its epoch, or None.

    For one-off tools (``outbox reconcile``) that must not take work from a live node: "live"
    by the database's clock, so a tool on a host whose clock is ahead leaves it alone."""
    leases = table.leases
    with translate_errors(), engine.begin() as conn:
        now = db_now(conn)
        (row,) = lease_rows(conn, table, scope, [key])
        if row.owner is not None and row.expires_at_ms > now:
            return None
        result = conn.execute(
            update(leases)
            .where(table.row_of(scope, key), leases.c.epoch == row.epoch,
                   or_(leases.c.owner.is_(None), leases.c.expires_at_ms <= now))
            .values(owner=node, epoch=row.epoch + 1, expires_at_ms=now + ttl_ms)
        )
        return int(row.epoch) + 1 if result.rowcount == 1 else None


def holders(engine: Engine, table: LeaseTable) -> list[dict[str, Any]]:
    """Every lease of ``table`` in key order, for ``outbox status``: its scope and key columns,
    ``owner`` (None when free or expired), ``epoch`` and ``expires_in_ms`` (None when free).

    Compared with the database's clock, the one that wrote the expiries, so whichever host
    runs the listing shows the same owners and the same time left."""
    leases = table.leases
    with translate_errors(), engine.connect() as conn:
        rows = conn.execute(select(leases).order_by(*table.key_order())).all()
        now = db_now(conn)
    return [
        {**{c: getattr(r, c) for c in (*table.scope_columns, *table.key_columns)},
         "owner": r.owner if r.owner is not None and r.expires_at_ms > now else None,
         "epoch": r.epoch,
         "expires_in_ms": max(r.expires_at_ms - now, 0) if r.owner is not None else None}
        for r in rows
    ]
