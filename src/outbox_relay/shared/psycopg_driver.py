"""psycopg when it is installed, and the psycopg connection under a SQLAlchemy one.

Why a module: the PostgreSQL driver is an extra (``outbox-relay[postgres]``); a SQLite-only
install has no psycopg, and must still import every module, run ``outbox`` and the daemons.
Whatever uses psycopg's own features (pipeline mode: :mod:`consumer.pipelining`, the relay's
take and settle in :mod:`relay.store`) asks here,
and gets None where no psycopg connection can exist or the feature is missing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from types import ModuleType
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc

if TYPE_CHECKING:
    import psycopg


@functools.cache
def module() -> ModuleType | None:
    """``psycopg``, or None when it is not installed (asked once)."""
    try:
        import psycopg
    except ImportError:
        return None
    return psycopg


class _NeverRaised(Exception):
    """What :func:`error_type` answers without psycopg: no psycopg error can be raised then."""


def error_type() -> type[Exception]:
    """``psycopg.Error``, for an ``except`` clause that must also compile without psycopg."""
    pg = module()
    return _NeverRaised if pg is None else pg.Error


@functools.cache
def _pipeline_supported() -> bool:
    pg = module()
    return pg is not None and bool(pg.Pipeline.is_supported())


def pipelining_connection(conn: Connection) -> psycopg.Connection[Any] | None:
    """The sync psycopg connection under ``conn`` when it can enter pipeline mode; None for
    any other driver (SQLite, psycopg's async connection), a closed connection, a libpq older
    than 14 (psycopg would raise ``NotSupportedError``, its own text, on entering), or when
    psycopg is not installed."""
    pg = module()
    if pg is None or not _pipeline_supported():
        return None
    try:
        raw = conn.connection.driver_connection
    except sa_exc.SQLAlchemyError:
        return None
    return raw if isinstance(raw, pg.Connection) else None


def translated(err: Exception) -> sa_exc.DBAPIError:
    """The SQLAlchemy error SQLAlchemy itself raises for the psycopg error ``err``
    (``IntegrityError``, ``OperationalError`` …): what a statement run through SQLAlchemy
    would have raised, so callers judge it the same way."""
    wrapped = sa_exc.DBAPIError.instance(None, None, err, error_type())
    assert isinstance(wrapped, sa_exc.DBAPIError)
    return wrapped


@contextmanager
def pipeline(raw: psycopg.Connection[Any]) -> Iterator[psycopg.Pipeline]:
    """``raw`` in psycopg's pipeline mode for the block (its statements sent without waiting,
    read after a ``sync()``), left quietly: when the block raises, psycopg's own exit would
    log what ending the pipeline failed with (a lost connection's text, the connection's
    host, user and database) at WARNING on its logger; here that second error is dropped and
    the block's own is raised. A block that ends normally waits for every result still in
    flight, and a statement's error raises here, as psycopg's error."""
    manager = raw.pipeline()
    pipe = manager.__enter__()
    try:
        yield pipe
    except BaseException:
        with suppress(error_type()):
            manager.__exit__(None, None, None)
        raise
    manager.__exit__(None, None, None)
