"""Handlers' one-row inserts sent without waiting (psycopg's pipeline mode) and kept to be
sent together.

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

Such inserts are also **kept**: consecutive ones of the same text (each handler of the
batch writing its one row) are not sent one by one but kept, and sent as one psycopg
``executemany`` (still in the pipeline, one message per row) when another statement comes, and
at the batch's end. A handler's insert then costs SQLAlchemy's execute but not psycopg's (the
cursor's query conversion, its send and the pipeline's poll: a third of a one-row handler's
claim, ``bench/PERFORMANCE.md``). Nothing a handler can observe changes: every other statement
(a read, a savepoint, another table's insert, the claim's own writes) first sends what is kept,
so the database sees the statements in the order the handlers ran them; a handler that leaves
by an exception has its kept rows dropped with the batch's savepoint. (Statements a handler
sends on the driver's own connection, under SQLAlchemy, are not seen: such a handler needs
``Handlers(pipeline=False)``.)

When an insert fails, its error is raised at the next statement that waits, or at the end of
the batch, so which handler failed is not known (a kept insert's as :class:`KeptInsertFailed`,
which a handler's ``except IntegrityError`` does not match, raised again after a handler that
caught it and at the end): the caller redoes the batch with a savepoint
per handler and no pipeline (the outcomes are those of that path, as for any failure on the
optimistic path). A handler that catches a database error of its own insert therefore sees it
only in that redo. ``Handlers(pipeline=False)`` turns it all off for a group.

**Async handlers** (the claim on an async engine: psycopg's async connection, aiosqlite;
consumer/async_handlers.py) keep their plain inserts the same way, on both databases, but the
connection is never put in pipeline mode (SQLAlchemy's async cursor reads a statement's rows as
soon as it is sent, before a pipeline could have them): what is kept is sent with one
``executemany`` (which psycopg pipelines: one round trip; aiosqlite: one hop to its thread)
before the next other statement and at the batch's end. So an async one-row handler neither
waits a round trip (or a thread hop) per event nor awaits the driver at all for its insert,
and what it reads is the same. On SQLite only Core inserts are kept (a handler may read a
text insert's ``lastrowid``, which only its own cursor has). Sync handlers on SQLite run as
before (SQLite's own ``execute`` is a C call in this thread: nothing to save).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, event, exc
from sqlalchemy.util import await_only

from outbox_relay.shared import psycopg_driver
from outbox_relay.shared.db import is_postgres

if TYPE_CHECKING:
    import psycopg


class KeptInsertFailed(Exception):
    """Kept inserts failed when they were sent: which handler's insert it was is not known
    (any earlier handler of the batch). Deliberately not a ``DBAPIError``: a handler that
    catches ``IntegrityError`` around its own statement must not take it for its own (the
    claim redoes the batch with a savepoint per handler, where each insert fails as itself).
    ``error``: the SQLAlchemy error the driver's was translated to."""

    def __init__(self, error: exc.DBAPIError) -> None:
        super().__init__(f"an insert kept on the optimistic path failed when it was sent "
                         f"({type(error).__name__}); the batch is claimed again")
        self.error = error


