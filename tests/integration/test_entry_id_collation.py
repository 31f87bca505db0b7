"""Lookups by entry id give the same answers whatever the PostgreSQL database's collation.

Entry ids are compared as text in SQL (ranges over the stream-entry index). The shared test
server's databases are ``C.UTF-8``, where text order is byte order; many production databases
are ``en_US.UTF-8`` (glibc), whose collation ignores punctuation at first: ``"…-10" < "…."``
is false there. The database here reproduces that with ICU's ``en-u-ka-shifted`` (the same
rule; PostgreSQL 15 can make it a database's default), created and dropped by the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, insert, text

from outbox_relay.relay import repair_store
from outbox_relay.shared import db
from outbox_relay.shared.schema import outbox, stream_trims
from tests.conftest import PG_ADMIN_URL
from tests.helpers import SHIFTED, private_database

pytestmark = pytest.mark.postgresql

MS = "1796104715540"


@pytest.fixture
def shifted_engine() -> Iterator[Engine]:
    """A migrated database whose default collation ignores punctuation at the first level."""
    with private_database(PG_ADMIN_URL, "coll", options=SHIFTED, needs_icu=True) as url:
        engine = db.make_engine(url)
        try:
            with engine.connect() as conn:  # the rule the tests below depend on holds here
                assert conn.execute(text(f"SELECT '{MS}-10' < '{MS}.'")).scalar_one() is False
            db.upgrade(engine)
            yield engine
        finally:
            engine.dispose()


def _deliver(engine: Engine, ids: list[str]) -> None:
    row = {"stream": "orders", "partition": 0, "type": "t", "source": "x", "payload": "{}",
           "headers": "{}", "created_at_ms": 1, "available_at_ms": 1, "delivered_at_ms": 2}
    with engine.begin() as conn:
        conn.execute(insert(outbox), [{**row, "event_id": f"e-{entry_id}", "entry_id": entry_id}
                                      for entry_id in ids])
        conn.execute(insert(stream_trims), [{"stream": "orders", "partition": 0,
                                             "floor_entry_id": "0-0", "updated_at_ms": 1}])


def test_the_newest_delivered_id_is_found_across_a_digit_boundary(
    shifted_engine: Engine,
) -> None:
    """One batch whose seqs go from one to two digits: text order puts ``-9`` on top, and
    repair must still learn ``-11`` (a stream restored to ``-9`` would be missing two)."""
    earlier = str(int(MS) - 1)
    _deliver(shifted_engine, [f"{earlier}-7", *(f"{MS}-{seq}" for seq in range(8, 12))])
    assert repair_store.newest_delivered_id(shifted_engine, "orders", 0) == f"{MS}-11"


def test_delivered_rows_and_counts_keep_to_their_floor(shifted_engine: Engine) -> None:
    """The other ranges over entry ids (a refill's rows above an id, the rows at or above a
    trim floor) read the same rows as byte order would."""
    earlier = str(int(MS) - 1)
    _deliver(shifted_engine, [f"{earlier}-7", *(f"{MS}-{seq}" for seq in range(8, 12))])
    assert repair_store.delivered_counts(shifted_engine, [0]) == {("orders", 0): 5}
    above = repair_store.delivered_rows(shifted_engine, "orders", 0, after=f"{MS}-9")
    assert [r.entry_id for r in above] == [f"{MS}-10", f"{MS}-11"]
    above = repair_store.delivered_rows(shifted_engine, "orders", 0, after=f"{earlier}-7")
    assert [r.entry_id for r in above] == [f"{MS}-{seq}" for seq in range(8, 12)]
