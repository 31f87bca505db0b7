"""Handlers: plain typed functions registered per event type.

A handler receives the claim transaction's connection and the parsed event. Whatever it writes
through that connection commits together with the inbox receipt, inside a savepoint of its own:
if it raises, only its savepoint rolls back, the entry stays pending and is retried.
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

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_type)
