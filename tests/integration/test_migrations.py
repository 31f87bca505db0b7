"""The migrations build exactly the reference schema, on both databases."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine

from shared import db
from shared.schema import metadata


def test_migrations_match_reference_schema(engine: Engine) -> None:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": db.VERSION_TABLE})
        diff = compare_metadata(context, metadata)
    assert diff == []
    db.check_schema(engine)
