"""outbox-relay: a transactional outbox to Redis Streams, with consumers that apply each event
once, in order per aggregate.

This package is the one import a service needs::

    from outbox_relay import Producer, Handlers, Event, OutboxError

``Producer.enqueue`` writes an event in the caller's SQLAlchemy transaction; ``Handlers`` holds
the functions ``outbox consume --app module:handlers`` runs for each event type, inside the
consumer's claim transaction; ``Event`` is what a handler receives; every error is an
``OutboxError`` with a stable ``code``. Durable runs are a component of their own, imported
only by applications that use them: ``from outbox_relay.runs import Pipeline, Runs``. The
components live below it (``outbox_relay.producer``, ``.relay``, ``.consumer``, ``.runs``,
``.shared``, ``.cli``); what is not re-exported here or in ``outbox_relay.runs`` is not part of
the public API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from outbox_relay.consumer.handlers import BatchHandler, Handler, Handlers
from outbox_relay.consumer.retry import PermanentError, Reject, Retry
from outbox_relay.producer.enqueue import Producer
from outbox_relay.shared.db import make_async_engine, make_engine, upgrade
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import (
    CannotConnectError,
    ConfigError,
    ConflictError,
    DuplicateEventError,
    InvalidEventError,
    LeaseLostError,
    NotFoundError,
    OutboxError,
    SchemaNotReadyError,
    SchemaTooNewError,
    UnavailableError,
)
from outbox_relay.shared.settings import CommonSettings, ConsumerSettings, RelaySettings

if TYPE_CHECKING:
    from outbox_relay.runs.errors import IdempotencyConflictError

__all__ = [
    "BatchHandler",
    "CannotConnectError",
    "CommonSettings",
    "ConfigError",
    "ConflictError",
    "ConsumerSettings",
    "DuplicateEventError",
    "Event",
    "Handler",
    "Handlers",
    "IdempotencyConflictError",
    "InvalidEventError",
    "LeaseLostError",
    "NotFoundError",
    "OutboxError",
    "PermanentError",
    "Producer",
    "Reject",
    "RelaySettings",
    "Retry",
    "SchemaNotReadyError",
    "SchemaTooNewError",
    "UnavailableError",
    "make_async_engine",
    "make_engine",
    "upgrade",
]


def __getattr__(name: str) -> object:
    """``IdempotencyConflictError``, a runs error exported here before runs had an ``errors``
    module of their own (:mod:`outbox_relay.runs.errors`): still importable from here, but loaded
    only when asked for, so that ``import outbox_relay`` does not import the runs component."""
    if name == "IdempotencyConflictError":
        from outbox_relay.runs.errors import IdempotencyConflictError

        return IdempotencyConflictError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
