"""``enqueue_async`` in an ``AsyncConnection`` / ``AsyncSession`` (aiosqlite, psycopg async)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from outbox_relay.producer import Producer
from outbox_relay.shared import db
from outbox_relay.shared.errors import DuplicateEventError, InvalidEventError
from outbox_relay.shared.schema import outbox

pytestmark = pytest.mark.integration


def run_async(database_url: str, body: Callable[[AsyncEngine], Awaitable[None]]) -> None:
    """Run ``body`` with an async engine on the test database, disposing it afterwards."""

    async def main() -> None:
        engine = db.make_async_engine(database_url)
        try:
            await body(engine)
        finally:
            await engine.dispose()

    asyncio.run(main())


def event_ids(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.execute(select(outbox.c.event_id)).scalars())


def enqueue_kwargs(revision: int) -> dict[str, object]:
    return {"type": "thing.happened", "stream": "things", "data": {"r": revision},
            "aggregate_type": "thing", "aggregate_id": "thing-1", "revision": revision}


def test_async_connection_commit_rollback_and_duplicate(
    engine: Engine, database_url: str
) -> None:
    producer = Producer()

    async def body(aengine: AsyncEngine) -> None:
        async with aengine.begin() as conn:
            assert await producer.enqueue_async(conn, **enqueue_kwargs(1)) == (
                "thing-1:thing.happened:1")
            with pytest.raises(DuplicateEventError) as info:
                await producer.enqueue_async(conn, **enqueue_kwargs(1))
            assert info.value.code == "duplicate_event"
            await producer.enqueue_async(conn, **enqueue_kwargs(2))  # still usable
        async with aengine.connect() as conn:
            await conn.begin()
            await producer.enqueue_async(conn, **enqueue_kwargs(3))
            await conn.rollback()
        async with aengine.begin() as conn:
            with pytest.raises(InvalidEventError) as bad:
                await producer.enqueue_async(conn, **{**enqueue_kwargs(4), "revision": -1})
            assert bad.value.code == "bad_revision"

    run_async(database_url, body)
    assert event_ids(engine) == ["thing-1:thing.happened:1", "thing-1:thing.happened:2"]


def test_async_session_commit_and_rollback(engine: Engine, database_url: str) -> None:
    producer = Producer()

    async def body(aengine: AsyncEngine) -> None:
        async with AsyncSession(aengine) as session, session.begin():
            await producer.enqueue_async(session, **enqueue_kwargs(1))
            with pytest.raises(DuplicateEventError):
                await producer.enqueue_async(session, **enqueue_kwargs(1))
        async with AsyncSession(aengine) as session:
            await session.begin()
            await producer.enqueue_async(session, **enqueue_kwargs(2))
            await session.rollback()

    run_async(database_url, body)
    assert event_ids(engine) == ["thing-1:thing.happened:1"]
