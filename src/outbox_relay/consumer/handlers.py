"""Handlers: plain typed functions registered per event type.

A handler receives the claim transaction's connection and the parsed event. Whatever it writes
through that connection commits together with the inbox receipt, events it enqueues with
``Producer.enqueue(conn, ...)`` included (they commit with the receipt, or neither); if it
raises, only its writes roll back, the entry stays pending and is retried with backoff by its
:class:`consumer.retry.Retry` policy (the group's default unless the handler has its own); a
:class:`consumer.retry.PermanentError` dead-letters it at once. The batch's handlers share one
savepoint; when one raises, the batch is redone with a savepoint per handler, so a handler may
run twice in one claim: see :func:`consumer.inbox.claim`.

A *batch handler* (:meth:`Handlers.on_batch`) receives all of a claim's events of its type
at once, in stream order (so in revision order per aggregate), and can write them with one
statement; the inbox still records each event. It runs only where its events were decided
``applied`` one by one (duplicates, waiting and out-of-order events are not passed), before any
other handler of the same claim touches one of those aggregates, so an aggregate's writes keep
their revision order. If it raises, the claim falls back to calling it once per event
(``handler(conn, [event])``) with a savepoint each, so the failing event is isolated and
retried alone.

Work that must not run inside the transaction (a long run stage, a network call) is scheduled
with :meth:`Handlers.after_commit`: the daemon runs it only after the claim transaction
committed *and* the entry was acknowledged, and only if that handler's event was applied; on a
rollback or a failed handler the callback is dropped.

Each handler also says how it treats the order of an aggregate's events (design.md flow 3):

- ``strict`` (the default, for events that carry a change): an aggregate's events apply in
  revision order; while an earlier one is failing or waiting, later ones wait (not applied,
  not acknowledged); one older than the applied revision is dead-lettered as ``out_of_order``.
- ``latest`` (for events that only say "this aggregate changed, re-read it"): an older one
  than the applied revision is ``superseded``: acknowledged and counted, its handler not run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Literal, Protocol, TypeVar, cast

from prometheus_client.registry import Collector
from sqlalchemy import Connection

from outbox_relay.consumer.async_handlers import (
    AsyncBatchHandler,
    AsyncHandler,
    awaited,
    is_async,
)
from outbox_relay.consumer.retry import Retry
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.metrics import Naming

log = logging.getLogger(__name__)

Ordering = Literal["strict", "latest"]
ORDERINGS: tuple[Ordering, ...] = ("strict", "latest")


class Handler(Protocol):
    """``handler(conn, event) -> None``; raise to have the entry retried."""

    def __call__(self, conn: Connection, event: Event, /) -> None: ...


class BatchHandler(Protocol):
    """``handler(conn, events) -> None``: every event of the claim for its type, in order;
    raise to have them retried one by one (see the module docstring)."""

    def __call__(self, conn: Connection, events: list[Event], /) -> None: ...


def _one_at_a_time(handler: BatchHandler) -> Handler:
    """A batch handler as a per-event handler: the fallback path and single deliveries."""

    def each(conn: Connection, event: Event, /) -> None:
        handler(conn, [event])

    return each


H = TypeVar("H", bound="Handler | AsyncHandler")
B = TypeVar("B", bound="BatchHandler | AsyncBatchHandler")


class Handlers:
    """The registry one consumer group dispatches on (exact ``type`` match, or ``"*"``).

    ``pipeline``: on PostgreSQL, handlers' one-row inserts are sent without waiting for each
    result (consumer/pipelining.py: what is and is not, and what a handler sees); False sends
    every statement and waits, as on SQLite and with async handlers."""

    def __init__(self, *, pipeline: bool = True) -> None:
        self.pipeline = pipeline
        self._by_type: dict[str, Handler] = {}
        self._ordering: dict[str, Ordering] = {}
        self._retry: dict[str, Retry] = {}
        self._batch: dict[str, BatchHandler] = {}  # types registered with register_batch
        self.has_async = False  # an async handler is registered: claims run on an async engine
        self._after_commit: list[tuple[str, Callable[[], None]]] = []
        self._pause: Callable[[], bool] | None = None
        # Counters the app's own components keep (dataclasses such as the run worker's),
        # exported with the daemon's metrics as outbox_consumer_<name>_…_total.
        self.observed: dict[str, object] = {}
        self.namings: dict[str, Naming] = {}  # how :meth:`observe` named them
        # Prometheus collectors the app's components add (the run worker: runs by status),
        # registered with the daemon's metrics when it serves them.
        self.collectors: list[Collector] = []
        self._on_stop: list[Callable[[], None]] = []

    def register(
        self, event_type: str, handler: Handler | AsyncHandler, *,
        ordering: Ordering = "strict", retry: Retry | None = None,
    ) -> None:
        """Route events of ``event_type`` (or every type, with ``"*"``) to ``handler``,
        applied in ``ordering`` (see the module docstring), retried by ``retry`` when it
        raises (None: the group's default, ``OUTBOX_RETRY_*``). An ``async def`` handler gets
        an ``AsyncConnection`` on the claim transaction (consumer/async_handlers.py)."""
        if is_async(handler):
            handler = cast(Handler, awaited(cast(AsyncHandler, handler)))
            self.has_async = True
        self._add(event_type, cast(Handler, handler), ordering, retry)

    def _add(self, event_type: str, handler: Handler, ordering: Ordering,
             retry: Retry | None) -> None:
        if event_type in self._by_type:
            raise ValueError(f"a handler for {event_type!r} is already registered")
        if ordering not in ORDERINGS:
            raise ValueError(f"ordering must be one of {ORDERINGS}, not {ordering!r}")
        if retry is not None and not isinstance(retry, Retry):
            raise ValueError(f"retry must be a Retry, not {type(retry).__name__}")
        self._by_type[event_type] = handler
        self._ordering[event_type] = ordering
        if retry is not None:
            self._retry[event_type] = retry

    def register_batch(
        self, event_type: str, handler: BatchHandler | AsyncBatchHandler, *,
        ordering: Ordering = "strict", retry: Retry | None = None,
    ) -> None:
        """Route events of ``event_type`` to ``handler`` a claim's batch at a time (see the
        module docstring); ``ordering`` and ``retry`` as in :meth:`register`, and they apply to
        each event (a failing event is retried alone, the others apply). ``async def`` too."""
        if is_async(handler):
            handler = cast(BatchHandler, awaited(cast(AsyncBatchHandler, handler)))
            self.has_async = True
        batch = cast(BatchHandler, handler)
        self._add(event_type, _one_at_a_time(batch), ordering, retry)
        self._batch[event_type] = batch

    def on_batch(
        self, event_type: str, *, ordering: Ordering = "strict", retry: Retry | None = None
    ) -> Callable[[B], B]:
        """Decorator form of :meth:`register_batch` (sync or async batch handlers)."""

        def decorate(handler: B) -> B:
            self.register_batch(event_type, handler, ordering=ordering, retry=retry)
            return handler

        return decorate

    def on(
        self, event_type: str, *, ordering: Ordering = "strict", retry: Retry | None = None
    ) -> Callable[[H], H]:
        """Decorator form of :meth:`register` (sync or async handlers)."""

        def decorate(handler: H) -> H:
            self.register(event_type, handler, ordering=ordering, retry=retry)
            return handler

        return decorate

    def instrument(self, wrap: Callable[[str, Handler], Handler]) -> None:
        """Replace every registered handler by ``wrap(event_type, handler)`` (metrics: the
        daemon times each call); dispatch and orderings stay as they are."""
        self._by_type = {t: wrap(t, h) for t, h in self._by_type.items()}
        # A batch call is timed as one call (the wrapper passes its arguments through).
        self._batch = {t: cast(BatchHandler, wrap(t, cast(Handler, h)))
                       for t, h in self._batch.items()}

    def get(self, event_type: str) -> Handler | None:
        """The handler for a type, falling back to ``"*"``; None if the group has none."""
        return self._by_type.get(event_type) or self._by_type.get("*")

    def batch(self, event_type: str) -> BatchHandler | None:
        """The batch handler :meth:`get` stands for, when it was registered as one."""
        if event_type in self._by_type:
            return self._batch.get(event_type)
        return self._batch.get("*")

    def ordering(self, event_type: str) -> Ordering:
        """The ordering of the handler :meth:`get` returns; ``strict`` when there is none."""
        if event_type in self._by_type:
            return self._ordering[event_type]
        return self._ordering.get("*", "strict")

    def retry_for(self, event_type: str) -> Retry | None:
        """The retry policy of the handler :meth:`get` returns; None: the group's default."""
        if event_type in self._by_type:
            return self._retry.get(event_type)
        return self._retry.get("*")

    def after_commit(self, event_id: str, callback: Callable[[], None]) -> None:
        """From a handler: run ``callback`` once the claim of ``event_id`` committed and was
        acknowledged. Dropped if the batch rolls back or the event is not applied."""
        self._after_commit.append((event_id, callback))

    def take_after_commit(self, applied: set[str]) -> list[Callable[[], None]]:
        """The daemon's side: the callbacks of ``applied`` event ids; forget all the others."""
        return [callback for _event_id, callback in self.take_scheduled(applied)]

    def take_scheduled(self, applied: set[str]) -> list[tuple[str, Callable[[], None]]]:
        """:meth:`take_after_commit` with each callback's event id (for the failure log)."""
        taken, self._after_commit = self._after_commit, []
        return [(event_id, callback) for event_id, callback in taken if event_id in applied]

    def observe(self, name: str, stats: object,
                names: Mapping[str, tuple[str, str]] | None = None) -> None:
        """Export the counters of a stats dataclass the app's component keeps, as
        ``outbox_consumer_<name>_<field>_total``; ``names`` maps fields to ``(name, help)``."""
        self.observed[name] = stats
        self.namings[name] = Naming(name, names or {})

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the consumer daemon stops, after its last batch (the run
        worker finishes its stages and gives back its leases there)."""
        self._on_stop.append(callback)

    def stop(self) -> None:
        """The daemon's side: run the :meth:`on_stop` callbacks once, newest first; a failing
        one is logged and the others still run."""
        callbacks, self._on_stop = self._on_stop, []
        for callback in reversed(callbacks):
            try:
                callback()
            except Exception:  # a stop hook must not keep the others from running
                log.exception("a stop hook of the handlers failed")

    def pause_when(self, predicate: Callable[[], bool]) -> None:
        """Backpressure: while ``predicate()`` is true the daemon reads nothing new, so entries
        stay in the stream for other consumers instead of piling up behind slow work here."""
        self._pause = predicate

    def paused(self) -> bool:
        """Whether the daemon should hold off reading (see :meth:`pause_when`)."""
        return self._pause is not None and self._pause()

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_type)
