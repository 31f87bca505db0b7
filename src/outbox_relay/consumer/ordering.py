"""Deciding a claim's deliveries: order per aggregate, retries, and whose fault an error is.

The vocabulary of outcomes lives here (and is re-exported by :mod:`consumer.inbox`, whose
claim transaction calls :func:`decide_batch`); this module runs handlers but issues no SQL of
its own. For each delivery, in this order (design.md flow 3):

1. a known event id is a ``duplicate`` when the receipt's fingerprint is the event's (or the
   receipt has none: written before fingerprints existed, it is compared with nothing); with
   another fingerprint it is ``dead`` as ``conflicting_duplicate`` (never applied, never a
   quiet skip; the receipt stays as it is);
2. an entry the claim found below its stream's trim floor without a receipt is
   ``resurrected`` (see :data:`RESURRECTED`);
3. a delivery of a *blocked* aggregate (an earlier strict event of it failing or waiting) is
   ``waiting``, also a ``latest`` one (it would raise the head past the strict event);
4. an event whose durable next attempt (consumer/retry.py) is not due yet is ``waiting``: its
   handler does not run and the delivery does not count;
5. a delivery the daemon marked dead is ``dead``;
6. a revision below the group's applied head is ``dead`` with reason ``out_of_order``
   (strict) or ``superseded`` (latest);
7. otherwise (equal or newer: several events may share a revision) the handler runs. If it
   raises: a permanent error is ``dead`` (``rejected``), a failure past the retry horizon is
   ``dead`` (``retry_horizon``), anything else is ``failed`` with its next attempt time.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sqlalchemy import Connection, exc
from sqlalchemy import exc as sa_exc

from outbox_relay.consumer.handlers import BatchHandler, Handler, Handlers
from outbox_relay.consumer.pipelining import KeptInsertFailed, Pipelined, pipelined
from outbox_relay.consumer.retry import PermanentError, Retry, judge
from outbox_relay.shared import psycopg_driver, tracing
from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.envelope import Event, fingerprint
from outbox_relay.shared.errors import UnavailableError

log = logging.getLogger(__name__)

APPLIED, DUPLICATE, SUPERSEDED = "applied", "duplicate", "superseded"
DEAD, FAILED, WAITING = "dead", "failed", "waiting"
OUT_OF_ORDER = "out_of_order"  # the reason of a strict event older than the applied head
CONFLICTING_DUPLICATE = "conflicting_duplicate"  # a known id carrying another fingerprint
RESURRECTED = "resurrected"
"""An entry below its stream's trim floor, delivered again without its receipt: acknowledged,
never applied. The relay trims only what every group has acknowledged, and a receipt is pruned
only below the floor, so such an entry was settled by this group before it was trimmed; Redis
brought it back (a replica promoted without ``WAIT`` still held entries its old master had
trimmed, with the group's older position; or an old snapshot was restored)."""

AggregateKey = tuple[str, str]


@dataclass(frozen=True)
class Delivery:
    """A valid entry to claim: where it came from and what it says.

    ``replay``: an operator's dead-letter replay; it is applied whatever the aggregate's head
    or blocked state says (the head is never lowered by it).
    """

    key: str
    entry_id: str
    event: Event
    deliveries: int
    dead_reason: str | None = None  # set when it must be recorded as dead, not applied
    replay: bool = False

    @functools.cached_property
    def fingerprint(self) -> str:
        """:func:`shared.envelope.fingerprint` of the event (computed once per delivery)."""
        return fingerprint(self.event)


class Outcome(NamedTuple):
    """What the claim decided for one delivery; ``failed`` and ``waiting`` ones stay pending.

    ``error``: the dead reason, the failing handler's error name, or for a ``duplicate`` of a
    ``dead`` receipt that receipt's reason (so the daemon writes its letter again). ``head``:
    the applied revision an ``out_of_order`` / ``superseded`` event was compared with.
    ``retry_at_ms``: for a ``failed`` or not-yet-due ``waiting`` event, its durable next
    attempt time (epoch ms); ``attempts``: its failures so far. ``detail``: what the letter
    says (a ``rejected`` handler's error; a ``conflicting_duplicate``'s two fingerprints,
    ``"<receipt's> <delivered>"``).
    """

    delivery: Delivery
    outcome: str
    error: str | None = None
    head: int | None = None
    retry_at_ms: int | None = None
    attempts: int = 0
    detail: str | None = None


class RetryState(NamedTuple):
    """The durable retry row of one event (``outbox_consumer_retries``)."""

    attempts: int
    first_failed_ms: int
    next_ms: int


class Receipt(NamedTuple):
    """What the claim knows of an event id's receipt: the reason of a ``dead`` one (else
    None) and its fingerprint (None for receipts written before fingerprints)."""

    reason: str | None
    fingerprint: str | None


def aggregate_key(event: Event) -> AggregateKey | None:
    """``(aggregatetype or "", aggregateid)``; None for an event without order (no aggregate
    id or no revision)."""
    if event.aggregateid is None or event.revision is None:
        return None
    return (event.aggregatetype or "", event.aggregateid)


class HandlerFailure(Exception):
    """A handler on the optimistic path raised: redo the batch with a savepoint per handler.
    ``delivery`` is None when a batch handler raised (which of its events failed is found by
    the redo, which calls it once per event)."""

    def __init__(self, delivery: Delivery | None, err: Exception) -> None:
        super().__init__(type(err).__name__)
        self.delivery, self.err = delivery, err


class RedoClaim(Exception):
    """A handler raised on the optimistic path of :func:`decide_batch` run without a
    savepoint: the caller rolls the claim's transaction back and claims the batch again in a
    new one, passing ``failure`` to :func:`decide_batch` (a savepoint per handler; the handler
    that raised is not run again)."""

    def __init__(self, failure: HandlerFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


@dataclass
class _Deferred:
    """The optimistic path's batch-handler calls not made yet: each batch handler's
    deliveries, in order, and which handler holds each aggregate's deferred events.

    Calls are made (:meth:`flush`) at the end of the batch, and earlier whenever another
    handler is about to write for an aggregate that has deferred events, so an aggregate's
    writes keep their revision order across handlers."""

    calls: dict[int, tuple[BatchHandler, list[Delivery]]] = field(default_factory=dict)
    owners: dict[AggregateKey, int] = field(default_factory=dict)
    # The handlers' inserts are in flight (consumer/pipelining.py): a database error raised
    # in a handler may be an earlier handler's, so it names no delivery.
    pipelined: bool = False
    # The block's pipeline, asked after each handler whether kept inserts failed.
    pipe: Pipelined | None = None

    def add(self, conn: Connection, fn: BatchHandler, d: Delivery,
            key: AggregateKey | None) -> None:
        if key is not None and self.owners.get(key, id(fn)) != id(fn):
            self.flush(conn)
        self.calls.setdefault(id(fn), (fn, []))[1].append(d)
        if key is not None:
            self.owners[key] = id(fn)

    def before(self, conn: Connection, key: AggregateKey | None) -> None:
        """Another handler is about to run for ``key``: make the deferred calls first."""
        if key is not None and key in self.owners:
            self.flush(conn)

    def flush(self, conn: Connection) -> None:
        calls, self.calls, self.owners = self.calls, {}, {}
        for fn, deliveries in calls.values():
            try:
                fn(conn, [d.event for d in deliveries])
            except Exception as err:
                _raise_if_claim_lost(conn, _database_error(err))
                raise HandlerFailure(None, err) from err


@dataclass
class Ledger:
    """What one claim knows while it decides: receipts, applied heads, blocked aggregates,
    the batch's durable retry rows, and the claim's clock (``now_ms``)."""

    seen: dict[str, Receipt]
    heads: dict[AggregateKey, int]
    blocked: set[AggregateKey] = field(default_factory=set)
    resurrected: frozenset[str] = frozenset()  # event ids below their stream's trim floor
    retries: dict[str, RetryState] = field(default_factory=dict)
    now_ms: int = 0

    def copy(self) -> Ledger:
        return Ledger(dict(self.seen), dict(self.heads), set(self.blocked), self.resurrected,
                      self.retries, self.now_ms)


def decide_batch(
    conn: Connection, batch: list[Delivery], ledger: Ledger, handlers: Handlers,
    group: str = "", retry: Retry | None = None, *, savepoint: bool = True,
    failure: HandlerFailure | None = None,
    then: Callable[[list[Outcome], Ledger, bool], None] | None = None,
) -> tuple[list[Outcome], Ledger]:
    """Decide every delivery: optimistically (every handler at once), else with a savepoint
    per handler. ``group`` (the consumer group) only names the group in logs and trace
    spans; ``retry``: the group's default policy for handlers registered without one (None,
    as in dead-letter replay: a failure of such a handler has no durable retry time and no
    horizon).

    ``savepoint``: the optimistic path runs under one savepoint, and when a handler raises it
    rolls back to it and decides again here. Without it (everything the claim's transaction
    did before is done again by a new one: consumer/inbox.py) a handler raising raises
    :class:`RedoClaim`, and the
    caller decides again in a new transaction with its ``failure``: two statements fewer per
    claim (``SAVEPOINT``, ``RELEASE``).

    ``then(outcomes, ledger, in_flight)``: the claim's writes, called once with what was
    decided. Without a savepoint, on the optimistic path, inside its pipeline (``in_flight``:
    psycopg's pipeline mode is on, results are not to be read), so the handlers' inserts, the
    writes and the pipeline's end are one round trip; an error that surfaces at that end is
    the optimistic path's failure, as a handler's insert in flight failing always was (the
    claim done again writes with nothing in flight, so an error of the writes themselves
    raises there, as itself)."""
    default = retry
    # Whether handlers run in trace spans, asked once per claim: while no tracer provider is
    # set, OpenTelemetry's check reads the environment on every call.
    spans = tracing.enabled()
    if failure is None and (len(batch) > 1 or not savepoint):
        trial = ledger.copy() if savepoint else ledger  # else dropped with the transaction
        deferred = _Deferred()
        try:
            with (conn.begin_nested() if savepoint else contextlib.nullcontext(),
                  pipelined(conn, handlers.pipeline) as pipe):
                deferred.pipelined, deferred.pipe = pipe.pipelining, pipe
                outcomes = [_decide(conn, d, trial, handlers, False, group, default,
                                    deferred=deferred, spans=spans) for d in batch]
                deferred.flush(conn)
                try:
                    if then is not None and not savepoint:
                        then(outcomes, trial, pipe.on)
                        then = None
                    pipe.finish()
                except Exception as err:
                    # An insert in flight failed, or a handler caught a database error of its
                    # own and left the transaction failed: whose is not known. The claim done
                    # again writes with nothing in flight and a savepoint per handler, so an
                    # error of the writes themselves raises there as itself.
                    _raise_if_claim_lost(conn, _database_error(err))
                    raise HandlerFailure(None, err) from err
            if then is not None:
                then(outcomes, trial, False)
            return outcomes, trial
        except HandlerFailure as caught:
            failure = caught
        # Redone outside the ``except`` block: another handler failing in the redo must not
        # be chained to this one (its logged traceback showed "during handling of ...").
        handlers.take_after_commit(set())  # rolled back: every handler runs again
        if not savepoint:
            raise RedoClaim(failure)
    if failure is not None:
        outcomes = [
            _decide(conn, d, ledger, handlers, True, group, default,
                    failed=failure.err if d is failure.delivery else None, spans=spans)
            for d in batch
        ]
    else:
        outcomes = [_decide(conn, d, ledger, handlers, True, group, default, spans=spans)
                    for d in batch]
    if then is not None:
        then(outcomes, ledger, False)
    return outcomes, ledger


def _decide(
    conn: Connection,
    d: Delivery,
    ledger: Ledger,
    handlers: Handlers,
    savepoints: bool,
    group: str,
    default: Retry | None,
    failed: Exception | None = None,
    deferred: _Deferred | None = None,
    spans: bool = True,
) -> Outcome:
    """One delivery (see the module docstring); ``failed``: its handler already raised in
    this claim (the redo after the optimistic path), so it is not run again; ``deferred``
    (the optimistic path): where a batch handler's call is put off to."""
    event = d.event
    key = aggregate_key(event)
    if event.id in ledger.seen:
        receipt = ledger.seen[event.id]
        if receipt.fingerprint is not None and receipt.fingerprint != d.fingerprint:
            return Outcome(d, DEAD, CONFLICTING_DUPLICATE,
                           detail=f"{receipt.fingerprint} {d.fingerprint}")
        reason = receipt.reason
        return Outcome(d, DUPLICATE, reason, ledger.heads.get(key) if reason and key else None)
    if event.id in ledger.resurrected and not d.replay:
        return Outcome(d, RESURRECTED)
    strict = handlers.ordering(event.type) == "strict"
    if key is not None and key in ledger.blocked and not d.replay:
        # A latest event waits too: applied now, it would raise the head past the failing
        # strict one, which would then come back out_of_order.
        return Outcome(d, WAITING)
    state = ledger.retries.get(event.id)
    if state is not None and state.next_ms > ledger.now_ms and not d.replay:
        if strict and key is not None:
            ledger.blocked.add(key)
        return Outcome(d, WAITING, retry_at_ms=state.next_ms, attempts=state.attempts)
    if d.dead_reason is not None:
        ledger.seen[event.id] = Receipt(None, d.fingerprint)
        return Outcome(d, DEAD, d.dead_reason)
    head = ledger.heads.get(key) if key is not None else None
    behind = head is not None and event.revision is not None and event.revision < head
    if behind and not d.replay:
        ledger.seen[event.id] = Receipt(None, d.fingerprint)
        return Outcome(d, DEAD, OUT_OF_ORDER, head) if strict else Outcome(
            d, SUPERSEDED, None, head)
    handler = handlers.get(event.type)
    if handler is None:
        ledger.seen[event.id] = Receipt(None, d.fingerprint)
        return Outcome(d, DEAD, "unknown_type")
    err = _call(conn, d, handler, handlers, savepoints, group, failed, deferred, key, spans)
    if err is not None:
        return _failed(d, err, ledger, handlers.retry_for(event.type) or default, strict,
                       key, group)
    ledger.seen[event.id] = Receipt(None, d.fingerprint)
    if key is not None and event.revision is not None:
        ledger.heads[key] = max(event.revision, head if head is not None else event.revision)
    return Outcome(d, APPLIED)


def _call(conn: Connection, d: Delivery, handler: Handler, handlers: Handlers,
          savepoints: bool, group: str, failed: Exception | None, deferred: _Deferred | None,
          key: AggregateKey | None, spans: bool = True) -> Exception | None:
    """Run ``d``'s handler now (:func:`_run`), or put a batch handler's call off to the end
    of the optimistic path (``deferred``: the event is decided applied; if the call raises,
    the whole batch is redone one event at a time). The handler's failure, or None."""
    if failed is not None:
        return failed
    if deferred is not None:
        batch_handler = handlers.batch(d.event.type)
        if batch_handler is not None:
            deferred.add(conn, batch_handler, d, key)
            return None
        deferred.before(conn, key)
    return _run(conn, d, handler, savepoints, group,
                pipelined=deferred is not None and deferred.pipelined, spans=spans,
                kept=deferred.pipe if deferred is not None else None)


def _failed(d: Delivery, err: Exception, ledger: Ledger, policy: Retry | None, strict: bool,
            key: AggregateKey | None, group: str) -> Outcome:
    """A handler raised: dead (permanent, or past the horizon) or failed with its next
    attempt time (consumer/retry.py); logged once, with the verdict."""
    error = type(err).__name__
    if policy is None:
        _log_failure(d, error, err, group)
        if strict and key is not None:
            ledger.blocked.add(key)
        return Outcome(d, FAILED, error)
    state = ledger.retries.get(d.event.id)
    verdict = judge(policy, err, error, state.attempts if state else 0,
                    state.first_failed_ms if state else None, ledger.now_ms)
    delay = None if verdict.next_ms is None else verdict.next_ms - ledger.now_ms
    _log_failure(d, error, err, group, verdict.attempts, delay, verdict.reason)
    if verdict.reason is not None and not d.replay:
        ledger.seen[d.event.id] = Receipt(None, d.fingerprint)
        text = f"{error}: {err}" if isinstance(err, PermanentError) else error
        return Outcome(d, DEAD, verdict.reason, attempts=verdict.attempts, detail=text[:500])
    if strict and key is not None:
        ledger.blocked.add(key)
    return Outcome(d, FAILED, error, retry_at_ms=None if d.replay else verdict.next_ms,
                   attempts=verdict.attempts)


def _run(
    conn: Connection, d: Delivery, handler: Handler, savepoints: bool, group: str,
    pipelined: bool = False, spans: bool = True, kept: Pipelined | None = None,
) -> Exception | None:
    """Run the handler (with ``spans``, in a trace span, child of the producer's context:
    :func:`shared.tracing.process_span`); its own failure, None when it succeeded.

    Without savepoints (the optimistic path) a failure raises :class:`HandlerFailure`; with
    ``pipelined`` inserts in flight a database error names no delivery (it may be an earlier
    handler's insert), nor does a failure of inserts ``kept`` (consumer/pipelining.py) raised
    into this handler, or caught by it. A lost connection or contention raises (the whole
    claim fails and is retried).
    """
    event = d.event
    span = tracing.process_span(event.traceparent, event.tracestate, d.key, event.id,
                                event.type, group) if spans else _NO_SPAN
    if not savepoints:
        try:
            with span:
                handler(conn, event)
                if kept is not None and kept.failed is not None:
                    raise kept.failed  # an earlier handler's kept insert; this one caught it
                if not pipelined:
                    _check_usable(conn)
        except Exception as err:
            _raise_if_claim_lost(conn, _database_error(err))
            # An earlier handler's kept insert, sent by this handler's statement; in pipeline
            # mode any database error may be an earlier handler's insert in flight.
            known = not (isinstance(err, KeptInsertFailed)
                         or (pipelined and isinstance(err, exc.DBAPIError)))
            raise HandlerFailure(d if known else None, err) from err
        return None
    try:
        with conn.begin_nested(), span:
            handler(conn, event)
            _check_usable(conn)
    except Exception as err:  # the handler's own failure: only its savepoint rolls back
        _raise_if_claim_lost(conn, err)
        return err
    return None


class HandlerLeftTransactionFailed(Exception):
    """A handler returned after a statement of its failed (it caught the database's error):
    PostgreSQL refuses every later statement of the transaction, so it is that handler's
    failure (its savepoint rolls back), not the claim's."""


def _check_usable(conn: Connection) -> None:
    """Raise :class:`HandlerLeftTransactionFailed` when the handler just run left the
    PostgreSQL transaction failed (psycopg's transaction status; other drivers: nothing)."""
    pg = psycopg_driver.module()
    if pg is None or not is_postgres(conn):
        return
    info = getattr(conn.connection.driver_connection, "info", None)
    if info is not None and info.transaction_status == pg.pq.TransactionStatus.INERROR:
        raise HandlerLeftTransactionFailed(
            "the handler caught a database error and returned; the transaction cannot go on")


_NO_SPAN: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def _log_failure(d: Delivery, error: str, exc: BaseException | None, group: str,
                 attempts: int = 0, delay_ms: int | None = None, dead: str | None = None) -> None:
    """A handler's failure, at WARNING with its traceback (redacted by the log handler) and
    the event's id and type as structured fields; each failure on its own (never chained to
    another handler's). Says what follows: the next attempt, or the dead reason.

    A :class:`PermanentError` is the handler's own decision, not a crash: its message goes in
    the line and no traceback follows (an operator reading the log of a handler that rejects
    bad input on purpose must not find tracebacks to chase; ``outbox dlq`` shows the reason)."""
    event = d.event
    shown, said = exc, error
    if isinstance(exc, PermanentError):
        said, shown = (f"{error}: {exc}" if str(exc) else error), None
    if isinstance(exc, sa_exc.StatementError):
        # The driver's text carries the SQL statement and its parameters (event data): the
        # traceback's frames at WARNING, the driver's message only at DEBUG.
        shown = _DatabaseError(f"{type(exc).__name__}: the database refused a statement of "
                               "the handler (driver message at DEBUG)")
        log.debug("handler for %s failed on %s", event.type, event.id, exc_info=exc)
    then = (f"dead-lettered ({dead})" if dead else "retried" if delay_ms is None
            else f"attempt {attempts}, retried in {max(0, delay_ms) / 1000:.1f}s")
    log.warning(
        "handler for %s failed on %s: %s; %s", event.type, event.id, said, then,
        exc_info=(type(shown), shown, exc.__traceback__) if exc is not None and shown else None,
        extra={"event_id": event.id, "event_type": event.type, "stream_key": d.key,
               "entry_id": d.entry_id, "group": group, "error": error,
               "deliveries": d.deliveries, "attempts": attempts, "dead_reason": dead},
    )


class _DatabaseError(Exception):
    """Stands in for a database error in a WARNING traceback (see :func:`_log_failure`)."""


def _raise_if_claim_lost(conn: Connection, err: Exception) -> None:
    """Raise when ``err`` is not the handler's own failure but the claim's.

    A real disconnect (SQLAlchemy invalidated the connection, or the dialect's disconnect test
    says so) or a transaction that can no longer go on: no other entry may be decided in it.
    SQLite's ``database is locked`` is contention: the claim is retried as a whole. Anything
    else (a bad statement, "no such table", a statement timeout, a deadlock) is the handler's
    failure: its savepoint rolls back and the batch's other entries commit.
    """
    if isinstance(err, exc.PendingRollbackError | exc.ResourceClosedError):
        raise err
    if not isinstance(err, exc.DBAPIError):
        return
    if err.connection_invalidated or conn.invalidated or _dialect_disconnect(conn, err):
        raise err
    if not is_postgres(conn) and "database is locked" in str(err.orig):
        raise UnavailableError("the database is locked by another writer") from err


def _database_error(err: Exception) -> Exception:
    """The database's error behind ``err`` (a kept insert's failure carries it)."""
    return err.error if isinstance(err, KeptInsertFailed) else err


def _dialect_disconnect(conn: Connection, err: exc.DBAPIError) -> bool:
    try:
        dbapi_conn = conn.connection.dbapi_connection
    except exc.SQLAlchemyError:  # the connection is gone already
        return True
    orig: Any = err.orig
    return bool(conn.dialect.is_disconnect(orig, dbapi_conn, None))
