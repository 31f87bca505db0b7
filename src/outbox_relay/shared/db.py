"""Database engines, schema version checks and the SQL both dialects share.

Driver errors are put in our words by :mod:`shared.db_errors` (installed on every engine
made here).

SQLite is opened the way a durable queue needs it: WAL journal, ``synchronous=FULL``, foreign
keys on, a busy timeout, and ``BEGIN IMMEDIATE`` for every transaction so that two writers
serialize at ``BEGIN`` instead of failing at the first write. PostgreSQL uses psycopg 3.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import (
    BigInteger,
    ColumnClause,
    ColumnElement,
    Connection,
    Delete,
    Engine,
    MetaData,
    bindparam,
    cast,
    create_engine,
    event,
    exc,
    extract,
    func,
    inspect,
    literal_column,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL, CursorResult, Dialect, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.sql.selectable import TableValuedAlias

from outbox_relay.shared.db_errors import name_connect_errors, translate_errors, url_errors
from outbox_relay.shared.errors import (
    ConfigError,
    SchemaNotReadyError,
    SchemaTooNewError,
    UnavailableError,
)
from outbox_relay.shared.redaction import redact_url

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).with_name("migrations")
VERSION_TABLE = "outbox_schema_version"
SQLITE_BUSY_TIMEOUT_MS = 30_000


def now_ms() -> int:
    """Wall-clock epoch milliseconds: the unit of every ``*_ms`` column."""
    return time.time_ns() // 1_000_000


@functools.cache  # built once (immutable): building it took ~0.2 ms of each fence statement
def db_now_ms(postgres: bool) -> ColumnElement[int]:
    """The database's clock in epoch milliseconds, as an SQL expression.

    Times that order delivery (``available_at_ms``) are written and compared with this one
    clock, so a producer or relay host whose clock is off cannot reorder events. PostgreSQL:
    ``clock_timestamp()`` (the real time of the statement, not of its transaction's start).
    SQLite: ``julianday('now')`` (the host's clock, millisecond resolution, fixed within one
    statement; the bundled SQLite 3.40 has no ``unixepoch('subsec')``).
    """
    if postgres:
        epoch_s = extract("epoch", func.clock_timestamp())
        return cast(func.floor(epoch_s * literal_column("1000")), BigInteger)
    days: ColumnElement[float] = literal_column("julianday('now')") - literal_column("2440587.5")
    return cast(func.round(days * literal_column("86400000.0")), BigInteger)


SUPPORTED_BACKENDS = ("sqlite", "postgresql")


ISOLATION = "READ COMMITTED"
"""The isolation level of every PostgreSQL connection :func:`make_engine` and
:func:`make_async_engine` open, whatever the server's or database's
``default_transaction_isolation`` (a keyword argument may still name another).

Why pinned: the relay's and consumer's transactions are built for it. They lock what they
change (``FOR UPDATE SKIP LOCKED``, lease rows, advisory locks) and read what committed
before each statement; under ``REPEATABLE READ`` or ``SERIALIZABLE`` two relays starting
together, a consumer taking over a partition, two pruners or two compare-and-sets of a run
fail with a serialization error instead of waiting for each other (the PostgreSQL
integration suite against a server whose default is ``serializable``: 7 failures, none
with this). SQLite's transactions are serializable by nature (``BEGIN IMMEDIATE``)."""


def make_engine(url: str, *, create: bool = True, **kwargs: Any) -> Engine:
    """A sync engine with our SQLite pragmas or PostgreSQL defaults applied.

    A URL SQLAlchemy cannot parse, of a database we do not support, or whose driver is not
    installed, is a :class:`ConfigError` (never a traceback with the URL in it).
    ``create=False`` (the daemons, the one-shot commands): a SQLite file that is not there is
    refused at connect (``schema_not_ready``, see :func:`_refuse_missing_file`), never created.
    """
    with url_errors(url):
        parsed = _parse(url)
        if parsed.get_backend_name() == "sqlite":
            engine = create_engine(parsed, **kwargs)
            if not create and _sqlite_file(parsed) is not None:
                _refuse_missing_file(engine, parsed.database or "")
            _tune_sqlite(engine)
            name_connect_errors(engine)
            return engine
        # No pool_pre_ping: it costs a round trip per transaction. A dropped connection fails
        # its statement instead, SQLAlchemy invalidates the pool, and every caller retries.
        kwargs.setdefault("connect_args", {"connect_timeout": 10})
        kwargs.setdefault("isolation_level", ISOLATION)
        engine = create_engine(parsed, **kwargs)
        _custom_plans(engine)
        name_connect_errors(engine)
        return engine


def existing_engine(url: str, **kwargs: Any) -> Engine:
    """:func:`make_engine` for a database that must exist already: a SQLite file that is not
    there is ``schema_not_ready`` (naming the file and ``outbox db upgrade``) and is **not**
    created. The one-shot commands open their database this way (not ``db upgrade``, the demo,
    or the daemons, which wait for a database that is not there yet), so ``outbox status`` in
    the wrong directory never leaves an empty ``outbox.db`` behind."""
    with url_errors(url):
        parsed = _parse(url)
    path = _sqlite_file(parsed)
    if path is not None and not path.exists():
        raise _no_file(parsed.database or "")
    return make_engine(url, create=False, **kwargs)


def _parse(url: str) -> URL:
    """The URL parsed, of a database we support (SQLite, PostgreSQL), else ``invalid_config``
    saying so: ``mysql://`` is not supported, however its driver is."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend not in SUPPORTED_BACKENDS:
        raise ConfigError(f"{backend} databases are not supported ({redact_url(url)}); "
                          f"supported: {', '.join(SUPPORTED_BACKENDS)}")
    return parsed


def _sqlite_file(parsed: URL) -> Path | None:
    """The file of a SQLite URL (``None``: not SQLite, in memory, or a ``file:`` URI)."""
    name = parsed.database or ""
    if (parsed.get_backend_name() != "sqlite" or name in ("", ":memory:")
            or name.startswith("file:") or parsed.query.get("uri")):
        return None
    return Path(name)


def _no_file(name: str) -> SchemaNotReadyError:
    return SchemaNotReadyError(f"there is no database file {name}; run `outbox db upgrade` "
                               "(with the same OUTBOX_DATABASE_URL) to create it")


def _refuse_missing_file(engine: Engine, name: str) -> None:
    """Refuse to connect where SQLite would create the file ``name``: only ``db upgrade`` and
    the demo create a database. Checked at every connect, so a daemon that waits at start-up
    finds the file once it is there; a missing *folder* is left to SQLite, which cannot open
    it (``unavailable``, retried: the volume is not mounted yet).

    The folder is looked at first, then the file: a folder that appears with its file in it
    (a volume mounted, a prepared folder moved into place) must never be seen as "file
    missing" because the file was looked for just before the folder appeared (a make test
    run caught that order refusing a database that was there)."""
    path = Path(name)

    @event.listens_for(engine, "do_connect")
    def _check(_dialect: Any, _record: Any, _args: Any, _kwargs: Any) -> None:
        if path.parent.is_dir() and not path.exists():
            raise _no_file(name)


def make_async_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """An async engine (aiosqlite or psycopg async) with the same settings."""
    with url_errors(url):
        parsed = _parse(url)
        if parsed.get_backend_name() == "sqlite":
            parsed = parsed.set(drivername="sqlite+aiosqlite")
            engine = create_async_engine(parsed, **kwargs)
            _tune_sqlite(engine.sync_engine)
            name_connect_errors(engine.sync_engine)
            return engine
        kwargs.setdefault("isolation_level", ISOLATION)
        async_engine = create_async_engine(parsed, **kwargs)
        _custom_plans(async_engine.sync_engine)
        name_connect_errors(async_engine.sync_engine)
        return async_engine


def _custom_plans(engine: Engine) -> None:
    """Plan every statement for its parameters and for the tables as they are now.

    psycopg prepares a statement after five executions, and PostgreSQL may then keep one
    generic plan for it. A plan made while a table was small (a fresh inbox) stays a
    sequential scan until the table's statistics change, and with autovacuum lagging or off
    they never do: measured with ``auto_explain``, the consumer's inbox lookup (≈1 ms for
    500 keys with the index) ran a cached sequential scan per key, 0.35 s per batch at first
    and 6 s a minute later, and the consumer fell minutes behind a steady 1,000 events/s.
    ``plan_cache_mode = force_custom_plan`` keeps the parse of a prepared statement and plans
    each execution afresh (0.1 to 0.2 ms of planning in the `EXPLAIN` output of these queries).
    """

    @event.listens_for(engine, "connect")
    def _set_plan_cache_mode(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("SET plan_cache_mode = force_custom_plan")
        cursor.close()
        dbapi_connection.commit()


def _tune_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the driver, decide when transactions begin.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        _begin_immediate(conn)


def _begin_immediate(conn: Connection) -> None:
    """``BEGIN IMMEDIATE``, waiting for the write lock in 1 ms steps (up to the busy timeout).

    SQLite's own busy handler sleeps in growing steps of up to 100 ms. While other writers keep
    the lock busy most of the time (a steady producer, the consumer's claims), a waiter that
    looks only every 100 ms rarely finds it free and waits seconds: the relay's settle starved
    that way (p50 1.2 s end to end at 1,000 events/s). Looking every millisecond finds the gaps
    between transactions. Statements inside the transaction keep the long busy timeout.
    """
    raw = conn.connection.dbapi_connection
    assert raw is not None
    locked = conn.dialect.loaded_dbapi.OperationalError
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    cursor = raw.cursor()
    try:
        cursor.execute("PRAGMA busy_timeout=1")
        while True:
            try:
                cursor.execute("BEGIN IMMEDIATE")
                break
            except locked as err:
                if "locked" not in str(err) or time.monotonic() >= deadline:
                    raise
    finally:
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.close()


def is_postgres(conn: Connection | Engine) -> bool:
    """True on PostgreSQL (NOTIFY, row locks); False on SQLite."""
    return conn.dialect.name == "postgresql"


def json_recordset(name: str, *columns: ColumnClause[Any]) -> TableValuedAlias:
    """``json_to_recordset(:name) AS given(<columns with types>)`` (PostgreSQL only).

    How a batch's rows reach one set-based statement: the parameter is a list of dicts,
    serialized by ``json.dumps`` and parsed by the server (both in C). Array parameters were
    quoted element by element in Python by psycopg, and ``executemany`` sent one statement
    per row.
    """
    return (
        func.json_to_recordset(bindparam(name, type_=postgresql.JSON))
        .table_valued(*columns)
        .render_derived(name="given", with_types=True)
    )


IN_FLIGHT: dict[str, Any] = {"outbox_in_flight": True}
"""Execution options of a statement whose result nobody reads (a write, a lock): on a
connection in psycopg's pipeline mode (consumer/pipelining.py) it is sent and left in flight,
and its errors are raised when the pipeline is next read. Anywhere else it changes nothing."""


class DriverStatement:
    """A Core statement compiled once for ``Connection.exec_driver_sql``, with the values of
    its literal parameters (a ``LIMIT 1``, a constant): what a hot statement costs in Python
    is then the driver's work alone, not SQLAlchemy's cache lookup and parameter processing.

    On psycopg the parameters named in ``binary`` are sent in binary (``%(name)b``): psycopg's
    text dumper quotes an array element by element in Python, its binary one packs it (500
    strings: ~60 µs instead of ~420 µs, bench/PERFORMANCE.md). Other drivers get the statement
    as compiled. Build one per statement and dialect (``functools.cache``).
    """

    def __init__(self, statement: Any, dialect: Dialect, binary: tuple[str, ...] = ()) -> None:
        compiled = statement.compile(dialect=dialect)
        sql = str(compiled)
        if dialect.driver == "psycopg":  # psycopg 3, sync or async (not psycopg2: no %b)
            for name in binary:
                placeholder = f"%({name})s"
                if placeholder not in sql:
                    raise ValueError(f"no parameter {name!r} in the statement")
                sql = sql.replace(placeholder, f"%({name})b")
        self.sql = sql
        # The literals' values; a bindparam without a value is the caller's to give.
        params = compiled.params
        self.defaults = {name: params[name] for bind, name in compiled.bind_names.items()
                         if not bind.required}
        # A positional driver (SQLite's ``?``) takes the values in the statement's order.
        self.order = tuple(compiled.positiontup or ()) if compiled.positional else None

    def execute(
        self, conn: Connection, params: dict[str, Any], *, in_flight: bool = False
    ) -> CursorResult[Any]:
        """Run it in ``conn``'s transaction with ``params`` (the literal values added);
        ``in_flight``: nobody reads its result (:data:`IN_FLIGHT`)."""
        given = {**self.defaults, **params}
        options = IN_FLIGHT if in_flight else None
        if self.order is None:
            return conn.exec_driver_sql(self.sql, given, execution_options=options)
        return conn.exec_driver_sql(self.sql, tuple(given[name] for name in self.order),
                                    execution_options=options)

    def rows(self, conn: Connection, params: dict[str, Any]) -> Sequence[Any]:
        """Run it like :meth:`execute` and return every row as the driver's own tuple, read
        with one ``fetchall`` of its cursor by SQLAlchemy's fetch strategy: for a hot read of
        many rows (a relay's take, 500 a batch), the Core statement's ``Row``s, read one by one,
        cost ~0.6 µs a row more (bench/PERFORMANCE.md, issue 24).
        The statement, and the fetch, still go through SQLAlchemy: its events see it, and a
        driver error while rows are fetched (SQLite steps through them then) is SQLAlchemy's
        error, as for any statement, never the driver's own."""
        result = self.execute(conn, params)
        return result.cursor_strategy.fetchall(result, result.cursor)  # type: ignore[no-any-return]


def delete_in_batches(
    engine: Engine, statement: Delete, batch: int, max_batches: int | None
) -> tuple[int, bool]:
    """Run a ``DELETE`` that removes at most ``batch`` rows (its own ``LIMIT`` subquery), one
    transaction each, until it removes fewer or ``max_batches`` ran (``None``: no bound).
    Returns ``(rows deleted, more)``: ``more`` when it stopped at the bound after a full batch.
    Retention uses it so no transaction holds many rows, and no pass runs unbounded."""
    total = done = 0
    while max_batches is None or done < max_batches:
        with engine.begin() as conn:
            deleted = int(conn.execute(statement).rowcount or 0)
        total += deleted
        done += 1
        if deleted < batch:
            return total, False
    return total, True


@dataclass(frozen=True)
class Migrations:
    """One Alembic history with its own version table: the core's, or a component's (runs).

    Each history is upgraded and checked on its own, so a component's tables exist only in the
    databases of applications that use it. Its ``env.py`` reads the connection and the version
    table from ``config.attributes``.
    """

    location: Path
    version_table: str
    upgrade_command: str  # what the user runs when the schema is behind

    def config(self, conn: Connection) -> Config:
        """An Alembic config running this history on ``conn``."""
        config = Config()
        config.set_main_option("script_location", str(self.location))
        config.attributes["connection"] = conn
        config.attributes["version_table"] = self.version_table
        return config

    def code_head(self) -> str:
        """The newest migration this code knows."""
        head = ScriptDirectory(str(self.location)).get_current_head()
        assert head is not None
        return head

    def database_revision(self, conn: Connection) -> str | None:
        """The migration the database is at (``None`` when never migrated)."""
        context = MigrationContext.configure(conn, opts={"version_table": self.version_table})
        return context.get_current_revision()

    def current_not_too_new(self, engine: Engine) -> str | None:
        """The database's migration, refusing one this code does not know (a newer release's)."""
        with translate_errors(), engine.connect() as conn:
            return self._not_too_new(self.database_revision(conn))

    def _not_too_new(self, current: str | None) -> str | None:
        known = {s.revision for s in ScriptDirectory(str(self.location)).walk_revisions()}
        if current is not None and current not in known:
            raise SchemaTooNewError(
                f"the database is at schema {current} ({self.version_table}), newer than this "
                f"release (which knows up to {self.code_head()}); upgrade outbox-relay"
            )
        return current

    def check(self, engine: Engine) -> None:
        """Refuse a database that is newer than the code, or not yet migrated to it."""
        current = self.current_not_too_new(engine)
        if current != self.code_head():
            raise SchemaNotReadyError(
                f"the database is at schema {current or 'none'} ({self.version_table}), this "
                f"release needs {self.code_head()}; run `{self.upgrade_command}`"
            )

    def upgrade(self, engine: Engine) -> str:
        """Apply every pending migration; refuse a database newer than the code.

        One transaction that first takes the migration lock (:func:`lock_migrations`), then
        reads the version: two upgrades at once (two deploys, a Job retried while the first
        still runs) serialize, and the second finds the schema current and does nothing.
        """
        try:
            with translate_errors(), engine.begin() as conn:
                lock_migrations(conn)
                self._not_too_new(self.database_revision(conn))
                command.upgrade(self.config(conn), "head")
        except exc.IntegrityError as err:  # a catalog clash: DDL run by something else at once
            log.debug("migration failed: %s", redact_url(str(err)))
            raise UnavailableError("the migration clashed with a concurrent schema change "
                                   f"({self.version_table}); run it again") from None
        return self.code_head()


# The first key of the PostgreSQL advisory lock every upgrade takes ("ob" "mi": outbox
# migrations); the second is the schema's, so databases and schemas migrate independently.
MIGRATION_LOCK_KEY = 0x6F62_6D69


def lock_migrations(conn: Connection) -> None:
    """Hold the migration lock until ``conn``'s transaction ends. PostgreSQL: an advisory
    transaction lock per schema (another upgrade waits here, and says so at INFO). SQLite:
    nothing to do, ``BEGIN IMMEDIATE`` already holds the database's one write lock."""
    if not is_postgres(conn):
        return
    key = text("SELECT pg_try_advisory_xact_lock(:key, hashtext(coalesce(current_schema(), '')))")
    if conn.execute(key, {"key": MIGRATION_LOCK_KEY}).scalar_one():
        return
    log.info("another migration of this schema is running: waiting for it to finish")
    conn.execute(text("SELECT pg_advisory_xact_lock(:key, hashtext(coalesce(current_schema(), "
                      "'')))"), {"key": MIGRATION_LOCK_KEY})


def run_migrations(context: Any, target_metadata: MetaData) -> None:
    """The body of every ``env.py`` of ours (the core's, the runs component's): run on the
    connection and version table :class:`Migrations` passed, batch mode on SQLite."""
    connection = context.config.attributes["connection"]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=context.config.attributes["version_table"],
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


CORE = Migrations(MIGRATIONS, VERSION_TABLE, "outbox db upgrade")
"""The core schema: the outbox, the inbox, leases, trims (``shared/migrations``)."""


def code_head() -> str:
    """The newest core migration this code knows."""
    return CORE.code_head()


def database_revision(conn: Connection) -> str | None:
    """The core migration the database is at (``None`` when never migrated)."""
    return CORE.database_revision(conn)


def check_schema(engine: Engine) -> None:
    """Refuse a database whose core schema is newer than the code, or behind it."""
    CORE.check(engine)


def upgrade(engine: Engine) -> str:
    """Apply every pending core migration; refuse a database newer than the code."""
    return CORE.upgrade(engine)


def table_names(engine: Engine) -> list[str]:
    """Tables present in the database (diagnostics)."""
    with translate_errors():
        return sorted(inspect(engine).get_table_names())
