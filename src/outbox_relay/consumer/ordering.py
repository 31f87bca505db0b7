"""Deciding a claim's deliveries: order per aggregate, and whose fault an error is.

The vocabulary of outcomes lives here (and is re-exported by :mod:`consumer.inbox`, whose
claim transaction calls :func:`decide_batch`); this module runs handlers but issues no SQL of
its own. For each delivery, in this order: a known event id is a ``duplicate``; an entry the
claim found below its stream's trim floor without a receipt is ``resurrected`` (see
:data:`RESURRECTED`); a delivery of
a *blocked* aggregate (an earlier strict event of it failing or waiting) is ``waiting``, also
a ``latest`` one (it would raise the head past the strict event);
a delivery the daemon marked dead is ``dead``; a revision below the group's applied head is
``dead`` with reason ``out_of_order`` (strict) or ``superseded`` (latest); otherwise (equal
or newer: several events may share a revision) the handler runs (design.md flow 3).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, exc
from sqlalchemy import exc as sa_exc

from outbox_relay.consumer.handlers import Handler, Handlers
from outbox_relay.shared import tracing
from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import UnavailableError

log = logging.getLogger(__name__)

APPLIED, DUPLICATE, SUPERSEDED = "applied", "duplicate", "superseded"
DEAD, FAILED, WAITING = "dead", "failed", "waiting"
OUT_OF_ORDER = "out_of_order"  # the reason of a strict event older than the applied head
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


@dataclass(frozen=True)
class Outcome:
    """What the claim decided for one delivery; ``failed`` and ``waiting`` ones stay pending.

    ``error``: the dead reason, the failing handler's error name, or for a ``duplicate`` of a
    ``dead`` receipt that receipt's reason (so the daemon writes its letter again). ``head``:
    the applied revision an ``out_of_order`` / ``superseded`` event was compared with.
    """

    delivery: Delivery
    outcome: str
    error: str | None = None
    head: int | None = None


def aggregate_key(event: Event) -> AggregateKey | None:
    """``(aggregatetype or "", aggregateid)``; None for an event without order (no aggregate
    id or no revision)."""
    if event.aggregateid is None or event.revision is None:
        return None
    return (event.aggregatetype or "", event.aggregateid)


class _HandlerFailed(Exception):
    """A handler on the optimistic path raised: redo the batch with a savepoint per handler."""

    def __init__(self, delivery: Delivery, error: str) -> None:
        super().__init__(error)
        self.delivery, self.error = delivery, error


@dataclass
class Ledger:
    """What one claim knows while it decides: receipts, applied heads, blocked aggregates."""

    seen: dict[str, str | None]  # event id -> the reason of its dead receipt, else None
    heads: dict[AggregateKey, int]
    blocked: set[AggregateKey] = field(default_factory=set)
    resurrected: frozenset[str] = frozenset()  # event ids below their stream's trim floor

    def copy(self) -> Ledger:
        return Ledger(dict(self.seen), dict(self.heads), set(self.blocked), self.resurrected)


def decide_batch(
    conn: Connection, batch: list[Delivery], ledger: Ledger, handlers: Handlers,
    group: str = "",
) -> tuple[list[Outcome], Ledger]:
    """Decide every delivery: optimistically under one savepoint, else one per handler.
    ``group`` (the consumer group) only names the group in logs and trace spans."""
    if len(batch) > 1:
        trial = ledger.copy()
        try:
            with conn.begin_nested():
                return [_decide(conn, d, trial, handlers, False, group) for d in batch], trial
        except _HandlerFailed as failure:
            handlers.take_after_commit(set())  # rolled back: every handler runs again
            _log_failure(failure.delivery, failure.error, failure.__cause__, group)
            return [
                _decide(conn, d, ledger, handlers, True, group,
                        failed=failure.error if d is failure.delivery else None)
                for d in batch
            ], ledger
    return [_decide(conn, d, ledger, handlers, True, group) for d in batch], ledger


def _decide(
    conn: Connection,
    d: Delivery,
    ledger: Ledger,
    handlers: Handlers,
    savepoints: bool,
    group: str,
    failed: str | None = None,
) -> Outcome:
    """One delivery (see the module docstring); ``failed``: its handler already raised in
    this claim (the redo after the optimistic path), so it is not run again."""
    event = d.event
    key = aggregate_key(event)
    if event.id in ledger.seen:
        reason = ledger.seen[event.id]
        return Outcome(d, DUPLICATE, reason, ledger.heads.get(key) if reason and key else None)
    if event.id in ledger.resurrected and not d.replay:
        return Outcome(d, RESURRECTED)
    strict = handlers.ordering(event.type) == "strict"
    if key is not None and key in ledger.blocked and not d.replay:
        # A latest event waits too: applied now, it would raise the head past the failing
        # strict one, which would then come back out_of_order.
        return Outcome(d, WAITING)
    if d.dead_reason is not None:
        ledger.seen[event.id] = None
        return Outcome(d, DEAD, d.dead_reason)
    head = ledger.heads.get(key) if key is not None else None
    behind = head is not None and event.revision is not None and event.revision < head
    if behind and not d.replay:
        ledger.seen[event.id] = None
        return Outcome(d, DEAD, OUT_OF_ORDER, head) if strict else Outcome(
            d, SUPERSEDED, None, head)
    handler = handlers.get(event.type)
    if handler is None:
        ledger.seen[event.id] = None
        return Outcome(d, DEAD, "unknown_type")
    error = failed if failed is not None else _run(conn, d, handler, savepoints, group)
    if error is not None:
        if strict and key is not None:
            ledger.blocked.add(key)
        return Outcome(d, FAILED, error)
    ledger.seen[event.id] = None
    if key is not None and event.revision is not None:
        ledger.heads[key] = max(event.revision, head if head is not None else event.revision)
    return Outcome(d, APPLIED)


def _run(
    conn: Connection, d: Delivery, handler: Handler, savepoints: bool, group: str
) -> str | None:
    """Run the handler (in a trace span, child of the producer's context when tracing is
    on: :func:`shared.tracing.process_span`); the error name of its own failure, None when it
    succeeded.

    Without savepoints (the optimistic path) a failure raises :class:`_HandlerFailed`. A lost
    connection or contention raises (the whole claim fails and is retried).
    """
    event = d.event
    if not savepoints:
        try:
            with tracing.process_span(event.traceparent, event.tracestate, d.key, event.id,
                                      event.type, group):
                handler(conn, event)
        except Exception as err:
            _raise_if_claim_lost(conn, err)
            raise _HandlerFailed(d, type(err).__name__) from err
        return None
    try:
        with conn.begin_nested(), tracing.process_span(
            event.traceparent, event.tracestate, d.key, event.id, event.type, group
        ):
            handler(conn, event)
    except Exception as err:  # the handler's own failure: only its savepoint rolls back
        _raise_if_claim_lost(conn, err)
        _log_failure(d, type(err).__name__, err, group)
        return type(err).__name__
    return None


def _log_failure(d: Delivery, error: str, exc: BaseException | None, group: str) -> None:
    """A handler's failure, at WARNING with its traceback (redacted by the log handler) and
    the event's id and type as structured fields: the entry stays pending and is retried."""
    event = d.event
    shown = exc
    if isinstance(exc, sa_exc.StatementError):
        # The driver's text carries the SQL statement and its parameters (event data): the
        # traceback's frames at WARNING, the driver's message only at DEBUG.
        shown = _DatabaseError(f"{type(exc).__name__}: the database refused a statement of "
                               "the handler (driver message at DEBUG)")
        log.debug("handler for %s failed on %s", event.type, event.id, exc_info=exc)
    log.warning(
        "handler for %s failed on %s: %s", event.type, event.id, error,
        exc_info=(type(shown), shown, exc.__traceback__) if exc is not None and shown else None,
        extra={"event_id": event.id, "event_type": event.type, "stream_key": d.key,
               "entry_id": d.entry_id, "group": group, "error": error,
               "deliveries": d.deliveries},
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


def _dialect_disconnect(conn: Connection, err: exc.DBAPIError) -> bool:
    try:
        dbapi_conn = conn.connection.dbapi_connection
    except exc.SQLAlchemyError:  # the connection is gone already
        return True
    orig: Any = err.orig
    return bool(conn.dialect.is_disconnect(orig, dbapi_conn, None))
