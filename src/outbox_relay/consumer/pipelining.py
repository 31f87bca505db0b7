"""Handlers' one-row inserts sent without waiting, on PostgreSQL (psycopg's pipeline mode).

Why: a handler that writes one row per event waited one round trip per event, most of a
claim's time with such a handler (``bench/PERFORMANCE.md``, issue 23). On the optimistic path
(every handler of the batch under one savepoint, :func:`consumer.ordering.decide_batch`) the
claim's connection is put in pipeline mode, so such inserts are sent and the next handler runs
at once; the batch's results are read at its end (:meth:`Pipelined.finish`).

The claim itself uses it too, for its own statements whose results it does not read (run
with :data:`shared.db.IN_FLIGHT`): its advisory locks go with its lookup, and its writes
(receipts, heads, retries) go together before the commit, one round trip each instead of one
per statement (consumer/inbox.py, consumer/claim_writes.py).

What is left in flight of a handler's statements: only a plain one-row ``INSERT … VALUES``
without ``RETURNING``, ``ON CONFLICT`` or ``SELECT`` (:data:`_PLAIN_INSERT`; Core or
``text()``): its result says nothing a handler could read but its row count, which is 1 when
it succeeds, and is reported so. Every other
statement — a ``SELECT``, an ``UPDATE`` or ``DELETE`` whose row count a handler reads, an
insert returning its generated key, ``ON CONFLICT``, ``executemany``, text SQL, a savepoint —
waits for every result before the handler gets its own: it reads exactly what it would read
without pipelining, the pipelined inserts before it included.

When an insert fails, its error is raised at the next statement that waits, or at the end of
the batch, so which handler failed is not known: the caller redoes the batch with a savepoint
per handler and no pipeline (the outcomes are those of that path, as for any failure on the
optimistic path). A handler that catches a database error of its own insert therefore sees it
only in that redo. Sync handlers on PostgreSQL only: async handlers (an async engine) and
SQLite run as before. ``Handlers(pipeline=False)`` turns it off for a group.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, event

from outbox_relay.shared import psycopg_driver
from outbox_relay.shared.db import is_postgres

if TYPE_CHECKING:
    import psycopg

# id() of a psycopg connection in pipeline mode -> its pipeline. Read by the cursor hook of
# every statement of an engine that pipelined once; a dict lookup when the connection is not.
_ACTIVE: dict[int, psycopg.Pipeline] = {}


class Pipelined:
    """The optimistic path's pipeline on one connection (``on`` False: none was opened)."""

    def __init__(self, pipeline: psycopg.Pipeline | None = None, raw: Any = None,
                 manager: AbstractContextManager[psycopg.Pipeline] | None = None) -> None:
        self._pipeline, self._raw, self._manager = pipeline, raw, manager
        self.done = pipeline is None

    @property
    def on(self) -> bool:
        return self._pipeline is not None

    def finish(self) -> None:
        """Wait for every result still in flight and leave pipeline mode (one round trip:
        psycopg's own end of the pipeline, a sync); an insert's failure raises here, as the
        SQLAlchemy error a handler would have seen (so the claim judges it the same way).
        Statements after it in the block are not pipelined."""
        if self.done:
            return
        self.done = True
        _ACTIVE.pop(id(self._raw), None)
        assert self._manager is not None
        try:
            self._manager.__exit__(None, None, None)
        except psycopg_driver.error_type() as err:
            raise psycopg_driver.translated(err) from err


@contextmanager
def pipelined(conn: Connection, enabled: bool = True) -> Iterator[Pipelined]:
    """Put ``conn`` in pipeline mode for the block when it is a sync psycopg connection and
    ``enabled``; yield a :class:`Pipelined` (off otherwise). Call its ``finish()`` at the end
    of the block; leaving the block by an exception drops whatever was still in flight
    (the caller rolls the savepoint back), quietly: the driver's text never reaches a log."""
    raw = psycopg_driver.pipelining_connection(conn) if enabled and is_postgres(conn) else None
    if raw is None:
        yield Pipelined(None)
        return
    _listen(conn.engine)
    manager: AbstractContextManager[psycopg.Pipeline] = raw.pipeline()
    pipeline = manager.__enter__()
    _ACTIVE[id(raw)] = pipeline
    handle = Pipelined(pipeline, raw, manager)
    try:
        yield handle
    except BaseException:
        if not handle.done:
            handle.done = True
            _ACTIVE.pop(id(raw), None)
            # Leave pipeline mode reading the results in flight (their errors are the redo's
            # to find again); the exception being raised says more (a lost connection raises
            # again).
            with suppress(psycopg_driver.error_type()):
                manager.__exit__(None, None, None)
        raise
    handle.finish()


def _listen(engine: Engine) -> None:
    if not event.contains(engine, "after_cursor_execute", _after_cursor_execute):
        event.listen(engine, "after_cursor_execute", _after_cursor_execute)


def _after_cursor_execute(conn: Connection, cursor: Any, statement: str, parameters: Any,
                          context: Any, executemany: bool) -> None:
    """Runs after each statement is sent and before SQLAlchemy reads its result: lets a
    plain one-row insert stay in flight, makes every other statement wait for its results."""
    pipeline = _ACTIVE.get(id(cursor.connection))
    if pipeline is None:
        return
    if context is not None and context.execution_options.get("outbox_in_flight"):
        return  # the claim's own statement: nobody reads its result (shared.db.IN_FLIGHT)
    if not executemany and _PLAIN_INSERT.match(statement):
        if context is not None:
            context._rowcount = 1  # what the insert reports once it succeeded (else: redone)
        return
    pipeline.sync()


_PLAIN_INSERT = re.compile(
    r"""\s*INSERT\s+INTO\s+[\w."]+\s*(\([\w\s,."]*\))?\s*VALUES\s*"""
    r"""\((?:[^()';]|%\(\w+\)s)*\)\s*;?\s*\Z""",
    re.IGNORECASE,
)
"""The text of a one-row ``INSERT INTO <table> [(<columns>)] VALUES (<parameters>)``, as
SQLAlchemy sends it (Core or ``text()``: ``%(name)s`` placeholders): no ``RETURNING``, ``ON
CONFLICT`` or ``SELECT``, one row of plain values (a function call's parentheses, a quoted
literal, a second row: not plain, the statement waits — slower, never wrong)."""
