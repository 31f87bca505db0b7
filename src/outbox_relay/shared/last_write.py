"""A transaction whose last write goes out with its ``COMMIT``: one round trip for both.

Why: the relay's steady transaction ends with a one-row write of the lease row (the batch
record, :func:`relay.outgoing.record`) whose result nobody reads; waiting for it and then for
the ``COMMIT`` cost two round trips, each also a wait for a CPU on a busy host. On psycopg,
:meth:`LastWrite.send` puts the connection in pipeline mode just before that write: the write
is sent and not waited for, the Python work after it (building the batch's rows) runs while
the server executes it, and the ``COMMIT`` is queued behind it with one sync, so the commit
reads both results. Elsewhere (SQLite, another driver) nothing changes.

What it guarantees: the transaction is the same one; an error of the last write is raised by
the commit (as the SQLAlchemy error the write would have raised: ``translate_errors`` judges it
the same way) and nothing commits. Only writes whose result is not read may follow
:meth:`LastWrite.send` (a row count or a ``RETURNING`` would read nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine

from outbox_relay.shared import psycopg_driver

if TYPE_CHECKING:
    import psycopg


class LastWrite:
    """The switch of one transaction (:func:`begin_with_last_write`)."""

    def __init__(self, conn: Connection) -> None:
        self._raw = psycopg_driver.connection_of(conn)
        self._manager: AbstractContextManager[psycopg.Pipeline] | None = None

    def send(self) -> None:
        """From here to the commit, statements are sent without waiting for their results
        (psycopg only; idempotent)."""
        if self._raw is not None and self._manager is None:
            manager = self._raw.pipeline()
            manager.__enter__()
            self._manager = manager

    def close(self, failed: bool) -> None:
        """Leave pipeline mode after the commit (or the rollback). After a failure, quietly:
        the error being raised says more, and the driver's text never reaches a log."""
        manager, self._manager = self._manager, None
        if manager is None:
            return
        if failed:
            with suppress(psycopg_driver.error_type()):
                manager.__exit__(None, None, None)
            return
        try:
            manager.__exit__(None, None, None)
        except psycopg_driver.error_type() as err:
            raise psycopg_driver.translated(err) from err


@contextmanager
def begin_with_last_write(engine: Engine) -> Iterator[tuple[Connection, LastWrite]]:
    """``engine.begin()`` with a :class:`LastWrite` for its last statement: yields the
    connection (in its transaction) and the switch; commits at the end of the block (rolls
    back on an exception), then leaves pipeline mode."""
    with engine.connect() as conn:
        last = LastWrite(conn)
        try:
            with conn.begin():
                yield conn, last
        except BaseException:
            last.close(failed=True)
            raise
        last.close(failed=False)

