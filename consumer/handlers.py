"""Handlers: plain typed functions registered per event type.

A handler receives the claim transaction's connection and the parsed event. Whatever it writes
through that connection commits together with the inbox receipt; if it raises, only its writes
roll back, the entry stays pending and is retried (the batch's handlers share one savepoint; when
one raises, the batch is redone with a savepoint per handler, so a handler may run twice in one
claim: see :func:`consumer.inbox.claim`).

Work that must not run inside the transaction (a long run stage, a network call) is scheduled
with :meth:`Handlers.after_commit`: the daemon runs it only after the claim transaction
committed *and* the entry was acknowledged, and only if that handler's event was applied; on a
rollback or a failed handler the callback is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from sqlalchemy import Connection

from shared.envelope import Event


class Handler(Protocol):
    """``handler(conn, event) -> None``; raise to have the entry retried."""

    def __call__(self, conn: Connection, event: Event, /) -> None: ...


class Handlers:
    """The registry one consumer group dispatches on (exact ``type`` match, or ``"*"``)."""

    def __init__(self) -> None:
        self._by_type: dict[str, Handler] = {}
        self._after_commit: list[tuple[str, Callable[[], None]]] = []
        self._pause: Callable[[], bool] | None = None

    def register(self, event_type: str, handler: Handler) -> None:
        """Route events of ``event_type`` (or every type, with ``"*"``) to ``handler``."""
        if event_type in self._by_type:
            raise ValueError(f"a handler for {event_type!r} is already registered")
        self._by_type[event_type] = handler

    def on(self, event_type: str) -> Callable[[Handler], Handler]:
        """Decorator form of :meth:`register`."""

        def decorate(handler: Handler) -> Handler:
            self.register(event_type, handler)
            return handler

        return decorate

    def get(self, event_type: str) -> Handler | None:
        """The handler for a type, falling back to ``"*"``; None if the group has none."""
        return self._by_type.get(event_type) or self._by_type.get("*")

    def after_commit(self, event_id: str, callback: Callable[[], None]) -> None:
        """From a handler: run ``callback`` once the claim of ``event_id`` committed and was
        acknowledged. Dropped if the batch rolls back or the event is not applied."""
        self._after_commit.append((event_id, callback))

    def take_after_commit(self, applied: set[str]) -> list[Callable[[], None]]:
        """The daemon's side: the callbacks of ``applied`` event ids; forget all the others."""
        taken, self._after_commit = self._after_commit, []
        return [callback for event_id, callback in taken if event_id in applied]

    def pause_when(self, predicate: Callable[[], bool]) -> None:
        """Backpressure: while ``predicate()`` is true the daemon reads nothing new, so entries
        stay in the stream for other consumers instead of piling up behind slow work here."""
        self._pause = predicate

    def paused(self) -> bool:
        """Whether the daemon should hold off reading (see :meth:`pause_when`)."""
        return self._pause is not None and self._pause()

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_type)
