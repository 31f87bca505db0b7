"""The relay's transactions: partition leases, take, settle, record_unknown, repair queries.

The relay's SQL (SQLAlchemy Core) is in two modules. This one opens every transaction: leases
and their fence, :func:`take`, :func:`settle` (marking rows delivered, behind a gap or refused),
:func:`record_unknown` and the broker data-loss repair's queries. :mod:`relay.outgoing` holds the
selection of the outgoing batch, run inside a transaction opened here once the lease is fenced.

Each public function runs one short transaction and returns plain data; none is ever held open
across a Redis call. Every write that depends on owning a partition re-checks the lease's owner
and fencing epoch in the same transaction, so a relay that lost its lease cannot mark anything.

Lease expiries (of partition leases and of relay node heartbeats) are written and compared with
the database's clock (:func:`shared.db.db_now_ms`), never a relay host's, as the consumers'
leases are (consumer/ownership.py): of two relay hosts whose clocks differ by more than the
lease TTL, the one ahead would otherwise see the other's leases and heartbeat as expired and
take its partitions, back and forth (issue #25). No public function here takes a lease's "now"
from its caller.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Integer,
    String,
    bindparam,
    column,
    delete,
    func,
    literal,
    or_,
    select,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from outbox_relay.relay import entry_ids
from outbox_relay.relay.outgoing import (
    Batch,
    OutboxRow,
    first_sendable,
    load_batches,
    record,
    recorded_rows,
    sendable,
    take_fresh,
)
from outbox_relay.shared.db import db_now_ms, is_postgres, json_recordset, translate_errors
from outbox_relay.shared.errors import LeaseLostError
from outbox_relay.shared.schema import (
    outbox,
    relay_leases,
    relay_nodes,
    stream_groups,
    stream_trims,
)


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
    """The fence of :func:`_fence`, a statement built once per dialect and form: the relay runs
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


