"""Alembic environment: always run programmatically with a live connection.

``shared.db.Migrations`` passes the connection and the version table in ``config.attributes``,
so the migrations use the same engine settings (SQLite pragmas, PostgreSQL URL) as the daemons.
"""

from __future__ import annotations

from alembic import context

from outbox_relay.shared.db import run_migrations
from outbox_relay.shared.schema import metadata

run_migrations(context, metadata)
