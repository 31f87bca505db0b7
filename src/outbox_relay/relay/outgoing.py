"""The outgoing batch: which rows of a partition go out next, and under which ids (SQL).

The relay's SQL (SQLAlchemy Core) is in five modules. :mod:`relay.store` opens the take and
settle transactions (:func:`relay.store.take_batch`, settling: marking rows delivered or
failed, :func:`relay.store.record_unknown`), :mod:`relay.leases` holds the partition leases and
their fence, :mod:`relay.stream_book` the known streams and their trims, and
:mod:`relay.repair_store` the repair's queries. This module runs inside the transaction a take
or a settle opened, after the lease was fenced: it chooses a batch — the candidates in ``seq``
order, the hold-back of a row behind an earlier undelivered row of its aggregate
(:func:`sendable_reads`), the retry of a recorded batch under its recorded ids
(:func:`recorded_rows`) — and records it in the lease row as JSON (:class:`Batch`).
It opens no transaction and never re-checks the lease itself.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Integer,
    String,
    bindparam,
    cast,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect

from outbox_relay.relay import entry_ids
from outbox_relay.shared.db import DriverStatement
from outbox_relay.shared.schema import outbox, relay_leases


class OutboxRow(NamedTuple):
    """A taken row, with the entry id it must be appended under.

    A named tuple, not a frozen dataclass: a take builds one per row (500 a batch) on the
    relay's critical path, and a frozen dataclass's ``__init__`` (one ``object.__setattr__``
    per field) cost 1.67 µs a row against 0.39 (bench/PERFORMANCE.md, issue 24)."""

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
    retry: bool = False  # taken before (a batch the lease row still records): same id
    check_only: bool = False  # a retry that must not be appended, only found if it landed


@dataclass(frozen=True)
class Batch:
    """A taken, unsettled batch as its partition's lease row records it.

    Its rows are the partition's undelivered rows with ``first_seq <= seq <= last_seq``; each
    is appended under ``<ms>-<seq>``. Recording three numbers in the one lease row replaces
    writing an entry id on every taken row (a second index-rewriting update of the whole
    batch), and still lets any retry — this relay's or the next owner's — use the same ids.
    """

    first_seq: int
    last_seq: int
    ms: int


# The columns a take reads, in OutboxRow's field order (up to entry_id). A pending row has an
# entry_id only if an earlier version of the relay took it (ids were written per row then).
_CLAIMED = tuple(outbox.c[name] for name in OutboxRow._fields[:13])
_new_row: Callable[..., OutboxRow] = OutboxRow  # positional construction from those columns
# A new row of a take, built whole: ``tuple.__new__(OutboxRow, (<the 12 columns up to
# entry_id>, <its id>, *_FRESH))``, without the named tuple's ``__new__`` (a Python function
# taking each field as an argument): 0.33 µs a row instead of 0.68 (bench/PERFORMANCE.md,
# issue 24). ``_FRESH`` is every field after ``entry_id`` at its default.
_FRESH = tuple(OutboxRow._field_defaults[name] for name in OutboxRow._fields[13:])
_tuple_new = tuple.__new__


def load_batches(text: str) -> list[Batch]:
    """The batches a lease row records (its ``inflight`` column), oldest first."""
    return [Batch(*b) for b in json.loads(text or "[]")]


def _dump_batches(batches: list[Batch]) -> str:
    return json.dumps([[b.first_seq, b.last_seq, b.ms] for b in batches], separators=(",", ":"))


def sendable(
    partition: int | ColumnElement[int], now: int | ColumnElement[int], after_seq: int | None
) -> tuple[Any, ...]:
    """The sendable rows of a partition, in a form only the pending index serves in order.

    ``now`` is the database's clock (a value the transaction read once, or the expression);
    ``partition`` a value or a bound parameter (a statement built once).

    ``partition BETWEEN p AND p`` rather than ``partition = p``, with ``ORDER BY partition,
    seq`` (:data:`_IN_ORDER`): with an equality, PostgreSQL may walk the primary key in seq
    order and filter, expecting sendable rows to be spread evenly; they all come after the
    delivered ones, so that plan read every delivered row before finding a batch (250 ms per
    take over 400,000 rows, measured with ``EXPLAIN ANALYZE``; 30 ms with the partial index,
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


def first_sendable(pending: tuple[Any, ...]) -> Any:
    """The first sendable seq (a scalar subquery, NULL when none), found through the pending
    index: ``EXISTS`` would be planned as a scan that stops at the first match, which reads
    every delivered row before the first pending one."""
    return select(outbox.c.seq).where(*pending).order_by(*_IN_ORDER).limit(1).scalar_subquery()


def recorded_rows(
    conn: Connection, partition: int, batches: list[Batch], now: int
) -> list[OutboxRow]:
    """The undelivered rows of the recorded batches, in id order, under their recorded ids;
    those that must not overtake an earlier row are ``check_only`` (:func:`_overtakers`)."""
    in_batches = or_(*(outbox.c.seq.between(b.first_seq, b.last_seq) for b in batches))
    rows = conn.execute(
        select(*_CLAIMED)
        .where(
            outbox.c.partition.between(partition, partition),  # see sendable
            outbox.c.delivered_at_ms.is_(None),
            outbox.c.available_at_ms <= now,
            in_batches,
        )
        .order_by(*_IN_ORDER)
    ).all()
    out = []
    for r in rows:
        ms = next(b.ms for b in batches if b.first_seq <= r[0] <= b.last_seq)
        out.append(_new_row(*r[:12], r[12] or entry_ids.format_id(ms, r[0]), True))
    return _overtakers(conn, partition, _by_id(out), in_batches, now)


def _overtakers(
    conn: Connection, partition: int, rows: list[OutboxRow], in_batches: Any, now: int
) -> list[OutboxRow]:
    """Mark the retried rows that would overtake an earlier row of their aggregate
    ``check_only``, with every later row of their stream.

    A batch is recorded as seq ranges, and on PostgreSQL seq order is not commit order: a row
    whose transaction had not committed when the batch was taken can have a seq inside a
    recorded range. The take never saw it, so neither did its hold-back; the retry finds it in
    the range. When an earlier row of its aggregate is outside every range (it committed late
    too) or delayed, appending it under the recorded id would put it in the stream before that
    row, which is then taken under a newer id (a torture run found the chained stream's
    revision 132 ahead of 128 this way). Such a row is not appended: the append only looks
    whether it landed in an earlier attempt (the same id, the same event: then it is
    delivered), else it is ``not_appended``, the batch did not land whole, its record is
    dropped and the rows are taken again in seq order. The later rows of the stream follow it,
    as after any stop, so the stream stays a prefix of the batch.
    """
    keyed = [r for r in rows if r.aggregate_id is not None]
    if not keyed:
        return rows
    top = max(r.seq for r in keyed)
    earlier = conn.execute(
        select(outbox.c.stream, outbox.c.aggregate_type, outbox.c.aggregate_id,
               func.min(outbox.c.seq))
        .where(
            outbox.c.partition.between(partition, partition),  # see sendable
            outbox.c.delivered_at_ms.is_(None),
            outbox.c.seq < top,
            outbox.c.aggregate_id.in_(sorted({r.aggregate_id for r in keyed if r.aggregate_id})),
            or_(~in_batches, outbox.c.available_at_ms > now),
        )
        .group_by(outbox.c.stream, outbox.c.aggregate_type, outbox.c.aggregate_id)
    ).all()
    first_blocker = {(s, t, a): int(seq) for s, t, a, seq in earlier}
    if not first_blocker:
        return rows
    stopped: set[str] = set()
    out = []
    for r in rows:
        blocker = first_blocker.get((r.stream, r.aggregate_type, r.aggregate_id))
        if r.stream in stopped or (blocker is not None and blocker < r.seq):
            stopped.add(r.stream)
            r = r._replace(check_only=True)
        out.append(r)
    return out


def _by_id(rows: list[OutboxRow]) -> list[OutboxRow]:
    """Rows in entry id order: the order their ``XADD`` must follow.

    Only differs from seq order when a row carries an id an earlier version of the relay
    wrote when it took the row (ids were written per row then): those are below every
    batch id, so they go first, keeping the batch's ids increasing.
    """
    return sorted(rows, key=lambda r: entry_ids.parse(r.entry_id))


def take_fresh(
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
    waiting: frozenset[str] = frozenset(),
) -> list[OutboxRow]:
    """Select a new batch after the recorded ones and record it (one lease-row write).

    The record is the batch's runs of consecutive sendable rows, all under one ``ms``: a row
    held back splits a run, so a retry of the record (:func:`recorded_rows`) never includes it.
    Rows of the streams in ``waiting`` (backing off after a refusal, relay/refusals.py) are
    not taken and split runs the same way.
    """
    rows, runs = drive(
        sendable_reads(partition, batch_size, now, after_seq, inflight, waiting),
        lambda read: read_statement(conn.dialect, read[0]).rows(conn, read[1]),
    ) if batch_size > 0 else ([], [])
    new_batches, new_last, out = new_batch(rows, runs, now, last, batches)
    if rows or force_write:
        record(conn, partition, epoch, new_batches, new_last)
    return out


def new_batch(
    rows: list[Any], runs: list[tuple[int, int]], now: int, last: str, batches: list[Batch]
) -> tuple[list[Batch], str, list[OutboxRow]]:
    """What a take of ``rows`` (their ``runs``, :func:`sendable_reads`) records and returns:
    the lease row's batches and last assigned id afterwards, and the rows with their ids
    ``<ms>-<seq>``, ``ms`` above every id assigned before (``last``) by the database's clock
    ``now``. No rows: the batches and ``last`` as they were, nothing taken."""
    if not rows:
        return batches, last, []
    ms = entry_ids.batch_ms(last, now)  # the database's clock, as leases and trims
    batches = [*batches, *(Batch(first, end, ms) for first, end in runs)]
    new_last = entry_ids.format_id(ms, runs[-1][1])
    prefix = f"{ms}-"
    # Positional: the columns are selected in OutboxRow's field order.
    if all(r[12] is None for r in rows):  # no row carries an id an earlier version wrote
        return batches, new_last, [
            _tuple_new(OutboxRow, (*r[:12], prefix + str(r[0]), *_FRESH)) for r in rows]
    out = [_new_row(*r[:12], prefix + str(r[0])) if r[12] is None
           else _new_row(*r[:12], r[12], True) for r in rows]
    return batches, new_last, _by_id(out)


# How many times a take reads further when rows were held back. Each read is twice as long as
# the one before (blockers such as delayed rows fill a read's window), so 12 reads pass about
# 2,300,000 rows: a partition with thousands of scheduled rows at its head still relays what is
# ready behind them (the reads then cost time, never progress).
MAX_READS = 12
SLACK = 64  # rows a read returns beyond the candidates wanted, for the blockers among them


Read = tuple[bool, dict[str, Any]]
"""One read of a take: whether it is the ``left_behind`` form of :func:`_read_query`, and
its parameters."""
Reads = Generator[Read, Sequence[Any], tuple[list[Any], list[tuple[int, int]]]]


def drive(reads: Reads, run: Callable[[Read], Sequence[Any]]) -> tuple[
        list[Any], list[tuple[int, int]]]:
    """Run a take's reads (``run`` returns a read's rows) until it has its batch."""
    try:
        read = next(reads)
        while True:
            read = reads.send(run(read))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def sendable_reads(
    partition: int,
    limit: int,
    now: int,
    after_seq: int | None,
    inflight: Sequence[int],
    waiting: frozenset[str] = frozenset(),
) -> Reads:
    """Up to ``limit`` pending rows after ``after_seq`` that may go out now, and their runs:
    a generator that yields each read (:data:`Read`) and is sent its rows, so a caller may
    run the first reads of several partitions together (relay/store.py, the pipelined settle).

    **A row never overtakes an earlier row of its aggregate** (same stream and aggregate type
    and id): a candidate is held back while an undelivered row of its aggregate with a lower
    seq exists that is neither ahead of it in this batch nor in ``inflight`` (the batch being
    appended now, which goes out first and whose failure stops the chain). Such a **blocker**
    is a delayed row (``available_at_ms`` after the database's ``now``), a row at or below
    ``after_seq`` that committed after the chain passed its seq (on PostgreSQL seq order is
    not commit order) or a row whose append failed; a held row blocks its own later rows in
    turn. Rows without an aggregate id have no order to keep. Rows of a ``waiting`` stream
    are skipped whole (an aggregate's rows all share one stream). Returns the rows (seq order)
    and the ``(first seq, last seq)`` runs of consecutive taken candidates.
    """
    taken: list[Any] = []
    runs: list[tuple[int, int]] = []
    run: tuple[int, int] | None = None  # the open run: consecutive taken candidates
    blocked: set[tuple[Any, Any, Any]] = set()
    floor = after_seq if after_seq is not None else -1
    above = -1  # blockers are looked up among the rows after this seq
    for i in range(MAX_READS):
        n = (limit - len(taken) + SLACK) << i
        params: dict[str, Any] = {"b_part": partition, "b_now": now, "b_floor": floor,
                                  "b_above": above, "b_limit": n}
        left_behind = after_seq is not None and above < after_seq
        if left_behind:
            params.update(b_after=after_seq, b_inflight=json.dumps(list(inflight)))
        rows = yield left_behind, params
        for r in rows:
            key = (r[2], r[4], r[5])
            if waiting and r[2] in waiting:  # its stream backs off: not taken, splits the run
                if run is not None:
                    runs.append(run)
                    run = None
            elif r[0] <= floor or r[13] > now:  # a blocker (the query returns no other rows)
                blocked.add(key)
            elif r[5] is not None and key in blocked:  # held back
                if run is not None:
                    runs.append(run)
                    run = None
            else:
                taken.append(r)
                run = (r[0] if run is None else run[0], r[0])
                if len(taken) >= limit:
                    break
        if len(taken) >= limit or len(rows) < n:
            break
        above = rows[-1][0]  # read on; never take at or below after_seq (the batch in flight)
        floor = max(floor, above)
    if run is not None:
        runs.append(run)
    return taken, runs


@functools.cache
def _read_query(postgres: bool, left_behind: bool) -> Any:
    """One read of :func:`sendable_reads`, a statement built once (building it cost as
    much as running it): in seq order, up to ``b_limit`` rows after ``b_above`` that are
    either **candidates** (sendable: after ``b_floor`` and available) or **blockers** (with
    an aggregate id, and delayed or, with ``left_behind``, at or below ``b_after`` and not in
    the JSON array ``b_inflight``), each with its ``available_at_ms`` to tell them apart.

    One scan of the pending index ``(partition, seq) WHERE delivered_at_ms IS NULL`` in
    order (see :func:`sendable`), which stops after ``b_limit`` rows: it passes the batch in
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


def record(
    conn: Connection, partition: int, epoch: int, batches: list[Batch], last: str
) -> None:
    """Write the lease row's batch record and last assigned entry id (the caller fenced it)."""
    record_statement(conn.dialect).execute(conn, record_params(partition, epoch, batches, last))


def record_params(partition: int, epoch: int, batches: list[Batch], last: str) -> dict[str, Any]:
    """The parameters of :func:`record`'s statement (:func:`record_statement`)."""
    return {"b_part": partition, "b_epoch": epoch, "b_inflight": _dump_batches(batches),
            "b_last": last}


@functools.cache
def record_statement(dialect: Dialect) -> DriverStatement:
    """:func:`record`'s write compiled once for the driver (every take and settle runs it;
    the pipelined settle of relay/store.py sends it on psycopg's connection itself)."""
    return DriverStatement(_record_query(), dialect)


@functools.cache
def read_statement(dialect: Dialect, left_behind: bool) -> DriverStatement:
    """A read of :func:`sendable_reads` (:func:`_read_query`) compiled once for the driver:
    every take runs it (the pipelined settle of relay/store.py on psycopg's connection
    itself). Its rows read as the driver's tuples (:meth:`DriverStatement.rows`) cost the
    relay ~0.6 µs less each than SQLAlchemy's compiled-statement path read row by row
    (bench/PERFORMANCE.md, issue 24)."""
    return DriverStatement(_read_query(dialect.name == "postgresql", left_behind), dialect)


@functools.cache
def _record_query() -> Any:
    """The write of :func:`record`, a statement built once (every take and settle runs it;
    built per call, SQLAlchemy also recomputed its cache key each time)."""
    return (
        update(relay_leases)
        .where(relay_leases.c.partition == bindparam("b_part", type_=Integer),
               relay_leases.c.epoch == bindparam("b_epoch", type_=BigInteger))
        .values(inflight=bindparam("b_inflight", type_=String),
                last_entry_id=bindparam("b_last", type_=String))
    )
