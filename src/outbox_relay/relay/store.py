"""The relay's take and settle transactions: take_batch(es), settle(_batches), record_unknown.

The relay's SQL (SQLAlchemy Core) is in five modules, each named for what it is for: this one
opens the transactions of the relay's steady state, :func:`take_batch` / :func:`take_batches`
and :func:`settle` / :func:`settle_batches` (marking rows delivered, behind a gap or refused),
:func:`record_unknown`, and :func:`sendable_elsewhere` (an ``--until-idle`` relay's probe of the
partitions it does not hold). :mod:`relay.leases` holds the partition leases and their fence,
which every take and settle runs first (:func:`relay.leases.fence`); :mod:`relay.outgoing` the
selection of the outgoing batch, run inside a transaction opened here once the lease is fenced;
:mod:`relay.stream_book` the known streams, their trim floors and groups; and
:mod:`relay.repair_store` the broker data-loss repair's queries.

Each public function runs one short transaction and returns plain data; none is ever held open
across a Redis call. On PostgreSQL a round's take and settle over several partitions send their
statements in psycopg's pipeline mode (:func:`_take_pipelined`, :func:`_settle_pipelined`): the
same statements in the same order, waited for a few times per transaction instead of three
times per partition. They go to psycopg directly, so SQLAlchemy's engine events do not see
them. Every write that depends on owning a partition re-checks the lease's owner
and fencing epoch in the same transaction, so a relay that lost its lease cannot mark anything.
The lease is fenced, and rows are marked, by the database's clock (:mod:`relay.leases`), never
a relay host's.
"""

from __future__ import annotations

import functools
import json
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
    cast,
    column,
    exists,
    func,
    literal,
    select,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Dialect

