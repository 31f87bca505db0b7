"""Every SQL statement of the relay: partition leases, claiming, marking (SQLAlchemy Core).

Each public function runs one short transaction and returns plain data; none is ever held open
across a Redis call. Every write that depends on owning a partition re-checks the lease's owner
and fencing epoch in the same transaction, so a relay that lost its lease cannot mark anything.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Engine,
    Integer,
    String,
    bindparam,
    cast,
    column,
    delete,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from relay import entry_ids
from shared.db import db_now_ms, is_postgres, json_recordset, now_ms, translate_errors
from shared.errors import LeaseLostError
from shared.schema import outbox, relay_leases, relay_nodes


@dataclass(frozen=True)
class OutboxRow:
    """A claimed row, with the entry id it must be appended under."""

    seq: int
    event_id: str
    stream: str
    partition: int
    aggregate_type: str | None
    aggregate_id: str | None
    revision: int | None
    type: str
    source: str
    payload: str
    headers: str
    created_at_ms: int
    entry_id: str
    retry: bool = False  # claimed before (a batch the lease row still records): same id


@dataclass(frozen=True)
class Batch:
    """A claimed, unsettled batch as its partition's lease row records it.

    Its rows are the partition's undelivered rows with ``first_seq <= seq <= last_seq``; each
    is appended under ``<ms>-<seq>``. Recording three numbers in the one lease row replaces
    writing an entry id on every claimed row (a second index-rewriting update of the whole
    batch), and still lets any retry — this relay's or the next owner's — use the same ids.
    """

    first_seq: int
    last_seq: int
    ms: int


# The columns a claim reads, in OutboxRow's field order (up to entry_id). A pending row has an
# entry_id only if an earlier version of the relay claimed it (ids were written per row then).
_CLAIMED = tuple(outbox.c[f.name] for f in fields(OutboxRow)[:13])
_new_row: Callable[..., OutboxRow] = OutboxRow  # positional construction from those columns


def _load_batches(text: str) -> list[Batch]:
    return [Batch(*b) for b in json.loads(text or "[]")]


def _dump_batches(batches: list[Batch]) -> str:
    return json.dumps([[b.first_seq, b.last_seq, b.ms] for b in batches], separators=(",", ":"))


def _upsert(conn: Connection) -> Any:
    return postgresql.insert if is_postgres(conn) else sqlite.insert


def acquire_leases(
    engine: Engine, node_id: str, partitions: int, ttl_ms: int, now: int
) -> dict[int, int]:
    """Heartbeat this node and take its fair share of partitions; return ``{partition: epoch}``.

    Fair share is ``ceil(partitions / live nodes)``. A node above its share releases the extra
    partitions; a node below it takes free or expired ones, bumping their epoch (the fence).
    """
    with translate_errors(), engine.begin() as conn:
        now = max(now, now_ms())  # the lock may have been waited for (SQLite)
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
    """Give our partitions back at shutdown so another relay need not wait for expiry."""
    with translate_errors(), engine.begin() as conn:
        for partition, epoch in leases.items():
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


def _ours(partition: int, node_id: str, epoch: int, now: int) -> tuple[Any, ...]:
    """The lease row of ``partition`` as long as this node holds it at ``epoch`` (the fence)."""
    return (
        relay_leases.c.partition == partition,
        relay_leases.c.owner == node_id,
        relay_leases.c.epoch == epoch,
        relay_leases.c.expires_at_ms > now,
    )


def _check_lease(
    conn: Connection, partition: int, node_id: str, epoch: int, now: int, ttl_ms: int
) -> None:
    result = conn.execute(
        update(relay_leases)
        .where(*_ours(partition, node_id, epoch, now))
        .values(expires_at_ms=now + ttl_ms)
    )
    if result.rowcount != 1:
        raise LeaseLostError(f"partition {partition} is no longer ours (epoch {epoch})")


def _fence(
    conn: Connection, partition: int, node_id: str, epoch: int, now: int, ttl_ms: int,
    *, pending: tuple[Any, ...] | None = None,
) -> tuple[str, list[Batch], int] | None:
    """Fence and extend our lease in one statement; the lease's last entry id and batches, and
    the database's clock (:func:`shared.db.db_now_ms`), the one "now" of the transaction that
    every availability test of it uses (a row that turns available between two statements
    must not be a claimable row to one and not a delayed one to the other).

    ``UPDATE … WHERE <lease is ours> [AND (<batches recorded> OR EXISTS (<pending row>))]
    RETURNING last_entry_id, inflight, <db now>``. With ``pending``, an idle partition's claim
    writes nothing (on SQLite, no WAL commit and fsync competing with producers for the write lock)
    and None comes back; the lease is still verified by a read (and extended by the relay's
    periodic :func:`acquire_leases`). Raises :class:`LeaseLostError` when fenced out.
    """
    stmt = update(relay_leases).where(*_ours(partition, node_id, epoch, now))
    if pending is not None:
        stmt = stmt.where(
            or_(relay_leases.c.inflight != "[]", _first_pending(pending).is_not(None))
        )
    found = conn.execute(
        stmt.values(expires_at_ms=now + ttl_ms)
        .returning(relay_leases.c.last_entry_id, relay_leases.c.inflight,
                   db_now_ms(is_postgres(conn)))
    ).first()
    if found is not None:
        return str(found[0]), _load_batches(found[1]), int(found[2])
    if pending is None or conn.execute(
        select(relay_leases.c.partition).where(*_ours(partition, node_id, epoch, now))
    ).first() is None:
        raise LeaseLostError(f"partition {partition} is no longer ours (epoch {epoch})")
    return None


def _pending(
    partition: int, now: int | ColumnElement[int], after_seq: int | None
) -> tuple[Any, ...]:
    """The claimable rows of a partition, in a form only the pending index serves in order.

    ``now`` is the database's clock (a value the transaction read once, or the expression).

    ``partition BETWEEN p AND p`` rather than ``partition = p``, with ``ORDER BY partition,
    seq`` (:data:`_IN_ORDER`): with an equality, PostgreSQL may walk the primary key in seq
    order and filter, expecting claimable rows to be spread evenly; they all come after the
    delivered ones, so that plan read every delivered row before finding a batch (250 ms per
    claim over 400,000 rows, measured with ``EXPLAIN ANALYZE``; 30 ms with the partial index,
    which only grows with its dead entries until VACUUM). A range keeps ``partition`` in the
    ordering, which only the partial index ``(partition, seq) WHERE delivered_at_ms IS NULL``
    provides.
    """
    return (
        outbox.c.partition.between(partition, partition),
        outbox.c.delivered_at_ms.is_(None),
        outbox.c.available_at_ms <= now,
        outbox.c.seq > (after_seq if after_seq is not None else -1),
    )


_IN_ORDER = (outbox.c.partition, outbox.c.seq)


def _first_pending(pending: tuple[Any, ...]) -> Any:
    """The first claimable seq (a scalar subquery, NULL when none), found through the pending
    index: ``EXISTS`` would be planned as a scan that stops at the first match, which reads
    every delivered row before the first pending one."""
    return select(outbox.c.seq).where(*pending).order_by(*_IN_ORDER).limit(1).scalar_subquery()


def _undelivered(conn: Connection, partition: int) -> tuple[Any, ...]:
    """A partition's undelivered rows, for a lookup by seq.

    On PostgreSQL with the partition named, so the lookup is an exact probe of the pending
    index (without it, PostgreSQL scanned that index whole per row). On SQLite without: a seq
    is the rowid, an exact probe already, and the partition term made SQLite drive the join
    from the pending index instead (a scan of the partition's pending rows per row).
    """
    if is_postgres(conn):
        return outbox.c.partition == partition, outbox.c.delivered_at_ms.is_(None)
    return (outbox.c.delivered_at_ms.is_(None),)


def claim(
    engine: Engine,
    partition: int,
    node_id: str,
    epoch: int,
    batch_size: int,
    ttl_ms: int,
    now: int,
    *,
    after_seq: int | None = None,
    inflight: Sequence[int] = (),
) -> list[OutboxRow]:
    """Claim the next rows of a partition in ``seq`` order, each with its entry id.

    Without ``after_seq`` (the start of a relay's round over the partition), batches the lease
    row still records — claimed by an attempt whose outcome is unknown, this relay's or a
    previous owner's — come back first, as they are, under their recorded ids
    (``retry=True``), so their retry cannot duplicate. Otherwise up to ``batch_size`` pending
    rows, from the lowest, are claimed as a new batch whose ids ``<ms>-<seq>`` use an ``ms``
    above every id assigned before (the lease row remembers the last one), and the batch is
    recorded on the lease row. ``after_seq`` skips rows up to that seq: the relay claims the
    next batch while the previous one (still undelivered, its seqs in ``inflight``) is being
    appended. A row is held back while an earlier undelivered row of its aggregate is neither
    in ``inflight`` nor ahead of it in the batch (:func:`_select_claimable`). Raises
    :class:`LeaseLostError` when fenced out.
    """
    with translate_errors(), engine.begin() as conn:
        now = max(now, now_ms())  # the lock may have been waited for (SQLite)
        if after_seq is not None:
            lease = _fence(conn, partition, node_id, epoch, now, ttl_ms)
            assert lease is not None
            last, batches, db_now = lease
            return _claim_fresh(conn, partition, epoch, batch_size, db_now, last, batches,
                                after_seq=after_seq, inflight=inflight)
        pending = _pending(partition, db_now_ms(is_postgres(conn)), None)
        found = _fence(conn, partition, node_id, epoch, now, ttl_ms, pending=pending)
        if found is None:
            return []
        last, batches, db_now = found
        if batches:
            rows = _recorded_rows(conn, partition, batches, db_now)
            if rows:
                return rows
            batches = []  # their rows are gone: nothing left to retry
        return _claim_fresh(conn, partition, epoch, batch_size, db_now, last, batches,
                            force_write=True)


def _recorded_rows(
    conn: Connection, partition: int, batches: list[Batch], now: int
) -> list[OutboxRow]:
    """The undelivered rows of the recorded batches, in id order, under their recorded ids."""
    rows = conn.execute(
        select(*_CLAIMED)
        .where(
            outbox.c.partition.between(partition, partition),  # see _pending
            outbox.c.delivered_at_ms.is_(None),
            outbox.c.available_at_ms <= now,
            or_(*(outbox.c.seq.between(b.first_seq, b.last_seq) for b in batches)),
        )
        .order_by(*_IN_ORDER)
    ).all()
    out = []
    for r in rows:
        ms = next(b.ms for b in batches if b.first_seq <= r[0] <= b.last_seq)
        out.append(_new_row(*r[:12], r[12] or entry_ids.format_id(ms, r[0]), True))
    return _by_id(out)


def _by_id(rows: list[OutboxRow]) -> list[OutboxRow]:
    """Rows in entry id order: the order their ``XADD`` must follow.

    Only differs from seq order when a row carries an id an earlier version of the relay
    wrote when it claimed the row (ids were written per row then): those are below every
    batch id, so they go first, keeping the batch's ids increasing.
    """
    return sorted(rows, key=lambda r: entry_ids.parse(r.entry_id))


def _claim_fresh(
    conn: Connection,
    partition: int,
    epoch: int,
    batch_size: int,
    now: int,
    last: str,
    batches: list[Batch],
    *,
    after_seq: int | None = None,
    inflight: Sequence[int] = (),
    force_write: bool = False,
) -> list[OutboxRow]:
    """Select a new batch after the recorded ones and record it (one lease-row write).

    The record is the batch's runs of consecutive claimable rows, all under one ``ms``: a row
    held back splits a run, so a retry of the record (:func:`_recorded_rows`) never includes it.
    """
    rows, runs = (
        _select_claimable(conn, partition, batch_size, now, after_seq, inflight)
        if batch_size > 0 else ([], [])
    )
    new_last = last
    if rows:
        ms = entry_ids.batch_ms(last, now_ms())
        batches = [*batches, *(Batch(first, end, ms) for first, end in runs)]
        new_last = entry_ids.format_id(ms, runs[-1][1])
    if rows or force_write:
        _record(conn, partition, epoch, batches, new_last)
    if not rows:
        return []
    ms = batches[-1].ms
    out, legacy = [], False
    for r in rows:  # positional: the columns are selected in OutboxRow's field order
        if r[12] is None:
            out.append(_new_row(*r[:12], f"{ms}-{r[0]}"))
        else:
            legacy = True
            out.append(_new_row(*r[:12], r[12], True))
    return _by_id(out) if legacy else out


# How many times a claim reads further when rows were held back (each read up to the rows
# still missing): bounds the work when many rows wait behind one delayed or failed row.
MAX_READS = 8
SLACK = 64  # rows a read returns beyond the candidates wanted, for the blockers among them


def _select_claimable(
    conn: Connection,
    partition: int,
    limit: int,
    now: int,
    after_seq: int | None,
    inflight: Sequence[int],
) -> tuple[list[Any], list[tuple[int, int]]]:
    """Up to ``limit`` pending rows after ``after_seq`` that may go out now, and their runs.

    **A row never overtakes an earlier row of its aggregate** (same stream and aggregate type
    and id): a candidate is held back while an undelivered row of its aggregate with a lower
    seq exists that is neither ahead of it in this batch nor in ``inflight`` (the batch being
    appended now, which goes out first and whose failure stops the chain). Such a **blocker**
    is a delayed row (``available_at_ms`` after the database's ``now``), a row at or below
    ``after_seq`` that committed after the chain passed its seq (on PostgreSQL seq order is
    not commit order) or a row whose append failed; a held row blocks its own later rows in
    turn. Rows without an aggregate id have no order to keep. Returns the rows (seq order)
    and the ``(first seq, last seq)`` runs of consecutive claimed candidates.
    """
    claimed: list[Any] = []
    runs: list[tuple[int, int]] = []
    run: tuple[int, int] | None = None  # the open run: consecutive claimed candidates
    blocked: set[tuple[Any, Any, Any]] = set()
    floor = after_seq if after_seq is not None else -1
    above = -1  # blockers are looked up among the rows after this seq
    postgres = is_postgres(conn)
    for _ in range(MAX_READS):
        n = limit - len(claimed) + SLACK
        params: dict[str, Any] = {"b_part": partition, "b_now": now, "b_floor": floor,
                                  "b_above": above, "b_limit": n}
        left_behind = after_seq is not None and above < after_seq
        if left_behind:
            params.update(b_after=after_seq, b_inflight=json.dumps(list(inflight)))
        rows = conn.execute(_read_query(postgres, left_behind), params).all()
        for r in rows:
            key = (r[2], r[4], r[5])
            if r[0] <= floor or r[13] > now:  # a blocker (the query returns no other rows)
                blocked.add(key)
            elif r[5] is not None and key in blocked:  # held back
                if run is not None:
                    runs.append(run)
                    run = None
            else:
                claimed.append(r)
                run = (r[0] if run is None else run[0], r[0])
                if len(claimed) >= limit:
                    break
        if len(claimed) >= limit or len(rows) < n:
            break
        above = rows[-1][0]  # read on; never claim at or below after_seq (the batch in flight)
        floor = max(floor, above)
    if run is not None:
        runs.append(run)
    return claimed, runs


@functools.cache
def _read_query(postgres: bool, left_behind: bool) -> Any:
    """One read of :func:`_select_claimable`, a statement built once (building it cost as
    much as running it): in seq order, up to ``b_limit`` rows after ``b_above`` that are
    either **candidates** (claimable: after ``b_floor`` and available) or **blockers** (with
    an aggregate id, and delayed or, with ``left_behind``, at or below ``b_after`` and not in
    the JSON array ``b_inflight``), each with its ``available_at_ms`` to tell them apart.

    One scan of the pending index ``(partition, seq) WHERE delivered_at_ms IS NULL`` in
    order (see :func:`_pending`), which stops after ``b_limit`` rows: it passes the batch in
    flight (never returned) and every other pending row once.
    """
    part, now = bindparam("b_part", type_=Integer), bindparam("b_now", type_=BigInteger)
    candidate = (outbox.c.seq > bindparam("b_floor", type_=BigInteger)) & (
        outbox.c.available_at_ms <= now)
    blocking: Any = outbox.c.available_at_ms > now
    if left_behind:
        after = bindparam("b_after", type_=BigInteger)
        blocking = or_(blocking, (outbox.c.seq <= after) & outbox.c.seq.not_in(
            _json_seqs(postgres)))
    return (
        select(*_CLAIMED, outbox.c.available_at_ms)
        .where(
            outbox.c.partition.between(part, part),
            outbox.c.delivered_at_ms.is_(None),
            outbox.c.seq > bindparam("b_above", type_=BigInteger),
            or_(candidate, outbox.c.aggregate_id.is_not(None) & blocking),
        )
        .order_by(*_IN_ORDER)
        .limit(bindparam("b_limit", type_=Integer))
    )


def _json_seqs(postgres: bool) -> Any:
    """``SELECT`` the seqs of the JSON array parameter ``b_inflight`` (one constant statement
    whatever their number)."""
    if postgres:
        given = cast(bindparam("b_inflight", type_=String), postgresql.JSON)
        values = func.json_array_elements_text(given).table_valued("value")
        return select(cast(values.c.value, BigInteger))
    values = func.json_each(bindparam("b_inflight")).table_valued("value")
    return select(values.c.value)


def _record(
    conn: Connection, partition: int, epoch: int, batches: list[Batch], last: str
) -> None:
    conn.execute(
        update(relay_leases)
        .where(relay_leases.c.partition == partition, relay_leases.c.epoch == epoch)
        .values(inflight=_dump_batches(batches), last_entry_id=last)
    )


def _mark_delivered(
    conn: Connection, partition: int, pairs: list[tuple[int, str]], now: int
) -> None:
    """Mark ``(seq, entry_id)`` rows delivered under that id, in one statement.

    Constant SQL, so it is compiled once whatever the batch size (a row-by-row executemany
    cost more than the rest of the settle): PostgreSQL joins ``json_to_recordset(:pairs)``
    (:func:`shared.db.json_recordset`), SQLite ``json_each(:pairs)``. Only still-undelivered
    rows change.
    """
    done = {"delivered_at_ms": now, "attempts": outbox.c.attempts + 1, "last_error": None}
    if not is_postgres(conn):
        pairs_json = func.json_each(bindparam("b_pairs")).table_valued("value", name="given")
        seq = func.json_extract(pairs_json.c.value, "$[0]")
        entry_id = func.json_extract(pairs_json.c.value, "$[1]")
        conn.execute(
            update(outbox)
            .where(*_undelivered(conn, partition), outbox.c.seq == seq)
            .values(entry_id=entry_id, **done),
            {"b_pairs": json.dumps(pairs)},
        )
        return
    given = json_recordset("b_pairs", column("seq", BigInteger), column("entry_id", String))
    conn.execute(
        update(outbox)
        .where(*_undelivered(conn, partition), outbox.c.seq == given.c.seq)
        .values(entry_id=given.c.entry_id, **done),
        {"b_pairs": [{"seq": s, "entry_id": e} for s, e in pairs]},
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
    now: int,
    *,
    delivered: list[tuple[int, str]],
    gaps: list[int],
    failed: list[tuple[int, str]],
    stream_top: str | None = None,
    claim_after: int | None = None,
    batch_size: int = 0,
    inflight: Sequence[int] = (),
    drop_recorded: bool = False,
) -> list[OutboxRow]:
    """Record what Redis said, in one transaction, only while our epoch is current.

    ``delivered``: ``(seq, entry_id)`` Redis holds; they are marked under that id. ``gaps``:
    rows whose id fell behind the stream's top without being there, and ``failed``:
    ``(seq, error code)`` Redis refused; both stay pending and are claimed again in a later
    batch, under new ids above every id so far (``stream_top``, the stream's last generated
    id behind a gap, raises that floor). The settled batch's record leaves the lease row.

    With ``claim_after``, the same transaction also claims the next batch after that seq (as
    :func:`claim` does, ``inflight`` being the seqs of the batch appended meanwhile) and
    returns it: the relay's steady state is one transaction per batch. ``drop_recorded``
    forgets every recorded batch: the relay does so when a batch did not land whole, with the
    next batch claimed but never appended (its ids were never used; its rows, like the ones
    left behind, are claimed again in seq order under new ids).
    """
    settled = [s for s, _ in delivered] + gaps + [s for s, _ in failed]
    with translate_errors(), engine.begin() as conn:
        now = max(now, now_ms())  # the lock may have been waited for (SQLite)
        lease = _fence(conn, partition, node_id, epoch, now, ttl_ms)
        assert lease is not None
        last, batches, db_now = lease
        if stream_top is not None and entry_ids.greater(stream_top, last):
            last = stream_top
        if delivered:
            _mark_delivered(conn, partition, delivered, now)
        if gaps:
            conn.execute(
                update(outbox)
                .where(*_undelivered(conn, partition), outbox.c.seq.in_(gaps))
                .values(entry_id=None, attempts=outbox.c.attempts + 1, last_error="ordering_gap")
            )
        if failed:
            conn.execute(
                update(outbox)
                .where(*_undelivered(conn, partition), outbox.c.seq == bindparam("b_seq"))
                .values(attempts=outbox.c.attempts + 1, last_error=bindparam("b_error")),
                [{"b_seq": s, "b_error": c} for s, c in failed],
            )
        through = max(settled, default=-1)
        batches = [] if drop_recorded else [b for b in batches if b.first_seq > through]
        if claim_after is None:
            _record(conn, partition, epoch, batches, last)
            return []
        return _claim_fresh(conn, partition, epoch, batch_size, db_now, last, batches,
                            after_seq=claim_after, inflight=inflight, force_write=True)


def record_unknown(engine: Engine, partition: int, seqs: list[int], code: str) -> None:
    """Note an attempt whose outcome Redis never told us (the rows keep their entry ids)."""
    with translate_errors(), engine.begin() as conn:
        conn.execute(
            update(outbox)
            .where(*_undelivered(conn, partition), outbox.c.seq.in_(seqs))
            .values(attempts=outbox.c.attempts + 1, last_error=code)
        )


# --- Broker data-loss repair (relay/repair.py): read-only queries plus lease helpers. ---
# Entry ids are "<13-digit ms>-<seq>": their text sorts like the numbers except within one
# millisecond, so SQL narrows by text and Python finishes with entry_ids.parse.


def delivered_counts(engine: Engine, partitions: list[int]) -> dict[tuple[str, int], int]:
    """``{(stream, partition): delivered rows}`` for the given partitions (one grouped scan)."""
    if not partitions:
        return {}
    with translate_errors(), engine.connect() as conn:
        rows = conn.execute(
            select(outbox.c.stream, outbox.c.partition, func.count())
            .where(outbox.c.partition.in_(partitions), outbox.c.delivered_at_ms.is_not(None))
            .group_by(outbox.c.stream, outbox.c.partition)
        ).all()
    return {(stream, partition): int(n) for stream, partition, n in rows}


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
    """Delivered rows of ``(stream, partition)`` with an entry id greater than ``after``, in
    entry id order: what a refill appends, under the ids the stream first had them."""
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
    found = [_to_row(r, r.entry_id) for r in rows if entry_ids.greater(r.entry_id, after)]
    return sorted(found, key=lambda r: entry_ids.parse(r.entry_id))


def renew_lease(
    engine: Engine, partition: int, node_id: str, epoch: int, ttl_ms: int, now: int
) -> None:
    """Prove (and extend) that we still own ``partition`` at ``epoch``; else LeaseLostError."""
    with translate_errors(), engine.begin() as conn:
        _check_lease(conn, partition, node_id, epoch, now, ttl_ms)


def take_free_lease(
    engine: Engine, partition: int, node_id: str, ttl_ms: int, now: int
) -> int | None:
    """Take ``partition`` if no live relay holds it (bumping the epoch); its epoch, or None.

    For one-off tools (``outbox reconcile``): a live relay's partition is left alone.
    """
    with translate_errors(), engine.begin() as conn:
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
