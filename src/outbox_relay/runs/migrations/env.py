"""Alembic environment of the runs component: run programmatically, like the core's.

:data:`outbox_relay.runs.schema.MIGRATIONS` passes the connection and the version table
(``outbox_runs_schema_version``, apart from the core's) in ``config.attributes``.
"""

from __future__ import annotations

from alembic import context

from outbox_relay.runs.schema import metadata
from outbox_relay.shared.db import run_migrations

run_migrations(context, metadata)
