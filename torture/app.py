"""Handlers of the torture consumer group: each applied event leaves one side-effect row.

The ``torture_effects`` table deliberately has **no** unique constraint: if the inbox ever let an
event through twice, two rows would show it. The row is written through the claim transaction's
connection, so it commits together with the inbox receipt or not at all.

Loaded with ``outbox consume --app torture.app:handlers``.
"""

from __future__ import annotations

import os

from sqlalchemy import BigInteger, Column, Connection, Engine, Integer, MetaData, String, Table

from consumer import Handlers
from shared.db import now_ms
from shared.envelope import Event
from shared.settings import ConsumerSettings

metadata = MetaData()

effects = Table(
    "torture_effects",
    metadata,
    Column("event_id", String(512), nullable=False),  # no unique constraint, on purpose
    Column("group_name", String(64), nullable=False),
    Column("event_type", String(256), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
)


def create_tables(engine: Engine) -> None:
    """Create ``torture_effects`` (idempotent)."""
    metadata.create_all(engine)


def handlers(settings: ConsumerSettings) -> Handlers:
    """Every event type: record one effect row in the claim transaction."""
    group = settings.group

    def record(conn: Connection, event: Event) -> None:
        conn.execute(
            effects.insert().values(
                event_id=event.id, group_name=group, event_type=event.type,
                pid=os.getpid(), created_at_ms=now_ms(),
            )
        )

    registry = Handlers()
    registry.register("*", record)
    return registry