from outbox_relay.relay import leases, outgoing, stream_book
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
from outbox_relay.shared import psycopg_driver
from outbox_relay.shared.db import DriverStatement, db_now_ms, is_postgres, json_recordset
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.errors import LeaseLostError
from outbox_relay.shared.schema import (
    outbox,
)


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
    database's clock (:func:`relay.leases.fence`).
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
    others still commit. Lease rows are locked in partition order, as
    :func:`relay.leases.acquire_leases` locks them, so two relays' rounds cannot deadlock.
    """
    taken: dict[int, list[OutboxRow]] = {}
    lost: list[int] = []
    with translate_errors(), engine.begin() as conn:
        raw = psycopg_driver.pipelining_connection(conn) if is_postgres(conn) else None
        if raw is not None:
            return _take_pipelined(conn, raw, node_id, leases, batch_size, ttl_ms,
                                   waiting or {})
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


def _take_pipelined(
    conn: Connection, raw: Any, node_id: str, held: dict[int, int], batch_size: int,
    ttl_ms: int, waiting: dict[int, frozenset[str]],
) -> tuple[dict[int, list[OutboxRow]], list[int]]:
    """:func:`take_batches` on PostgreSQL with a few waits on the database whatever the
    number of partitions (psycopg's pipeline mode, as :func:`_settle_pipelined`): every
    partition's fence is sent, then read (one wait; the partitions whose idle skip returned
    nothing are asked whether the lease is still theirs, one more); every fresh take's first
    read is sent, then read (one wait); every record is sent, and the pipeline's end waits
    for them. A partition whose lease row records a batch (a retry, rare) is taken after
    the pipeline, one statement at a time (:func:`_retry_or_take`, as :func:`_take`).

    Statements, their order per partition and the locks they take are :func:`_take`'s
    (lease rows in partition order), and so is what comes back."""
    taken: dict[int, list[OutboxRow]] = {}
    lost: list[int] = []
    retries: list[tuple[int, str, list[Batch], int]] = []
    dialect = conn.dialect
    ordered = sorted(held)
    try:
        with psycopg_driver.pipeline(raw) as pipe:
            fence = leases.fence_statement(dialect, True)
            params = {p: leases.lease_params(p, node_id, held[p], ttl_ms) for p in ordered}
            cursors = [_send(raw, fence, params[p]) for p in ordered]
            pipe.sync()
            fenced: list[tuple[int, str, list[Batch], int]] = []
            idle: list[int] = []
            for p, cursor in zip(ordered, cursors, strict=True):
                found = cursor.fetchone()
                if found is None:
                    idle.append(p)
                    continue
                batches = load_batches(found[1])
                (retries if batches else fenced).append(
                    (p, str(found[0]), batches, int(found[2])))
            if idle:
                checks = [_send(raw, leases.held_statement(dialect), params[p]) for p in idle]
                pipe.sync()
                lost = [p for p, check in zip(idle, checks, strict=True)
                        if check.fetchone() is None]
            _take_fresh_pipelined(raw, pipe, dialect, held, fenced, batch_size, waiting,
                                  taken)
    except psycopg_driver.error_type() as err:
        raise psycopg_driver.translated(err) from err
    for p, last, batches, now in retries:  # pipeline mode is off: through SQLAlchemy
        rows = _retry_or_take(conn, p, held[p], batch_size, now, last, batches,
                              waiting.get(p, frozenset()))
        if rows:
            taken[p] = rows
    return taken, sorted(lost)


def _take_fresh_pipelined(
    raw: Any, pipe: Any, dialect: Dialect, held: dict[int, int],
    fenced: list[tuple[int, str, list[Batch], int]], batch_size: int,
    waiting: dict[int, frozenset[str]], taken: dict[int, list[OutboxRow]],
    fresh: set[int] | None = None,
) -> None:
    """:func:`relay.outgoing.take_fresh` (always recording) for each fenced ``(partition,
    last id, batches, now)`` (of those in ``fresh`` when given; the others' records are
    written as they are), pipelined: every first read sent, one wait, then the rest of each
    take (:func:`_read_on`) and its record, sent; ``taken`` gets what was taken."""
    reads: dict[int, tuple[outgoing.Reads, Any]] = {}
    if batch_size > 0:
        for p, _last, _batches, now in fenced:
            if fresh is not None and p not in fresh:
                continue
            gen = outgoing.sendable_reads(p, batch_size, now, None, (),
                                          waiting.get(p, frozenset()))
            left_behind, params = next(gen)
            reads[p] = (gen, _send(raw, outgoing.read_statement(dialect, left_behind), params))
        if reads:
            pipe.sync()
    record = outgoing.record_statement(dialect)
    for p, last, batches, now in fenced:
        rows: list[Any] = []
        runs: list[tuple[int, int]] = []
        if p in reads:
            rows, runs = _read_on(raw, pipe, dialect, *reads[p])
        batches, last, out = outgoing.new_batch(rows, runs, now, last, batches)
        _send(raw, record, outgoing.record_params(p, held[p], batches, last))
        if out:
            taken[p] = out


def _take(
    conn: Connection, partition: int, node_id: str, epoch: int, batch_size: int, ttl_ms: int,
    *, after_seq: int | None = None, inflight: Sequence[int] = (),
    waiting: frozenset[str] = frozenset(),
) -> list[OutboxRow]:
    """The body of :func:`take_batch`, in the caller's transaction."""
    if after_seq is not None:
        lease = leases.fence(conn, partition, node_id, epoch, ttl_ms)
        assert lease is not None
        last, batches, db_now = lease
        return take_fresh(conn, partition, epoch, batch_size, db_now, last, batches,
                          after_seq=after_seq, inflight=inflight, waiting=waiting)
    found = leases.fence(conn, partition, node_id, epoch, ttl_ms, idle_skip=True)
    if found is None:
        return []
    last, batches, db_now = found
    return _retry_or_take(conn, partition, epoch, batch_size, db_now, last, batches, waiting)


def _retry_or_take(
    conn: Connection, partition: int, epoch: int, batch_size: int, now: int, last: str,
    batches: list[Batch], waiting: frozenset[str],
) -> list[OutboxRow]:
    """A round's take of a fenced partition: the batches its lease row records come back
    under their recorded ids; when there are none (or their rows are gone), a fresh batch is
    taken and recorded."""
    if batches:
        rows = recorded_rows(conn, partition, batches, now)
        if rows:
            return rows
        batches = []  # their rows are gone: nothing left to retry
    return take_fresh(conn, partition, epoch, batch_size, now, last, batches,
                      force_write=True, waiting=waiting)


