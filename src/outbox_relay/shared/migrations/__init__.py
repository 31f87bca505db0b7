"""Alembic migrations of the outbox schema (version table ``outbox_schema_version``)."""
