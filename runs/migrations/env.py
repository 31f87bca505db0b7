"""Alembic environment of the runs component: run programmatically, like the core's.

:data:`outbox_relay.runs.schema.MIGRATIONS` passes the connection and the version table
(``outbox_runs_schema_version``, apart from the core's) in ``config.attributes``.
"""

from __future__ import annotations

from alembic import context

from outbox_relay.runs.schema import metadata

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=context.config.attributes["version_table"],
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
