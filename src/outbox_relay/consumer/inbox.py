"""The consumer's claim transaction (inbox, heads, handlers): its lookups and decisions.

One transaction per batch. On PostgreSQL it first takes transaction-scoped advisory locks on
the batch's aggregates (sorted, so two consumers cannot deadlock), which serializes any two
claims that touch the same aggregate: the duplicate and order checks below then read settled
rows. SQLite's ``BEGIN IMMEDIATE`` already serializes whole transactions.

The claim, in one transaction: fence check -> (PostgreSQL) advisory locks -> one lookup
(receipts with their fingerprints, heads, trim floors, the batch's durable retry rows) ->
decide each delivery and run the handlers -> write receipts (with fingerprints), heads and
retry rows (upserted for a ``failed`` event with its next attempt time; deleted once it is
settled) -> commit. Every SQL statement of the claim is here but its writes, which are in
:mod:`consumer.claim_writes`. The decisions (duplicates and conflicts, order per aggregate,
retries, whose fault an error is) are made by :mod:`consumer.ordering`, whose outcome
vocabulary this module re-exports: ``inbox.APPLIED``, ``inbox.Delivery``, ``inbox.claim`` are
what the daemon and dead-letter replay use.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Integer,
    String,
    bindparam,
    cast,
    func,
    literal,
    select,
    true,
    tuple_,
    union_all,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import Select

from outbox_relay.consumer import async_handlers, claim_writes
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.consumer.ordering import (
    APPLIED,
    CONFLICTING_DUPLICATE,
    DEAD,
    DUPLICATE,
    FAILED,
    OUT_OF_ORDER,
    RESURRECTED,
    SUPERSEDED,
    WAITING,
    AggregateKey,
    Delivery,
    HandlerFailure,
    Ledger,
    Outcome,
    Receipt,
    RedoClaim,
    RetryState,
    aggregate_key,
    decide_batch,
)
from outbox_relay.consumer.prune import entry_key, partition_of
from outbox_relay.consumer.retry import REJECTED, RETRY_HORIZON, PermanentError, Retry
from outbox_relay.shared.db import DriverStatement, is_postgres, now_ms
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.schema import consumer_retries, inbox, inbox_heads, stream_trims

__all__ = [
    "APPLIED", "CONFLICTING_DUPLICATE", "DEAD", "DUPLICATE", "FAILED", "OUT_OF_ORDER",
    "REJECTED", "RESURRECTED", "RETRY_HORIZON", "SUPERSEDED", "WAITING",
    "AggregateKey", "Delivery", "Outcome", "PermanentError", "Retry", "aggregate_key", "claim",
    "next_attempt_ms", "retrying",
]


def _lock_key(group: str, d: Delivery) -> int:
    head = aggregate_key(d.event)
    raw = "\0".join((group, *head)) if head else f"{group}\0event\0{d.event.id}"
    return int.from_bytes(hashlib.blake2b(raw.encode(), digest_size=8).digest(), "big", signed=True)


def claim(
    engine: Engine,
    group: str,
    batch: list[Delivery],
    handlers: Handlers,
    *,
    blocked: set[AggregateKey] | None = None,
    check: Callable[[Connection], None] | None = None,
    retry: Retry | None = None,
    now: int | None = None,
) -> list[Outcome]:
    """Claim a batch durably; return one outcome per delivery, in order.

    Guarantees, in one transaction (first ``check(conn)``, the caller's fence: if it raises,
    nothing is decided): see the module docstring for the order of the decisions. An applied
    event's receipt and its handler's writes commit together; a failing handler's writes roll
    back alone and the entry is ``failed`` (no receipt: it is retried). ``blocked`` holds the
    strict aggregates with an earlier entry failing or waiting; after the commit, the key of
    every strict delivery that ended ``failed`` or ``waiting`` is added to it. ``retry``: the
    group's default policy (handlers registered without one); ``now``: the claim's clock in
    epoch ms (default the host's), which retry rows are written and compared with.
    :func:`next_attempt_ms` of the outcomes says when the batch's earliest retry is due.

    Errors: only a lost connection (or SQLite's ``database is locked``, contention) fails the
    whole claim (``UnavailableError``: retried); any other error raised in a handler, a bad
    statement or a statement timeout included, is that handler's failure.

    Optimistic path: the batch's handlers run with no savepoint at all (a savepoint per
    handler cost two round trips per event, most of a claim's time; one for the batch still
    two per claim). What comes before them (the fence with its lease extension, the locks, the
    lookup) is done again by a new transaction, so if a handler raises, the whole transaction
    rolls back, callbacks scheduled with
    ``Handlers.after_commit`` are dropped, and the batch is claimed again in a new transaction
    (fence, locks and lookup read again) with a savepoint per handler; the entry whose handler
    raised is ``failed`` without running again (and blocks its later strict deliveries, as on
    the per-handler path). So the outcomes are those of the per-handler path.
    Consequence for handler authors: a handler that ran *before* a failing neighbour in its
    batch runs twice in that claim; only the second run's writes commit. Effects outside
    ``conn`` belong in ``after_commit`` (delivery is at least once anyway).
    """
    if not batch:
        return []
    args = (group, batch, handlers, set(blocked or ()), check, retry, now)
    with translate_errors():
        try:
            outcomes, ledger = _in_transaction(engine, handlers, args, None)
            failure = None
        except RedoClaim as redo:  # rolled back; claimed again outside this block
            failure = redo.failure
        if failure is not None:
            outcomes, ledger = _in_transaction(engine, handlers, args, failure)
    if blocked is not None:
        blocked |= ledger.blocked
    return outcomes


def _in_transaction(
    engine: Engine, handlers: Handlers, args: tuple[Any, ...], failure: HandlerFailure | None,
) -> tuple[list[Outcome], Ledger]:
    """:func:`_claim_in` in a transaction of its own, on the async engine when a handler is
    async (consumer/async_handlers: the same claim)."""
    if handlers.has_async:
        return async_handlers.run_in_transaction(engine, _claim_in, *args, failure=failure)
    with engine.begin() as conn:
        return _claim_in(conn, *args, failure=failure)


def _claim_in(
    conn: Connection, group: str, batch: list[Delivery], handlers: Handlers,
    blocked: set[AggregateKey], check: Callable[[Connection], None] | None,
    retry: Retry | None, now: int | None, *, failure: HandlerFailure | None = None,
) -> tuple[list[Outcome], Ledger]:
    """The body of :func:`claim`, in the transaction of ``conn``: what comes before the
    handlers is done again by a claim done again (so the optimistic path needs no savepoint);
    ``failure``: the optimistic attempt's, in the claim done again."""
    if check is not None:
        check(conn)
    if is_postgres(conn):
        _locks(conn.dialect).execute(
            conn, {"b_keys": sorted({_lock_key(group, d) for d in batch})})
    seen, heads, below, retries = _lookup(conn, group, batch)
    ledger = Ledger(seen, heads, set(blocked), below, retries,
                    now_ms() if now is None else now)
    return decide_batch(
        conn, batch, ledger, handlers, group, retry, savepoint=False, failure=failure,
        then=lambda outcomes, decided, in_flight: claim_writes.write(
            conn, group, outcomes, decided, in_flight=in_flight))


def next_attempt_ms(outcomes: Iterable[Outcome]) -> int | None:
    """The earliest durable next attempt (epoch ms) among ``failed`` and not-yet-due
    ``waiting`` outcomes; None when none of them retries. The daemon schedules its next
    pending pass then, not at a fixed interval."""
    times = [o.retry_at_ms for o in outcomes if o.retry_at_ms is not None]
    return min(times) if times else None


def _receipt(outcome: str, reason: str | None, fingerprint: str | None) -> Receipt:
    return Receipt((reason or DEAD) if outcome == DEAD else None, fingerprint)


def _existing(conn: Connection, group: str, event_ids: list[str]) -> dict[str, Receipt]:
    """The group's receipts among ``event_ids`` (SQLite; PostgreSQL reads them in
    :func:`_lookup_query`)."""
    rows = conn.execute(select(inbox.c.event_id, inbox.c.outcome, inbox.c.reason,
                               inbox.c.fingerprint).where(
        inbox.c.group_name == group, inbox.c.event_id.in_(set(event_ids))))
    return {i: _receipt(outcome, reason, fp) for i, outcome, reason, fp in rows}


def _retries(conn: Connection, group: str, event_ids: list[str]) -> dict[str, RetryState]:
    """The durable retry rows among ``event_ids`` (SQLite; PostgreSQL: :func:`_lookup_query`)."""
    r = consumer_retries.c
    rows = conn.execute(select(r.event_id, r.attempts, r.first_failed_at_ms,
                               r.next_attempt_at_ms).where(
        r.group_name == group, r.event_id.in_(set(event_ids))))
    return {i: RetryState(n, first, nxt) for i, n, first, nxt in rows}


def _lookup(
    conn: Connection, group: str, batch: list[Delivery]
) -> tuple[dict[str, Receipt], dict[AggregateKey, int], frozenset[str], dict[str, RetryState]]:
    """What the claim decides from: the group's receipts among the batch's events
    (:func:`_existing`), the applied revisions of its aggregates (:func:`_heads`), the
    deliveries without a receipt below their stream's trim floor (``resurrected``), and the
    batch's durable retry rows (:func:`_retries`).

    On PostgreSQL one statement (:func:`_lookup_query`), where three round trips were most of
    a small claim's waiting. One statement reads one snapshot, and that is what the floor
    check needs: a receipt is pruned only below the floor its pruner read (committed before
    the prune), and floors only rise, so a receipt missing from this snapshot because it was
    pruned has its floor in it. An inbox in another database than the outbox has no floors:
    nothing is below, and its receipts are never pruned by floor (consumer/prune.py).
    """
    aggregates = {k for d in batch if (k := aggregate_key(d.event))}
    wanted: dict[tuple[str, int], list[Delivery]] = {}
    for d in batch:
        partition = partition_of(d.key)
        if partition is not None and not d.replay:
            wanted.setdefault(partition, []).append(d)
    if not is_postgres(conn):
        event_ids = [d.event.id for d in batch]
        found = _existing(conn, group, event_ids)
        trims = _floors(conn, wanted) if wanted else {}
        return (found, _heads(conn, group, aggregates), _below(wanted, trims, found),
                _retries(conn, group, event_ids))
    types, ids = zip(*sorted(aggregates), strict=True) if aggregates else ((), ())
    streams, parts = zip(*sorted(wanted), strict=True) if wanted else ((), ())
    params = {"b_group": group, "b_ids": sorted({d.event.id for d in batch}),
              "b_types": list(types), "b_aids": list(ids), "b_streams": list(streams),
              "b_parts": list(parts)}
    seen: dict[str, Receipt] = {}
    heads: dict[AggregateKey, int] = {}
    floors: dict[tuple[str, int], str] = {}
    retries: dict[str, RetryState] = {}
    for kind, a, b, c, fp, n in _lookup_statement(conn.dialect).execute(conn, params):
        if kind == "r":
            seen[a] = _receipt(b, c, fp)
        elif kind == "h":
            heads[(a, b)] = n
        elif kind == "x":
            retries[a] = RetryState(int(b), int(c), n)
        else:
            floors[(a, int(b))] = c
    return seen, heads, _below(wanted, floors, seen), retries


def _below(
    wanted: dict[tuple[str, int], list[Delivery]], floors: dict[tuple[str, int], str],
    seen: dict[str, Receipt],
) -> frozenset[str]:
    """The event ids of deliveries without a receipt whose entry id is below their stream's
    trim floor: ``resurrected``, never applied again."""
    below: set[str] = set()
    for pair, floor_id in floors.items():
        floor = entry_key(floor_id)
        if floor is None:
            continue
        below.update(d.event.id for d in wanted.get(pair, ()) if d.event.id not in seen
                     and (entry := entry_key(d.entry_id)) is not None and entry < floor)
    return frozenset(below)


def _floors(
    conn: Connection, wanted: dict[tuple[str, int], list[Delivery]]
) -> dict[tuple[str, int], str]:
    """The trim floors of the batch's partition streams (SQLite; read after the receipts, in
    the same transaction, for the reason :func:`_lookup` gives)."""
    pair = tuple_(stream_trims.c.stream, stream_trims.c.partition)
    rows = conn.execute(select(stream_trims.c.stream, stream_trims.c.partition,
                               stream_trims.c.floor_entry_id).where(pair.in_(list(wanted))))
    return {(stream, partition): floor for stream, partition, floor in rows}


@functools.cache
def _locks(dialect: Dialect) -> DriverStatement:
    """:func:`_lock_query` compiled once, its keys sent as one binary array."""
    return DriverStatement(_lock_query(), dialect, binary=("b_keys",))


@functools.cache
def _lookup_statement(dialect: Dialect) -> DriverStatement:
    """:func:`_lookup_query` compiled once, its arrays sent in binary."""
    return DriverStatement(_lookup_query(), dialect,
                           binary=("b_ids", "b_types", "b_aids", "b_streams", "b_parts"))


@functools.cache
def _lock_query() -> Any:
    """``SELECT pg_advisory_xact_lock(unnest(:b_keys))``, built once (built per claim with
    the keys inline, it was compiled and cache-keyed anew every time)."""
    keys = bindparam("b_keys", type_=postgresql.ARRAY(BigInteger))
    return select(func.pg_advisory_xact_lock(func.unnest(keys)))


@functools.cache
def _lookup_query() -> Any:
    """The receipts, heads, floors and retry rows of a batch in one ``UNION ALL``
    (PostgreSQL), built once. Rows are ``(kind, a, b, c, d, n)``: ``('r', event_id, outcome,
    reason, fingerprint, NULL)``, ``('h', aggregate_type, aggregate_id, NULL, NULL,
    revision)``, ``('f', stream, partition, floor_entry_id, NULL, NULL)``, ``('x', event_id,
    attempts, first_failed_at_ms, NULL, next_attempt_at_ms)``. Receipts, heads and retry rows
    are probed key by key (:func:`_probe`)."""
    group = bindparam("b_group", type_=String)
    none_text, none_int = cast(None, String), cast(None, BigInteger)
    given_ids = func.unnest(bindparam("b_ids", type_=postgresql.ARRAY(String))).table_valued(
        "id", name="given_ids").render_derived()
    receipt = _probe(select(inbox.c.event_id, inbox.c.outcome, inbox.c.reason,
                            inbox.c.fingerprint).where(
        inbox.c.group_name == group, inbox.c.event_id == given_ids.c.id))
    r = consumer_retries.c
    retry = _probe(select(r.event_id, r.attempts, r.first_failed_at_ms, r.next_attempt_at_ms)
                   .where(r.group_name == group, r.event_id == given_ids.c.id), "retry")
    given_heads = func.unnest(
        bindparam("b_types", type_=postgresql.ARRAY(String)),
        bindparam("b_aids", type_=postgresql.ARRAY(String)),
    ).table_valued("t", "i", name="given_heads").render_derived()
    head = _probe(select(inbox_heads.c.aggregate_type, inbox_heads.c.aggregate_id,
                         inbox_heads.c.revision).where(
        inbox_heads.c.group_name == group,
        inbox_heads.c.aggregate_type == given_heads.c.t,
        inbox_heads.c.aggregate_id == given_heads.c.i,
    ), "head")
    given_pairs = func.unnest(
        bindparam("b_streams", type_=postgresql.ARRAY(String)),
        bindparam("b_parts", type_=postgresql.ARRAY(Integer)),
    ).table_valued("s", "p", name="given_pairs").render_derived()
    return union_all(
        select(literal("r"), receipt.c.event_id, receipt.c.outcome, receipt.c.reason,
               receipt.c.fingerprint, none_int).select_from(given_ids).join(receipt, true()),
        select(literal("h"), head.c.aggregate_type, head.c.aggregate_id, none_text, none_text,
               head.c.revision).select_from(given_heads).join(head, true()),
        select(literal("f"), stream_trims.c.stream, cast(stream_trims.c.partition, String),
               stream_trims.c.floor_entry_id, none_text, none_int)
        .select_from(given_pairs).join(stream_trims, (stream_trims.c.stream == given_pairs.c.s)
                                       & (stream_trims.c.partition == given_pairs.c.p)),
        select(literal("x"), retry.c.event_id, cast(retry.c.attempts, String),
               cast(retry.c.first_failed_at_ms, String), none_text, retry.c.next_attempt_at_ms)
        .select_from(given_ids).join(retry, true()),
    )


def _heads(
    conn: Connection, group: str, aggregates: set[AggregateKey]
) -> dict[AggregateKey, int]:
    """The applied revisions of ``aggregates`` (SQLite; PostgreSQL reads them in
    :func:`_lookup_query`)."""
    if not aggregates:
        return {}
    keys = tuple_(inbox_heads.c.aggregate_type, inbox_heads.c.aggregate_id)
    query = select(inbox_heads.c.aggregate_type, inbox_heads.c.aggregate_id,
                   inbox_heads.c.revision).where(inbox_heads.c.group_name == group,
                                                 keys.in_(list(aggregates)))
    return {(t, i): rev for t, i, rev in conn.execute(query)}


def _probe(query: Select[Any], name: str = "found") -> Any:
    """``LATERAL (<query> LIMIT 1)``: one primary-key probe per given key (PostgreSQL).

    A plain join or ``= ANY(:ids)`` left the plan to the statistics; when they were stale
    (a table that grew since its last ANALYZE: autovacuum lagging, or off) PostgreSQL scanned
    every receipt of the group per batch (28 ms, and the heads hash join 66 ms, for 500 keys
    at 200,000 rows, measured with ``EXPLAIN ANALYZE``). The LIMIT
    keeps the subquery from being flattened into a join the planner could reorder.
    """
    return query.limit(1).lateral(name)


def retrying(
    engine: Engine, group: str | None = None, stream_keys: Iterable[str] | None = None
) -> list[dict[str, Any]]:
    """The entries waiting for a retry (``outbox_consumer_retries``), by group, stream key and
    last error: ``count``, ``oldest_first_failed_ms`` (the earliest first failure),
    ``next_attempt_ms`` (the soonest), ``max_attempts``. Only ``group``'s and only those of
    ``stream_keys`` when given. For ``outbox status`` and the consumer's retry gauges.

    A row whose event has a receipt is left out: the event is settled, and only a path other
    than the claim (an entry that vanished while pending: a ``lost`` receipt) left it behind."""
    r = consumer_retries.c
    settled = select(inbox.c.event_id).where(inbox.c.group_name == r.group_name,
                                             inbox.c.event_id == r.event_id).exists()
    query = (select(r.group_name, r.stream_key, r.last_error, func.count(),
                    func.min(r.first_failed_at_ms), func.min(r.next_attempt_at_ms),
                    func.max(r.attempts))
             .where(~settled)
             .group_by(r.group_name, r.stream_key, r.last_error)
             .order_by(r.group_name, r.stream_key, r.last_error))
    if group is not None:
        query = query.where(r.group_name == group)
    if stream_keys is not None:
        query = query.where(r.stream_key.in_(sorted(set(stream_keys))))
    with translate_errors(), engine.connect() as conn:
        rows = conn.execute(query).all()
    return [{"group": g, "stream_key": key, "last_error": error, "count": int(n),
             "oldest_first_failed_ms": int(first), "next_attempt_ms": int(nxt),
             "max_attempts": int(attempts)}
            for g, key, error, n, first, nxt, attempts in rows]