class _InFlight:
    """One claim connection on the optimistic path: its pipeline (sync psycopg; None: an
    async driver, which only keeps), and the plain inserts kept to be sent together
    (``statement``: their text; ``rows``: their parameters, in the handlers' order);
    ``failed``: what sending them raised, raised again at the end even if a handler caught
    it; ``core_only``: keep only Core inserts (SQLite: a text insert's handler may read the
    cursor's ``lastrowid``)."""

    __slots__ = ("core_only", "dbapi", "error", "failed", "pipeline", "rows", "statement")

    def __init__(self, conn: Connection, pipeline: psycopg.Pipeline | None) -> None:
        self.pipeline = pipeline
        # The DBAPI connection SQLAlchemy uses (its adapter over an async driver, whose
        # cursor awaits each call itself), and the driver's error root.
        self.dbapi: Any = conn.connection.dbapi_connection
        self.error: type[Exception] = conn.dialect.loaded_dbapi.Error
        self.core_only = not is_postgres(conn)
        self.failed: KeptInsertFailed | None = None
        self.statement: str | None = None
        self.rows: list[Any] = []

    def keeps(self, statement: str, context: Any, executemany: bool) -> bool:
        """Whether the statement is kept instead of sent (see the module docstring)."""
        if executemany or context is None or not _plain(statement):
            return False
        options = context.execution_options
        if options.get("outbox_in_flight") or options.get("no_parameters"):
            return False  # the claim's own; or SQLAlchemy sends it without parameters
        if getattr(context.compiled, "postfetch_lastrowid", False):
            return False  # SQLAlchemy reads the new row's key from this cursor (lastrowid)
        return not self.core_only or bool(context.isinsert)

    def send_kept(self) -> None:
        """Send the kept inserts: one ``executemany`` (in the pipeline: nothing waits; on an
        async driver, awaited: psycopg pipelines it, one round trip). An error the driver
        raises is raised as :class:`KeptInsertFailed` (and remembered in ``failed``)."""
        if not self.rows:
            return
        statement, rows = self.statement, self.rows
        self.statement, self.rows = None, []
        cursor = self.dbapi.cursor()
        try:
            if len(rows) == 1:
                cursor.execute(statement, rows[0])
            else:
                cursor.executemany(statement, rows)
        except self.error as err:
            wrapped = exc.DBAPIError.instance(None, None, err, self.error)
            assert isinstance(wrapped, exc.DBAPIError)
            self.failed = KeptInsertFailed(wrapped)
            raise self.failed from wrapped
        finally:
            with suppress(self.error):
                cursor.close()


# id() of a claim's SQLAlchemy connection on the optimistic path -> its state. Read by the
# cursor hooks of every statement of an engine that pipelined once; a dict lookup when the
# connection is not.
_ACTIVE: dict[int, _InFlight] = {}


class Pipelined:
    """The optimistic path's pipeline on one connection (``on`` False: none was opened)."""

    def __init__(self, state: _InFlight | None = None, key: int = 0,
                 manager: AbstractContextManager[psycopg.Pipeline] | None = None) -> None:
        self._state, self._key, self._manager = state, key, manager
        self.done = state is None

    @property
    def on(self) -> bool:
        """Inserts may be kept (or in flight): what :meth:`finish` raises names no handler."""
        return self._state is not None

    @property
    def failed(self) -> KeptInsertFailed | None:
        """Kept inserts failed when sent (raised into a handler, which may have caught it)."""
        return self._state.failed if self._state is not None else None

    @property
    def pipelining(self) -> bool:
        """The connection is in pipeline mode: a database error raised in a handler may be
        an earlier handler's insert in flight (its own statements' are then not known)."""
        return self._state is not None and self._state.pipeline is not None

    def finish(self) -> None:
        """Send the kept inserts, wait for every result still in flight and leave pipeline
        mode (one round trip: psycopg's own end of the pipeline, a sync); an insert's failure
        raises here: a kept one's as :class:`KeptInsertFailed` (also when it was raised into
        a handler earlier, which caught it), one in flight as the SQLAlchemy error a handler
        would have seen. Statements after it in the block are not pipelined."""
        if self.done:
            return
        self.done = True
        assert self._state is not None
        _ACTIVE.pop(self._key, None)
        try:
            self._state.send_kept()
            if self._state.failed is not None:
                raise self._state.failed
            if self._manager is not None:
                self._manager.__exit__(None, None, None)
        except psycopg_driver.error_type() as err:
            raise psycopg_driver.translated(err) from err
        except BaseException:
            self.drop()
            raise

    def drop(self) -> None:
        """Leave pipeline mode without sending what is kept (the block failed: the caller
        rolls the savepoint back), reading the results in flight quietly (their errors are
        the redo's to find again; the exception being raised says more, and a lost
        connection raises again)."""
        self.done = True
        assert self._state is not None
        _ACTIVE.pop(self._key, None)
        self._state.rows = []
        if self._manager is not None:
            with suppress(psycopg_driver.error_type()):
                self._manager.__exit__(None, None, None)


