"""Async handlers, run by the one claim implementation.

``async def handler(conn: AsyncConnection, event: Event)`` (and ``async def`` batch handlers)
register like sync ones. The claim's code stays synchronous (consumer/inbox.py decides and
writes, consumer/ordering.py runs the handlers); when a group has async handlers the claim runs
*inside* ``AsyncConnection.run_sync`` on an async engine for the same database (psycopg async
on PostgreSQL, aiosqlite on SQLite). ``run_sync`` runs it in a greenlet whose database calls
are awaited on an event loop; an async handler's coroutine is awaited from there the same way
(SQLAlchemy's ``await_only``), with the :class:`AsyncConnection` of the claim's own
connection. So an async handler's writes are in the claim transaction and in its savepoint
exactly as a sync handler's are, and every guarantee of the claim (receipts, order, retries,
fencing, dead letters) is the same code for both.

Why not a second, async claim: two copies of the decisions would drift (the lease code did).

Each thread that claims with async handlers keeps one event loop and one async engine per
sync engine (an async engine's connections belong to the loop that opened them);
:func:`close` disposes them (the daemon calls it when it stops).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, Protocol, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.util import await_only

from outbox_relay.shared.db import make_async_engine
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import ConfigError

P = ParamSpec("P")
T = TypeVar("T")

_ASYNC_CONNECTION = "outbox_relay.async_connection"


class AsyncHandler(Protocol):
    """``async def handler(conn, event) -> None``; raise to have the entry retried."""

    def __call__(self, conn: AsyncConnection, event: Event, /) -> Awaitable[None]: ...


class AsyncBatchHandler(Protocol):
    """``async def handler(conn, events) -> None``: a batch handler's async form."""

    def __call__(self, conn: AsyncConnection, events: list[Event], /) -> Awaitable[None]: ...


def is_async(handler: object) -> bool:
    """Whether ``handler`` is an ``async def`` function (or an object whose ``__call__`` is)."""
    call = type(handler).__call__ if callable(handler) else None
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)


def awaited(handler: Callable[[AsyncConnection, Any], Awaitable[None]]
            ) -> Callable[[Connection, Any], None]:
    """A sync handler that awaits the async ``handler`` on the claim's own connection (valid
    only inside a claim :func:`run_in_transaction` runs)."""

    def call(conn: Connection, arg: Any, /) -> None:
        await_only(handler(async_connection(conn), arg))

    call.__name__ = getattr(handler, "__name__", "async_handler")
    return call


def async_connection(conn: Connection) -> AsyncConnection:
    """The :class:`AsyncConnection` of the claim running on ``conn``."""
    found = conn.info.get(_ASYNC_CONNECTION)
    if not isinstance(found, AsyncConnection):
        raise ConfigError("an async handler ran outside a claim on an async engine "
                          "(call consumer.inbox.claim, which runs one)")
    return found


def run_in_transaction(
    engine: Engine, fn: Callable[..., T], *args: Any, **kwargs: Any
) -> T:
    """``fn(conn, *args, **kwargs)`` in one transaction on the async engine for ``engine``'s
    database, committed when it returns, rolled back when it raises. Called from sync code in
    a thread without a running event loop (the consumer daemon's, a test's)."""
    local = _state()
    known = local.engines.get(id(engine))
    if known is None or known[0] is not engine:
        if known is not None:  # another engine had that id: it is gone
            local.loop.run_until_complete(known[1].dispose())
        known = (engine, make_async_engine(engine.url.render_as_string(hide_password=False)))
        local.engines[id(engine)] = known
    async_engine = known[1]

    async def go() -> T:
        async with async_engine.begin() as conn:
            conn.info[_ASYNC_CONNECTION] = conn
            try:
                return await conn.run_sync(fn, *args, **kwargs)
            finally:
                conn.info.pop(_ASYNC_CONNECTION, None)

    return local.loop.run_until_complete(go())


def close() -> None:
    """Dispose this thread's async engines and close its event loop (idempotent)."""
    local = getattr(_local, "state", None)
    if local is None:
        return
    _local.state = None
    try:
        for _engine, async_engine in local.engines.values():
            local.loop.run_until_complete(async_engine.dispose())
    finally:
        local.loop.close()


class _State:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.engines: dict[int, tuple[Engine, AsyncEngine]] = {}  # by id of the sync engine


_local = threading.local()


def _state() -> _State:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise ConfigError("a claim with async handlers was called from a running event loop; "
                          "call it from a thread (asyncio.to_thread)")
    state = getattr(_local, "state", None)
    if state is None:
        state = _local.state = _State()
    return state
