"""The runs component's table and its own migrations, apart from the core's.

``outbox_runs`` exists only in the databases of applications that use runs: it is created by
``outbox db upgrade --runs`` (or :func:`upgrade`), recorded in its own version table
(``outbox_runs_schema_version``), and every part of the component checks it at start
(:func:`check_schema`: ``schema_not_ready`` naming that command). The core migrations never
touch it.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    text,
)

from outbox_relay.shared import db, db_errors
from outbox_relay.shared.schema import metadata as core_metadata

metadata = MetaData(naming_convention=core_metadata.naming_convention)

runs = Table(
    "outbox_runs",
    metadata,
    Column("id", String(128), primary_key=True),
    Column("revision", BigInteger, nullable=False),
    Column("status", String(32), nullable=False),
    Column("record", Text, nullable=False),
    Column("lease_owner", String(128)),
    Column("lease_expires_at_ms", BigInteger),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("created_at_ms", BigInteger, nullable=False),
    Column("updated_at_ms", BigInteger, nullable=False),
    Index("ix_outbox_runs_status_lease", "status", "lease_expires_at_ms"),
    # The sweeper's query (expired leases) without naming the application's stages.
    Index("ix_outbox_runs_lease_expires_at_ms", "lease_expires_at_ms"),
)

MIGRATIONS = db.Migrations(Path(__file__).with_name("migrations"), "outbox_runs_schema_version",
                           "outbox db upgrade --runs")
"""The runs history (``runs/migrations``), versioned apart from the core's."""


def in_use(engine: Engine) -> bool:
    """True when the runs migrations ever ran here (``outbox db upgrade --runs``)."""
    with db_errors.translate_errors(), engine.connect() as conn:
        return MIGRATIONS.database_revision(conn) is not None


def check_schema(engine: Engine) -> None:
    """Refuse a database whose core or runs schema is behind (or newer than) this code."""
    db.check_schema(engine)
    MIGRATIONS.check(engine)


def upgrade(engine: Engine) -> str:
    """Apply the core's pending migrations, then the runs component's; its head."""
    db.upgrade(engine)
    return MIGRATIONS.upgrade(engine)
