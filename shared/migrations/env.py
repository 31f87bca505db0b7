"""Alembic environment: always run programmatically with a live connection.

``shared.db.Migrations`` passes the connection and the version table in ``config.attributes``,
so the migrations use the same engine settings (SQLite pragmas, PostgreSQL URL) as the daemons.
"""

from __future__ import annotations

from alembic import context

from outbox_relay.shared.schema import metadata

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=context.config.attributes["version_table"],
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
