"""Database errors in our words: a bad URL, a failed connect, an unavailable database.

Three boundaries, each with :class:`shared.errors.OutboxError` leaves and the driver's own
text (which may hold a URL or a statement) sent to the debug log only, redacted:
:func:`url_errors` around parsing a URL (``invalid_config``: unparsable, unsupported, a
driver not installed), :func:`name_connect_errors` on an engine (a failed *connect* names
where and why: ``cannot_connect`` when retrying cannot fix it, else ``unavailable``; a
read-only SQLite file is ``read_only``), and :func:`translate_errors` around every
transaction (``unavailable``). The engines that install them are made in :mod:`shared.db`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine, event, exc
from sqlalchemy.engine import make_url

from outbox_relay.shared.errors import (
    CannotConnectError,
    ConfigError,
    OutboxError,
    ReadOnlyError,
    UnavailableError,
)
from outbox_relay.shared.redaction import redact_url

# The logger these records always had (moved from shared/db.py): operators filter on it.
log = logging.getLogger("outbox_relay.shared.db")


@contextlib.contextmanager
def url_errors(url: str) -> Iterator[None]:
    scheme, _, rest = url.partition("://")
    userinfo = rest.split("?", 1)[0].rpartition("@")[0]
    if not scheme.startswith("sqlite") and ((":" in userinfo and "@" in userinfo)
                                            or "@" in (_host_of(url) or "")):
        # SQLAlchemy ends the password at its first "@": the rest would be taken for the host
        # (also when a "?" before that "@" looked like the start of the query)
        raise ConfigError(f"invalid database URL {redact_url(url)}: percent-encode the "
                          "password (an '@' in it is %40)")
    try:
        yield
    except ImportError as err:  # the driver is not installed: name the extra that brings it
        log.debug("database driver missing: %s", err)
        extra = ("postgres" if url.startswith("postgres")
                 else "sqlite-async" if "aiosqlite" in str(err) else None)
        hint = f" (pip install 'outbox-relay[{extra}]')" if extra else ""
        raise ConfigError(f"the driver for {redact_url(url)} is not installed{hint}") from None
    except (exc.ArgumentError, ValueError) as err:  # ValueError: a bad port
        log.debug("database URL error: %s", redact_url(str(err)))
        raise ConfigError(f"invalid or unsupported database URL {redact_url(url)}") from None


def _host_of(url: str) -> str | None:
    """The host SQLAlchemy reads from ``url`` (None when it cannot parse it)."""
    try:
        return make_url(url).host
    except (exc.ArgumentError, ValueError):
        return None


# Connection failures retrying cannot fix (matched on the driver's text, lower case).
PERMANENT_CONNECT_FAILURES = (
    "does not exist",  # database "x" / role "x" does not exist
    "authentication failed",
    "no password supplied",
    "pg_hba.conf",
    "failed to resolve host",
    "could not translate host name",
    "name or service not known",
    "invalid connection option",
    "invalid dsn",
)


def name_connect_errors(engine: Engine) -> None:
    """A failed *connect* names where and why, redacted: ``cannot connect to PostgreSQL at
    host:5432/db (password hidden): database "x" does not exist``. Failures retrying cannot
    fix (:data:`PERMANENT_CONNECT_FAILURES`) become :class:`CannotConnectError`, the others
    :class:`UnavailableError` (retried). Errors on an open connection are left to
    :func:`translate_errors`."""
    url = engine.url

    @event.listens_for(engine, "handle_error")
    def _on_error(context: Any) -> None:
        if url.get_backend_name() == "sqlite" and _read_only(context.original_exception):
            name = url.database or ":memory:"
            raise ReadOnlyError(f"the SQLite database {name} is read-only: we cannot write to "
                                "it (the file's or its folder's permissions, a read-only "
                                "mount, or mode=ro in the URL)") from None
        if context.connection is not None or context.is_disconnect:
            return  # not a connect: translate_errors says "unavailable"
        reason = _driver_reason(str(context.original_exception))
        if url.get_backend_name() == "sqlite":
            where = f"cannot open the SQLite database {url.database or ':memory:'}"
        else:
            where = (f"cannot connect to PostgreSQL at {url.host or 'localhost'}:"
                     f"{url.port or 5432}/{url.database or ''}"
                     + (" (password hidden)" if url.password else ""))
        message = f"{where}: {reason}" if reason else where
        log.debug("connect error: %s", redact_url(str(context.original_exception)))
        if any(marker in reason.lower() for marker in PERMANENT_CONNECT_FAILURES):
            raise CannotConnectError(message) from None
        raise UnavailableError(message) from None


def _read_only(err: BaseException) -> bool:
    """SQLite's ``SQLITE_READONLY`` family: "attempt to write a readonly database"."""
    code = getattr(err, "sqlite_errorcode", None)
    return (code is not None and code & 0xFF == 8) or "readonly database" in str(err)


def _driver_reason(text: str) -> str:
    """The useful line of a driver's connect error: after libpq's ``FATAL:`` (or the last
    ``failed:``), first line, redacted, bounded."""
    for marker in ("FATAL:", "failed:"):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
            break
    return redact_url(text.strip().split("\n")[0].strip())[:200]


@contextlib.contextmanager
def translate_errors(what: str = "database") -> Iterator[None]:
    """Turn driver errors into :class:`UnavailableError` with our message.

    The driver's text, which may include a URL or a statement, goes to the debug log only.
    ``IntegrityError`` is left alone: callers turn it into a precise code.
    """
    try:
        yield
    except OutboxError:
        raise
    except exc.IntegrityError:
        raise
    except (
        exc.OperationalError,
        exc.InterfaceError,
        exc.DBAPIError,
        exc.TimeoutError,
        exc.PendingRollbackError,
        exc.ResourceClosedError,
    ) as err:
        log.debug("%s error: %s", what, redact_url(str(err)))
        raise UnavailableError(f"the {what} is unavailable or timed out") from err
