"""Our PostgreSQL connections run at READ COMMITTED whatever the database's default.

A database whose ``default_transaction_isolation`` is ``serializable`` (some teams set it for
their own code) made two relays starting together, a consumer takeover, two pruners and two
compare-and-sets of a run fail with serialization errors (the PostgreSQL integration suite
against such a server: 7 failures). :func:`shared.db.make_engine` and
:func:`shared.db.make_async_engine` pin the level (:data:`shared.db.ISOLATION`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from outbox_relay.shared import db
from tests.conftest import PG_ADMIN_URL
from tests.helpers import private_database

pytestmark = pytest.mark.postgresql


@pytest.fixture
def serializable_url() -> Iterator[str]:
    """A database whose default isolation is ``serializable``, created and dropped here."""
    with private_database(PG_ADMIN_URL, "iso",
                          settings={"default_transaction_isolation": "serializable"}) as url:
        yield url


SHOW = text("SHOW transaction_isolation")


def test_a_plain_engine_inherits_the_default_and_ours_does_not(serializable_url: str) -> None:
    plain = create_engine(serializable_url)
    ours = db.make_engine(serializable_url)
    try:
        with plain.begin() as conn:
            assert conn.execute(SHOW).scalar_one() == "serializable"  # the trap is set
        for _ in range(2):  # a pooled connection checked out again keeps it
            with ours.begin() as conn:
                assert conn.execute(SHOW).scalar_one() == "read committed"
    finally:
        plain.dispose()
        ours.dispose()


def test_the_async_engine_pins_it_too(serializable_url: str) -> None:
    async def level() -> str:
        engine = db.make_async_engine(serializable_url)
        try:
            async with engine.begin() as conn:
                return str((await conn.execute(SHOW)).scalar_one())
        finally:
            await engine.dispose()

    assert asyncio.run(level()) == "read committed"


def test_a_level_asked_for_is_kept(serializable_url: str) -> None:
    engine = db.make_engine(serializable_url, isolation_level="REPEATABLE READ")
    try:
        with engine.begin() as conn:
            assert conn.execute(SHOW).scalar_one() == "repeatable read"
    finally:
        engine.dispose()