def _mark_delivered(
    conn: Connection, partition: int, pairs: list[tuple[int, str]], now: int
) -> None:
    """Mark ``(seq, entry_id)`` rows delivered under that id, in one statement
    (:func:`_mark_query`), at ``now`` (the relay passes the database's clock its fence read,
    the clock the retention prune compares ``delivered_at_ms`` with). Only still-undelivered
    rows change."""
    postgres = is_postgres(conn)
    prefix = _one_batch_prefix(pairs)
    if prefix is not None:
        seqs = [s for s, _ in pairs]
        _mark_seqs(conn.dialect).execute(conn, {
            "b_seqs": seqs if postgres else json.dumps(seqs), "b_prefix": prefix,
            "b_part": partition, "b_now": now})
        return
    if not postgres:
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
def _mark_seqs(dialect: Dialect) -> DriverStatement:
    """:func:`_mark_seqs_query` compiled once for the driver; on PostgreSQL the seqs are sent
    as one binary array (psycopg's text dumper formats each integer in Python)."""
    return DriverStatement(_mark_seqs_query(dialect.name == "postgresql"), dialect,
                           binary=("b_seqs",))


@functools.cache
def _mark_seqs_query(postgres: bool) -> Any:
    """The mark of one batch's rows (:func:`_one_batch_prefix`), built once per dialect:
    ``… SET entry_id = :b_prefix || seq … WHERE seq IN (<the batch's seqs>)``, the seqs as
    one bigint array (PostgreSQL, ``seq = ANY(:b_seqs)``) or one JSON array (SQLite,
    ``json_each``). It writes the same ids as :func:`_mark_query`'s join on the ``(seq,
    entry_id)`` pairs, but sends and parses 500 integers instead of 500 pairs: on SQLite
    2.2 ms instead of 2.8 ms per 500 rows (median of 30, CPU time), on PostgreSQL see
    bench/PERFORMANCE.md. A seq's text is Python's ``str`` of it (an integer)."""
    if postgres:
        in_batch = outbox.c.seq == func.any(bindparam("b_seqs", type_=ARRAY(BigInteger)))
    else:
        in_batch = outbox.c.seq.in_(
            select(func.json_each(bindparam("b_seqs")).table_valued("value").c.value))
    return (
        update(outbox)
        .where(*_undelivered(postgres), in_batch)
        .values(entry_id=bindparam("b_prefix", type_=String).concat(
                    cast(outbox.c.seq, String) if postgres else outbox.c.seq),
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
    they are made known (:func:`relay.stream_book.register_streams`) with the mark, so no
    delivered row's stream is ever unknown to repair checks and trims, whatever crashes.

    The lease is fenced and extended, and rows are marked delivered, by the database's clock
    (:func:`relay.leases.fence`), not the relay host's: hosts' clocks may differ by more than
    the TTL.
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
    engine: Engine, node_id: str, ttl_ms: int, outcomes: list[Settlement], *,
    take: frozenset[int] = frozenset(), batch_size: int = 0,
    waiting: dict[int, frozenset[str]] | None = None, also: dict[int, int] | None = None,
) -> tuple[list[int], dict[int, list[OutboxRow]]]:
    """:func:`settle` for several partitions' batches in **one** transaction; returns the
    partitions fenced out, whose rows stay as they were (their next owner retries the
    recorded batches under the same ids), and what was taken. Partition order, as in
    :func:`take_batches`.

    ``take``: partitions whose next batch (up to ``batch_size`` rows, none of the streams in
    ``waiting``) is taken in the same transaction, right after their settle, as
    :func:`take_batches` would take it in the next one: the rows committed while the round
    appended go out in the next round without a take transaction of their own (at a steady
    trickle, the round's time from commit to ``XADD`` is what bounds the latency). A
    partition that still has a recorded batch after its settle takes nothing here (its
    retry comes first, by :func:`take_batches`).

    ``also`` (``{partition: epoch}``, partitions not settled here): their next batch is taken
    in the same transaction too, as :func:`take_batches` takes a fresh one (fence, take,
    record; the lease rows of all of them locked in partition order). One that is idle,
    fenced out or has a recorded batch to retry takes nothing and is not reported (its own
    take, next round, sees to it)."""
    lost: list[int] = []
    taken: dict[int, list[OutboxRow]] = {}
    settling = {o.partition: o for o in outcomes}
    extra = {p: e for p, e in (also or {}).items()
             if p not in settling} if batch_size > 0 else {}
    with translate_errors(), engine.begin() as conn:
        raw = _pipelinable(conn, outcomes)
        if raw is not None:
            return _settle_pipelined(conn, raw, outcomes, node_id, ttl_ms, take=take,
                                     batch_size=batch_size, waiting=waiting or {},
                                     also=extra)
        for p in sorted([*settling, *extra]):  # lease rows locked in partition order
            wait_for = (waiting or {}).get(p, frozenset())
            if p in extra:
                rows = _take_also(conn, p, node_id, extra[p], batch_size, ttl_ms, wait_for)
            else:
                try:
                    rows = _settle(conn, settling[p], node_id, ttl_ms, take_next=p in take,
                                   batch_size=batch_size, waiting=wait_for)
                except LeaseLostError:  # the fence changed nothing: the others still commit
                    lost.append(p)
                    continue
            if rows:
                taken[p] = rows
    return lost, taken


def _take_also(
    conn: Connection, partition: int, node_id: str, epoch: int, batch_size: int, ttl_ms: int,
    waiting: frozenset[str],
) -> list[OutboxRow]:
    """A settle's take of a partition it does not settle (``also`` of
    :func:`settle_batches`): :func:`_take`'s fence and fresh take, and nothing when the
    partition is idle, fenced out, or has a recorded batch to retry (its own take does)."""
    found = leases.fence_statement(conn.dialect, True).execute(
        conn, leases.lease_params(partition, node_id, epoch, ttl_ms)).first()
    if found is None or load_batches(found[1]):  # idle or fenced out (not told apart)
        return []
    return take_fresh(conn, partition, epoch, batch_size, int(found[2]), str(found[0]), [],
                      force_write=True, waiting=waiting)


def _pipelinable(conn: Connection, outcomes: list[Settlement]) -> Any:
    """The psycopg connection under ``conn`` when the settle of ``outcomes`` can run
    pipelined (:func:`_settle_pipelined`): on PostgreSQL, every batch landed whole under
    one ``ms`` (the fused fence and mark, :func:`_fence_and_mark`), with no gap, no refused
    row and no new stream to register. Else None: the settle runs one statement at a time."""
    if not is_postgres(conn) or any(
        o.gaps or o.failed or o.register or _one_batch_prefix(o.delivered) is None
        for o in outcomes
    ):
        return None
    return psycopg_driver.pipelining_connection(conn)


def _settle_pipelined(
    conn: Connection, raw: Any, outcomes: list[Settlement], node_id: str, ttl_ms: int, *,
    take: frozenset[int], batch_size: int, waiting: dict[int, frozenset[str]],
    also: dict[int, int],
) -> tuple[list[int], dict[int, list[OutboxRow]]]:
    """:func:`settle_batches` of clean batches (:func:`_pipelinable`) with three waits on
    the database whatever the number of partitions, instead of three per partition.

    Why: at a steady trickle a round settles a few rows in each of several partitions, and
    the settle's one-at-a-time statements (fence and mark, the next take's read, the record,
    per partition) were most of the round, which a row committed meanwhile waits for twice
    (bench/PERFORMANCE.md, issue 24). Here, in psycopg's pipeline mode: every partition's
    fused fence and mark is sent, then read (one wait); every next take's first read is sent,
    then read (one wait; a take that must read further, behind held-back rows, reads on one
    read at a time); every record is sent, and the pipeline's end waits for them (one wait).

    The statements, their order per partition and the locks they take are those of
    :func:`_settle` (lease rows in partition order, each before its partition's rows), so
    what it guarantees is the same: a partition whose fence fails changes nothing and is
    returned as lost, the others commit; its next take's rows are chosen by
    :func:`relay.outgoing.sendable_reads` at the fence's clock and recorded before the
    commit. A database error raises here as SQLAlchemy's (the caller's
    :func:`translate_errors` judges it), and the transaction rolls back whole.

    The partitions of ``also`` (none of them settled here) are fenced by
    :func:`take_batches`'s fence (idle skip), sent among the fenced marks in partition order
    (the lease rows are still locked in that order), and taken fresh with the settled ones."""
    lost: list[int] = []
    taken: dict[int, list[OutboxRow]] = {}
    dialect = conn.dialect
    fenced_mark = _fenced_mark(dialect)
    take_fence = leases.fence_statement(dialect, True)
    ordered = sorted(outcomes, key=lambda o: o.partition)
    steps: list[tuple[int, Settlement | None]] = sorted(
        [(o.partition, o) for o in ordered] + [(p, None) for p in also],
        key=lambda step: step[0])
    try:
        with psycopg_driver.pipeline(raw) as pipe:
            cursors = []
            for p, o in steps:
                if o is None:
                    cursors.append(_send(raw, take_fence,
                                         leases.lease_params(p, node_id, also[p], ttl_ms)))
                    continue
                params = leases.lease_params(o.partition, node_id, o.epoch, ttl_ms)
                params.update(b_seqs=[s for s, _ in o.delivered],
                              b_prefix=_one_batch_prefix(o.delivered))
                cursors.append(_send(raw, fenced_mark, params))
            pipe.sync()
            fenced: list[tuple[int, str, list[Batch], int]] = []
            fresh: set[int] = set()
            for (p, o), cursor in zip(steps, cursors, strict=True):
                found = cursor.fetchone()
                if o is None:  # idle, fenced out or a batch to retry: its own take's
                    if found is not None and not load_batches(found[1]):
                        fenced.append((p, str(found[0]), [], int(found[2])))
                        fresh.add(p)
                    continue
                if found is None:  # fenced out: nothing of it was marked
                    lost.append(p)
                    continue
                through = max(s for s, _ in o.delivered)
                batches = [] if o.drop_recorded else [
                    b for b in load_batches(found[1]) if b.first_seq > through]
                fenced.append((p, str(found[0]), batches, int(found[2])))
                if p in take and not batches:
                    fresh.add(p)
            _take_fresh_pipelined(raw, pipe, dialect,
                                  {**also, **{o.partition: o.epoch for o in ordered}},
                                  fenced, batch_size, waiting, taken, fresh)
    except psycopg_driver.error_type() as err:
        raise psycopg_driver.translated(err) from err
    return lost, taken


def _send(raw: Any, statement: DriverStatement, params: dict[str, Any]) -> Any:
    """Send ``statement`` on the pipelined psycopg connection; its cursor (read it after a
    sync)."""
    cursor = raw.cursor()
    cursor.execute(statement.sql, {**statement.defaults, **params})
    return cursor


def _read_on(raw: Any, pipe: Any, dialect: Dialect, reads: outgoing.Reads,
             cursor: Any) -> tuple[list[Any], list[tuple[int, int]]]:
    """A take's reads from its first (already sent and synced, on ``cursor``) on: any
    further read is sent and waited for alone (rare: rows held back filled the first)."""
    rows = cursor.fetchall()
    try:
        while True:
            left_behind, params = reads.send(rows)
            cursor = _send(raw, outgoing.read_statement(dialect, left_behind), params)
            pipe.sync()
            rows = cursor.fetchall()
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _settle(
    conn: Connection, o: Settlement, node_id: str, ttl_ms: int, *,
    take_after: int | None = None, take_next: bool = False, batch_size: int = 0,
    inflight: Sequence[int] = (), waiting: frozenset[str] = frozenset(),
) -> list[OutboxRow]:
    """The body of :func:`settle`, in the caller's transaction. Rows are marked delivered (and
    streams registered) at the database's clock the fence returned: the relay has one clock.
    ``take_next`` (no ``take_after``): then take the partition's next batch from its lowest
    pending row, as a round's take does, unless a recorded batch is left to retry."""
    partition, epoch = o.partition, o.epoch
    fused = _fence_and_mark(conn, o, node_id, ttl_ms)
    if fused is not None:
        last, batches, db_now = fused
    else:
        lease = leases.fence(conn, partition, node_id, epoch, ttl_ms)
        assert lease is not None
        last, batches, db_now = lease
        if o.delivered:
            _mark_delivered(conn, partition, o.delivered, db_now)
    # A stream top behind a gap is never adopted here: one above ``last`` was not written by
    # the relay (the relay's repair check moves foreign entries away, or adopts a bare top
    # near the clock: relay/repair.py), and adopting it could take an id no stream can follow.
    if o.delivered and o.register:
        stream_book.register_in(conn, o.register, db_now)
    if o.gaps:
        conn.execute(_attempted(is_postgres(conn), gap=True),
                     {"b_part": partition, "b_seqs": o.gaps, "b_error": "ordering_gap"})
    if o.failed:
        conn.execute(_failed_query(is_postgres(conn)),
                     [{"b_part": partition, "b_seq": s, "b_error": c} for s, c in o.failed])
    through = max([s for s, _ in o.delivered] + o.gaps + [s for s, _ in o.failed], default=-1)
    batches = [] if o.drop_recorded else [b for b in batches if b.first_seq > through]
    if take_after is None:
        if take_next and not batches and batch_size > 0:
            return take_fresh(conn, partition, epoch, batch_size, db_now, last, [],
                              force_write=True, waiting=waiting)
        record(conn, partition, epoch, batches, last)
        return []
    return take_fresh(conn, partition, epoch, batch_size, db_now, last, batches,
                      after_seq=take_after, inflight=inflight, force_write=True,
                      waiting=waiting)


def _fence_and_mark(
    conn: Connection, o: Settlement, node_id: str, ttl_ms: int
) -> tuple[str, list[Batch], int] | None:
    """On PostgreSQL, the fence and the mark of one batch's rows (:func:`_one_batch_prefix`)
    in **one** statement (:func:`_fenced_mark`): what :func:`leases.fence` and
    :func:`_mark_delivered` do in two round trips. Returns what the fence returns; None when
    this settle is not of that form (SQLite, nothing delivered, ids of several batches): the
    caller then runs the two. Raises :class:`LeaseLostError` when fenced out, having changed
    nothing (the mark is gated on the fence's row)."""
    if not o.delivered or not is_postgres(conn):
        return None
    prefix = _one_batch_prefix(o.delivered)
    if prefix is None:
        return None
    params = leases.lease_params(o.partition, node_id, o.epoch, ttl_ms)
    params.update(b_seqs=[s for s, _ in o.delivered], b_prefix=prefix)
    found = _fenced_mark(conn.dialect).execute(conn, params).first()
    if found is None:
        raise LeaseLostError(f"partition {o.partition} is no longer ours (epoch {o.epoch})")
    return str(found[0]), load_batches(found[1]), int(found[2])


@functools.cache
def _fenced_mark(dialect: Dialect) -> DriverStatement:
    """``WITH fence AS (UPDATE <lease> … RETURNING …), marked AS (UPDATE <outbox> … WHERE
    EXISTS (SELECT FROM fence)) SELECT <fence's row>``, compiled once.

    Why one statement: on a two-core host the settle's short fence waited ~1.5 ms per batch
    (bench/profile.py relay --statements) for a CPU busy with Redis and the append thread, as
    long as the 500-row mark after it; sent together they wait once. What it guarantees is the
    two statements': the lease row is locked and tested first (the mark's one-time
    ``EXISTS`` reads the fence's output, so PostgreSQL runs the fence before scanning a row;
    locks are taken lease first, outbox after, as every take and settle does), rows are
    marked by the fence's database clock, and when the fence fails nothing is marked."""
    fence = leases.fence_cte()
    seqs = bindparam("b_seqs", type_=ARRAY(BigInteger))
    marked = (
        update(outbox)
        .where(*_undelivered(True), outbox.c.seq == func.any(seqs),
               exists(select(fence.c.now_ms)))
        .values(entry_id=bindparam("b_prefix", type_=String).concat(cast(outbox.c.seq, String)),
                delivered_at_ms=select(fence.c.now_ms).scalar_subquery(),
                attempts=outbox.c.attempts + 1, last_error=None)
        .cte("marked")
    )
    statement = select(fence.c.last_entry_id, fence.c.inflight, fence.c.now_ms).add_cte(marked)
    return DriverStatement(statement, dialect, binary=("b_seqs",))


@functools.cache
def _attempted(postgres: bool, *, gap: bool) -> Any:
    """Count an attempt on the undelivered rows ``b_seqs`` of partition ``b_part`` with error
    ``b_error``; a ``gap`` also forgets their entry ids (they go out again under new ones).
    Built once per dialect, like the relay's other per-batch statements
    (:func:`relay.leases._fence_query`); ``b_seqs`` expands to the list at execution."""
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
