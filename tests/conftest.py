"""Fixtures shared by every test layer.

Isolation rules: never flush or stop the shared Redis/PostgreSQL. Each test gets its own Redis
key prefix (deleted afterwards by SCAN, never FLUSHDB) and, on PostgreSQL, its own schema in the
``test`` database (dropped afterwards); on SQLite its own file.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import Engine, create_engine, text

from outbox_relay.runs import schema as runs_schema
from outbox_relay.shared import db
from outbox_relay.shared.redis_conn import connect_redis

REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_ADMIN_URL = os.environ.get(
    "OUTBOX_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def pg_schema_url(schema: str) -> str:
    """A URL whose connections use ``schema`` as their search path."""
    return f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"


@pytest.fixture
def key_prefix() -> str:
    """A Redis key prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def redis_client(key_prefix: str) -> Iterator[redis.Redis]:
    """The real Redis; every key under this test's prefix is deleted afterwards."""
    client = connect_redis(REDIS_URL)  # OUTBOX_TEST_REDIS_URL may name a Redis Cluster
    yield client
    for key in client.scan_iter(match=f"{key_prefix}:*", count=1000):
        client.delete(key)
    client.close()


# The PostgreSQL parameter carries the ``postgresql`` marker: ``-m "not postgresql"`` (as
# ``make check`` does) keeps the SQLite half of every test parametrized over databases.
@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def database_url(request: pytest.FixtureRequest, tmp_path: object) -> Iterator[str]:
    """A fresh, empty database of each kind (SQLite file / PostgreSQL schema)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/outbox.db"
        return
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield pg_schema_url(schema)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """A migrated engine on :func:`database_url`."""
    eng = db.make_engine(database_url)
    db.upgrade(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def runs_tables(engine: Engine) -> Engine:
    """:func:`engine` with the runs component's tables too (``outbox db upgrade --runs``)."""
    runs_schema.MIGRATIONS.upgrade(engine)
    return engine


@pytest.fixture
def sqlite_engine(tmp_path: object) -> Iterator[Engine]:
    """A migrated SQLite engine, for fast unit tests."""
    eng = db.make_engine(f"sqlite:///{tmp_path}/unit.db")
    db.upgrade(eng)
    yield eng
    eng.dispose()