@contextmanager
def pipelined(conn: Connection, enabled: bool = True) -> Iterator[Pipelined]:
    """Put ``conn`` in pipeline mode for the block when it is a sync psycopg connection and
    ``enabled`` (an async one only keeps plain inserts); yield a :class:`Pipelined` (off
    otherwise). Call its ``finish()`` at the end
    of the block; leaving the block by an exception drops whatever was still in flight
    (the caller rolls the savepoint back), quietly: the driver's text never reaches a log."""
    raw = psycopg_driver.pipelining_connection(conn) if enabled and is_postgres(conn) else None
    if not enabled or (raw is None and not conn.dialect.is_async):
        yield Pipelined(None)
        return
    _listen(conn.engine)
    manager: AbstractContextManager[psycopg.Pipeline] | None = None
    if raw is not None:
        manager = raw.pipeline()
        state = _InFlight(conn, manager.__enter__())
    else:
        state = _InFlight(conn, None)
    _ACTIVE[id(conn)] = state
    handle = Pipelined(state, id(conn), manager)
    try:
        yield handle
    except BaseException:
        if not handle.done:
            handle.drop()
        raise
    handle.finish()


def _listen(engine: Engine) -> None:
    if not event.contains(engine, "after_cursor_execute", _after_cursor_execute):
        event.listen(engine, "before_cursor_execute", _before_cursor_execute)
        event.listen(engine, "do_execute", _do_execute)
        event.listen(engine, "after_cursor_execute", _after_cursor_execute)


def _before_cursor_execute(conn: Connection, cursor: Any, statement: str, parameters: Any,
                           context: Any, executemany: bool) -> None:
    """Before any statement but the next of the kept inserts: send the kept ones first, so
    the database sees every statement in the order it was run."""
    state = _ACTIVE.get(id(conn))
    if state is not None and state.rows and (statement != state.statement
                                             or not state.keeps(statement, context,
                                                                executemany)):
        state.send_kept()


def _do_execute(cursor: Any, statement: str, parameters: Any, context: Any) -> bool:
    """Keep a plain one-row insert of a handler instead of sending it (True: SQLAlchemy
    takes the statement as executed); it is sent with the next ones of the same text."""
    state = _ACTIVE.get(id(context.root_connection))
    if state is None or not state.keeps(statement, context, False):
        return False
    state.statement = statement
    # A copy: a handler may run ``exec_driver_sql`` again with the same dict, changed (a
    # shallow one: a list or dict value changed after the call changes the kept row).
    state.rows.append(dict(parameters) if isinstance(parameters, dict) else tuple(parameters))
    context._rowcount = 1  # what the insert reports once it succeeded (else: redone)
    if state.pipeline is None:
        # An async driver: SQLAlchemy's AsyncConnection.execute insists that the statement
        # awaited something (AwaitRequired otherwise): one await that completes at once, no
        # event loop turn.
        await_only(_nothing())
    return True


async def _nothing() -> None:
    return None


def _after_cursor_execute(conn: Connection, cursor: Any, statement: str, parameters: Any,
                          context: Any, executemany: bool) -> None:
    """Runs after each statement is sent (or kept) and before SQLAlchemy reads its result:
    lets a plain one-row insert stay in flight, makes every other statement wait for its
    results."""
    state = _ACTIVE.get(id(conn))
    if state is None or state.pipeline is None or _in_flight(context):
        return  # nothing in flight; or the claim's own statement, whose result nobody reads
    if not executemany and _plain(statement):
        if context is not None:
            context._rowcount = 1  # what the insert reports once it succeeded (else: redone)
        return
    state.pipeline.sync()


def _in_flight(context: Any) -> bool:
    return context is not None and bool(context.execution_options.get("outbox_in_flight"))


_PLAIN: dict[str, bool] = {}
"""Each statement text's :data:`_PLAIN_INSERT` match, remembered (a handler runs the same few
texts again and again); bounded by :func:`_plain`."""


def _plain(statement: str) -> bool:
    plain = _PLAIN.get(statement)
    if plain is None:
        if len(_PLAIN) >= 1024:
            _PLAIN.clear()
        plain = _PLAIN[statement] = _PLAIN_INSERT.match(statement) is not None
    return plain


_PLAIN_INSERT = re.compile(
    r"""\s*INSERT\s+INTO\s+[\w."]+\s*(\([\w\s,."]*\))?\s*VALUES\s*"""
    r"""\((?:[^()';]|%\(\w+\)s)*\)\s*;?\s*\Z""",
    re.IGNORECASE,
)
"""The text of a one-row ``INSERT INTO <table> [(<columns>)] VALUES (<parameters>)``, as
SQLAlchemy sends it (Core or ``text()``: ``%(name)s`` placeholders): no ``RETURNING``, ``ON
CONFLICT`` or ``SELECT``, one row of plain values (a function call's parentheses, a quoted
literal, a second row: not plain, the statement waits — slower, never wrong)."""