def _fence(
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


def _undelivered(postgres: bool) -> tuple[Any, ...]:
    """A partition's (``b_part``) undelivered rows, for a lookup by seq.

    On PostgreSQL with the partition named, so the lookup is an exact probe of the pending
    index (without it, PostgreSQL scanned that index whole per row). On SQLite without: a seq
    is the rowid, an exact probe already, and the partition term made SQLite drive the join
    from the pending index instead (a scan of the partition's pending rows per row).
    """
    if postgres:
        return (outbox.c.partition == bindparam("b_part", type_=Integer),
                outbox.c.delivered_at_ms.is_(None))
    return (outbox.c.delivered_at_ms.is_(None),)


def take_batch(
    engine: Engine,
    partition: int,
    node_id: str,
    epoch: int,
    batch_size: int,
    ttl_ms: int,
    *,
    after_seq: int | None = None,
    inflight: Sequence[int] = (),
    waiting: frozenset[str] = frozenset(),
) -> list[OutboxRow]:
    """Take the next rows of a partition in ``seq`` order, each with its entry id.

    Without ``after_seq`` (the start of a relay's round over the partition), batches the lease
    row still records — taken by an attempt whose outcome is unknown, this relay's or a
    previous owner's — come back first, as they are, under their recorded ids
    (``retry=True``), so their retry cannot duplicate. Otherwise up to ``batch_size`` pending
    rows, from the lowest, are taken as a new batch whose ids ``<ms>-<seq>`` use an ``ms``
    above every id assigned before (the lease row remembers the last one), and the batch is
    recorded on the lease row. ``after_seq`` skips rows up to that seq: the relay takes the
    next batch while the previous one (still undelivered, its seqs in ``inflight``) is being
    appended. A row is held back while an earlier undelivered row of its aggregate is neither
    in ``inflight`` nor ahead of it in the batch (:mod:`relay.outgoing`). Raises
    :class:`LeaseLostError` when fenced out. Rows of the streams in ``waiting`` (backing off
    after a refusal, relay/refusals.py) are not taken. The lease is fenced and extended by the
    database's clock (:func:`_fence`).
    """
    with translate_errors(), engine.begin() as conn:
        return _take(conn, partition, node_id, epoch, batch_size, ttl_ms,
                     after_seq=after_seq, inflight=inflight, waiting=waiting)


def take_batches(
    engine: Engine, node_id: str, leases: dict[int, int], batch_size: int, ttl_ms: int,
    waiting: dict[int, frozenset[str]] | None = None,
) -> tuple[dict[int, list[OutboxRow]], list[int]]:
    """:func:`take_batch` (without ``after_seq``) for several partitions in **one**
    transaction: ``({partition: rows}, [partitions fenced out])``.

    A relay round over the partitions its notifications named takes all of them at once,
    one commit (and on SQLite one write lock) instead of one per partition. A partition whose
    fence fails writes nothing (the fence is its first statement and changes no row), so the
    others still commit. Lease rows are locked in partition order, as :func:`acquire_leases`
    locks them, so two relays' rounds cannot deadlock.
    """
    taken: dict[int, list[OutboxRow]] = {}
    lost: list[int] = []
    with translate_errors(), engine.begin() as conn:
        for partition in sorted(leases):
            try:
                rows = _take(conn, partition, node_id, leases[partition], batch_size, ttl_ms,
                             waiting=(waiting or {}).get(partition, frozenset()))
            except LeaseLostError:
                lost.append(partition)
                continue
            if rows:
                taken[partition] = rows
    return taken, lost


def _take(
    conn: Connection, partition: int, node_id: str, epoch: int, batch_size: int, ttl_ms: int,
    *, after_seq: int | None = None, inflight: Sequence[int] = (),
    waiting: frozenset[str] = frozenset(),
) -> list[OutboxRow]:
    """The body of :func:`take_batch`, in the caller's transaction."""
    if after_seq is not None:
        lease = _fence(conn, partition, node_id, epoch, ttl_ms)
        assert lease is not None
        last, batches, db_now = lease
        return take_fresh(conn, partition, epoch, batch_size, db_now, last, batches,
                          after_seq=after_seq, inflight=inflight, waiting=waiting)
    found = _fence(conn, partition, node_id, epoch, ttl_ms, idle_skip=True)
    if found is None:
        return []
    last, batches, db_now = found
    if batches:
        rows = recorded_rows(conn, partition, batches, db_now)
        if rows:
            return rows
        batches = []  # their rows are gone: nothing left to retry
    return take_fresh(conn, partition, epoch, batch_size, db_now, last, batches,
                      force_write=True, waiting=waiting)


def _mark_delivered(
    conn: Connection, partition: int, pairs: list[tuple[int, str]], now: int
) -> None:
    """Mark ``(seq, entry_id)`` rows delivered under that id, in one statement
    (:func:`_mark_query`), at ``now`` (the relay passes the database's clock its fence read,
    the clock the retention prune compares ``delivered_at_ms`` with). Only still-undelivered
    rows change."""
    if not is_postgres(conn):
        prefix = _one_batch_prefix(pairs)
        if prefix is not None:
            conn.execute(_mark_seqs_query(), {"b_seqs": json.dumps([s for s, _ in pairs]),
                                              "b_prefix": prefix, "b_now": now})
            return
        conn.execute(_mark_query(False), {"b_pairs": json.dumps(pairs), "b_now": now})
        return
    conn.execute(
        _mark_query(True),
        {"b_pairs": [{"seq": s, "entry_id": e} for s, e in pairs], "b_part": partition,
         "b_now": now},
    )


def _one_batch_prefix(pairs: list[tuple[int, str]]) -> str | None:
    """``"<ms>-"`` when every id is ``<ms>-<seq>`` of its own seq with one ``ms`` (a batch as
    :func:`take_batch` takes it), else None (ids of several recorded batches, or an id an
    earlier version of the relay wrote)."""
    if not pairs:
        return None
    prefix = pairs[0][1].partition("-")[0] + "-"
    for seq, entry_id in pairs:
        if entry_id != f"{prefix}{seq}":
            return None
    return prefix


@functools.cache
def _mark_seqs_query() -> Any:
    """SQLite's mark of one batch's rows (:func:`_one_batch_prefix`), built once:
    ``… SET entry_id = :b_prefix || seq … WHERE seq IN (SELECT value FROM json_each(:b_seqs))``
    writes the same ids as :func:`_mark_query`'s join on ``json_each`` of the pairs, which
    parsed each pair twice with ``json_extract``: 2.2 ms instead of 2.8 ms per 500 rows
    (median of 30, CPU time, bench/PERFORMANCE.md). The seq is an INTEGER (the rowid), so its
    text is Python's ``str`` of it."""
    seqs = func.json_each(bindparam("b_seqs")).table_valued("value")
    return (
        update(outbox)
        .where(*_undelivered(False), outbox.c.seq.in_(select(seqs.c.value)))
        .values(entry_id=bindparam("b_prefix", type_=String).concat(outbox.c.seq),
                delivered_at_ms=bindparam("b_now", type_=BigInteger),
                attempts=outbox.c.attempts + 1, last_error=None)
    )


@functools.cache
def _mark_query(postgres: bool) -> Any:
    """The mark of :func:`_mark_delivered`, a statement built once per dialect (built per call,
    it cost a settle as much Python time as the fence).

    Constant SQL, so it is compiled once whatever the batch size (a row-by-row executemany
    cost more than the rest of the settle): PostgreSQL joins ``json_to_recordset(:b_pairs)``
    (:func:`shared.db.json_recordset`), SQLite ``json_each(:b_pairs)``.
    """
    done = {"delivered_at_ms": bindparam("b_now", type_=BigInteger),
            "attempts": outbox.c.attempts + 1, "last_error": None}
    if not postgres:
        pairs_json = func.json_each(bindparam("b_pairs")).table_valued("value", name="given")
        seq = func.json_extract(pairs_json.c.value, "$[0]")
        entry_id = func.json_extract(pairs_json.c.value, "$[1]")
        return (
            update(outbox)
            .where(*_undelivered(False), outbox.c.seq == seq)
            .values(entry_id=entry_id, **done)
        )
    given = json_recordset("b_pairs", column("seq", BigInteger), column("entry_id", String))
    return (
        update(outbox)
        .where(*_undelivered(True), outbox.c.seq == given.c.seq)
        .values(entry_id=given.c.entry_id, **done)
    )


def _to_row(r: Any, entry_id: str) -> OutboxRow:
    return OutboxRow(
        seq=r.seq, event_id=r.event_id, stream=r.stream, partition=r.partition,
        aggregate_type=r.aggregate_type, aggregate_id=r.aggregate_id, revision=r.revision,
        type=r.type, source=r.source, payload=r.payload, headers=r.headers,
        created_at_ms=r.created_at_ms, entry_id=entry_id,
    )


def settle(
    engine: Engine,
    partition: int,
    node_id: str,
    epoch: int,
    ttl_ms: int,
    *,
    delivered: list[tuple[int, str]],
    gaps: list[int],
    failed: list[tuple[int, str]],
    stream_top: str | None = None,
    take_after: int | None = None,
    batch_size: int = 0,
    inflight: Sequence[int] = (),
    drop_recorded: bool = False,
    register: set[tuple[str, int]] | None = None,
    waiting: frozenset[str] = frozenset(),
) -> list[OutboxRow]:
    """Record what Redis said, in one transaction, only while our epoch is current.

    ``delivered``: ``(seq, entry_id)`` Redis holds; they are marked under that id. ``gaps``:
    rows whose id fell behind the stream's top without being there, and ``failed``:
    ``(seq, error code)`` Redis refused; both stay pending and are taken again in a later
    batch, under new ids above every id so far. ``stream_top`` (the stream's last generated
    id behind a gap) is not adopted: a top above every id the relay assigned is foreign, and
    the repair check settles it (relay/repair.py). The settled batch's record leaves the
    lease row.

    With ``take_after``, the same transaction also takes the next batch after that seq (as
    :func:`take` does, ``inflight`` being the seqs of the batch appended meanwhile) and
    returns it: the relay's steady state is one transaction per batch. ``drop_recorded``
    forgets every recorded batch: the relay does so when a batch did not land whole, with the
    next batch taken but never appended (its ids were never used; its rows, like the ones
    left behind, are taken again in seq order under new ids).

    ``register``: ``(stream, partition)`` pairs this relay process has not delivered to before;
    they are made known (:func:`register_streams`) with the mark, so no delivered row's stream
    is ever unknown to repair checks and trims, whatever crashes.

    The lease is fenced and extended, and rows are marked delivered, by the database's clock
    (:func:`_fence`), not the relay host's: hosts' clocks may differ by more than the TTL.
    """
    outcome = Settlement(partition, epoch, delivered, gaps, failed, stream_top, register,
                         drop_recorded)
    with translate_errors(), engine.begin() as conn:
        return _settle(conn, outcome, node_id, ttl_ms, take_after=take_after,
                       batch_size=batch_size, inflight=inflight, waiting=waiting)


@dataclass(frozen=True)
class Settlement:
    """What Redis said about one partition's batch: the arguments of :func:`settle`."""

    partition: int
    epoch: int
    delivered: list[tuple[int, str]]
    gaps: list[int]
    failed: list[tuple[int, str]]
    stream_top: str | None = None
    register: set[tuple[str, int]] | None = None
    drop_recorded: bool = False


def settle_batches(
    engine: Engine, node_id: str, ttl_ms: int, outcomes: list[Settlement]
) -> list[int]:
    """:func:`settle` (without a take) for several partitions' batches in **one** transaction;
    returns the partitions fenced out, whose rows stay as they were (their next owner retries
    the recorded batches under the same ids). Partition order, as in :func:`take_batches`."""
    lost: list[int] = []
    with translate_errors(), engine.begin() as conn:
        for outcome in sorted(outcomes, key=lambda o: o.partition):
            try:
                _settle(conn, outcome, node_id, ttl_ms)
            except LeaseLostError:  # the fence changed nothing: the others still commit
                lost.append(outcome.partition)
    return lost


def _settle(
    conn: Connection, o: Settlement, node_id: str, ttl_ms: int, *,
    take_after: int | None = None, batch_size: int = 0, inflight: Sequence[int] = (),
    waiting: frozenset[str] = frozenset(),
) -> list[OutboxRow]:
    """The body of :func:`settle`, in the caller's transaction. Rows are marked delivered (and
    streams registered) at the database's clock the fence returned: the relay has one clock."""
    partition, epoch = o.partition, o.epoch
    lease = _fence(conn, partition, node_id, epoch, ttl_ms)
    assert lease is not None
    last, batches, db_now = lease
    # A stream top behind a gap is never adopted here: one above ``last`` was not written by
    # the relay (the relay's repair check moves foreign entries away, or adopts a bare top
    # near the clock: relay/repair.py), and adopting it could take an id no stream can follow.
    if o.delivered:
        _mark_delivered(conn, partition, o.delivered, db_now)
        if o.register:
            _register(conn, o.register, db_now)
    if o.gaps:
        conn.execute(_attempted(is_postgres(conn), gap=True),
                     {"b_part": partition, "b_seqs": o.gaps, "b_error": "ordering_gap"})
    if o.failed:
        conn.execute(_failed_query(is_postgres(conn)),
                     [{"b_part": partition, "b_seq": s, "b_error": c} for s, c in o.failed])
    through = max([s for s, _ in o.delivered] + o.gaps + [s for s, _ in o.failed], default=-1)
    batches = [] if o.drop_recorded else [b for b in batches if b.first_seq > through]
    if take_after is None:
        record(conn, partition, epoch, batches, last)
        return []
    return take_fresh(conn, partition, epoch, batch_size, db_now, last, batches,
                      after_seq=take_after, inflight=inflight, force_write=True,
                      waiting=waiting)


@functools.cache
def _attempted(postgres: bool, *, gap: bool) -> Any:
    """Count an attempt on the undelivered rows ``b_seqs`` of partition ``b_part`` with error
    ``b_error``; a ``gap`` also forgets their entry ids (they go out again under new ones).
    Built once per dialect, like the relay's other per-batch statements (:func:`_fence_query`);
    ``b_seqs`` expands to the list at execution."""
    values: dict[str, Any] = {"attempts": outbox.c.attempts + 1,
                              "last_error": bindparam("b_error", type_=String)}
    if gap:
        values["entry_id"] = None
    return (
        update(outbox)
        .where(*_undelivered(postgres), outbox.c.seq.in_(bindparam("b_seqs", expanding=True)))
        .values(**values)
    )


@functools.cache
def _failed_query(postgres: bool) -> Any:
    """Count a refused attempt of row ``b_seq`` with its error code ``b_error`` (run as an
    executemany), built once per dialect."""
    return (
        update(outbox)
        .where(*_undelivered(postgres), outbox.c.seq == bindparam("b_seq", type_=BigInteger))
        .values(attempts=outbox.c.attempts + 1,
                last_error=bindparam("b_error", type_=String))
    )


def record_unknown(engine: Engine, partition: int, seqs: list[int], code: str) -> None:
    """Note an attempt whose outcome Redis never told us (the rows keep their entry ids)."""
    with translate_errors(), engine.begin() as conn:
        conn.execute(_attempted(is_postgres(conn), gap=False),
                     {"b_part": partition, "b_seqs": seqs, "b_error": code})


# --- Broker data-loss repair (relay/repair.py): read-only queries plus lease helpers. ---
# Entry ids are "<13-digit ms>-<seq>": their text sorts like the numbers except within one
# millisecond, so SQL narrows by text and Python finishes with entry_ids.parse.


def delivered_counts(engine: Engine, partitions: list[int]) -> dict[tuple[str, int], int]:
    """``{(stream, partition): delivered rows at or above its trim floor}`` for the known
    streams (:func:`register_streams`) of the given partitions: what the stream should hold,
    or have held (rows below the floor were trimmed on purpose, relay/trim.py).

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


def register_streams(engine: Engine, pairs: set[tuple[str, int]], now: int) -> None:
    """Make ``(stream, partition)`` pairs known (a trim row at floor ``0-0`` if none exists),
    so repair checks and trims find them without scanning the outbox."""
    if not pairs:
        return
    with translate_errors(), engine.begin() as conn:
        _register(conn, pairs, now)


def _register(conn: Connection, pairs: set[tuple[str, int]], now: int) -> None:
    conn.execute(
        _upsert(conn)(stream_trims).on_conflict_do_nothing(),
        [{"stream": s, "partition": p, "floor_entry_id": entry_ids.ZERO, "trimmed": 0,
          "updated_at_ms": now} for s, p in sorted(pairs)],
    )


def sendable_elsewhere(engine: Engine, partitions: int, held: set[int]) -> list[int]:
    """The partitions below ``partitions`` that this relay does not hold and that have a row to
    send now (undelivered, available by the database's clock): what an ``--until-idle`` relay
    waits for before it may call the outbox idle. One indexed probe per partition."""
    others = [p for p in range(partitions) if p not in held]
    if not others:
        return []
    with translate_errors(), engine.connect() as conn:
        now = db_now_ms(is_postgres(conn))
        probes = [select(literal(p).label("partition"),
                         first_sendable(sendable(p, now, None)).label("seq")) for p in others]
        rows = conn.execute(union_all(*probes)).all()
    return sorted(int(r.partition) for r in rows if r.seq is not None)


def unsettled_ms(engine: Engine, partition: int) -> int | None:
    """The millisecond of the oldest batch recorded on the partition's lease row and not yet
    settled (appended or not: a relay may have died after its XADD), or None. The trim keeps
    every entry from it up: the retry of that batch must find its entries where it left them."""
    with translate_errors(), engine.connect() as conn:
        text = conn.execute(
            select(relay_leases.c.inflight).where(relay_leases.c.partition == partition)
        ).scalar_one_or_none()
    return min((b.ms for b in load_batches(text or "[]")), default=None)


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


def newest_delivered_id(engine: Engine, stream: str, partition: int) -> str | None:
    """The greatest entry id of a delivered row of ``(stream, partition)``, or None."""
    delivered = (
        outbox.c.stream == stream,
        outbox.c.partition == partition,
        outbox.c.delivered_at_ms.is_not(None),
    )
    with translate_errors(), engine.connect() as conn:
        top_text = conn.execute(
            select(outbox.c.entry_id).where(*delivered).order_by(outbox.c.entry_id.desc()).limit(1)
        ).scalar_one_or_none()
        if top_text is None:
            return None
        ms = top_text.partition("-")[0]
        same_ms = conn.execute(
            select(outbox.c.entry_id).where(
                *delivered, outbox.c.entry_id >= f"{ms}-", outbox.c.entry_id < f"{ms}."
            )
        ).scalars()
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
            )
        ).all()
    found = [_to_row(r, r.entry_id) for r in rows
             if r.entry_id == lowest_ok or entry_ids.greater(r.entry_id, after)]
    return sorted(found, key=lambda r: entry_ids.parse(r.entry_id))


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
    by the database's clock (:func:`_fence`)."""
    if entry_ids.parse(last_assigned(engine, partition))[0] < ID_PART_MAX:
        return None
    with translate_errors(), engine.begin() as conn:
        lease = _fence(conn, partition, node_id, epoch, ttl_ms)
        assert lease is not None
        last, batches, _ = lease
        if entry_ids.parse(last)[0] < ID_PART_MAX:
            return None
        kept = [b for b in batches if b.ms <= ID_PART_MAX]  # the others never landed
        delivered = conn.execute(select(outbox.c.entry_id).where(
            outbox.c.partition.between(partition, partition),
            outbox.c.delivered_at_ms.is_not(None), outbox.c.entry_id.is_not(None))).scalars()
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
                    outbox.c.entry_id.in_(list(ids[start : start + 500])))).scalars())
    return found


def raise_last_assigned(
    engine: Engine, partition: int, node_id: str, epoch: int, ttl_ms: int, top: str
) -> bool:
    """Raise the partition's last assigned entry id to ``top`` (never lower it), fenced by
    the lease (by the database's clock, :func:`_fence`); whether it changed. The next batch's
    ids then go above ``top``."""
    with translate_errors(), engine.begin() as conn:
        lease = _fence(conn, partition, node_id, epoch, ttl_ms)
        assert lease is not None
        last, batches, _ = lease
        if not entry_ids.greater(top, last):
            return False
        record(conn, partition, epoch, batches, top)
        return True


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


def forget_groups(engine: Engine, group: str, stream: str | None = None) -> int:
    """Forget ``group`` on every partition of ``stream`` (or of every stream): trims stop
    waiting for it if it is missing (``outbox groups forget``). Rows removed. A group still
    present is simply recorded again by the next trim."""
    g = stream_groups.c
    where = [g.group_name == group] + ([g.stream == stream] if stream is not None else [])
    with translate_errors(), engine.begin() as conn:
        return conn.execute(delete(stream_groups).where(*where)).rowcount or 0
