"""The start's warning when a few claims would fill PostgreSQL's lock table
(consumer/lock_table.py): a claim holds one advisory lock per aggregate of its batch."""

from __future__ import annotations

import logging

import pytest
import redis
from sqlalchemy import Engine

from outbox_relay.consumer import lock_table
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared import db
from outbox_relay.shared.db import is_postgres
from tests.helpers import consumer_settings, free_port

pytestmark = pytest.mark.integration


def test_the_lock_table_is_postgresqls_own_setting(engine: Engine) -> None:
    size = lock_table.size(engine)
    if not is_postgres(engine):
        assert size is None  # SQLite takes no such locks
        return
    with engine.connect() as conn:
        per = int(conn.exec_driver_sql("SHOW max_locks_per_transaction").scalar_one())
        connections = int(conn.exec_driver_sql("SHOW max_connections").scalar_one())
        prepared = int(conn.exec_driver_sql("SHOW max_prepared_transactions").scalar_one())
    assert size == per * (connections + prepared)


def test_a_consumer_starting_with_a_batch_a_few_claims_of_which_fill_it_warns(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``outbox consume`` with a batch size of 10,000 warns once at start, naming the setting
    to raise and the one to lower; the default batch size does not (with the server's
    defaults, 6,400 entries: 32 claims of 200 fit)."""
    table = lock_table.size(engine)
    caplog.set_level(logging.WARNING, logger="outbox_relay.consumer.lock_table")
    for batch in (10_000, 200):
        caplog.clear()
        consumer = Consumer(consumer_settings(key_prefix, batch_size=batch), engine,
                            redis_client, Handlers())
        consumer.run(until_idle=True)
        warned = [r for r in caplog.records if r.name == "outbox_relay.consumer.lock_table"]
        expect = table is not None and table // batch < lock_table.FEW_CLAIMS
        assert len(warned) == (1 if expect else 0), (batch, table)
        if warned:
            text = warned[0].getMessage()
            assert "max_locks_per_transaction" in text and "OUTBOX_BATCH_SIZE=10000" in text
    if is_postgres(engine):
        assert table is not None and table // 10_000 < lock_table.FEW_CLAIMS  # it did warn


def test_a_database_down_at_start_leaves_the_check_silent_and_the_start_going() -> None:
    """The check is advice: PostgreSQL unreachable when the consumer starts (our connect
    error, ``UnavailableError``) is the daemon loop's to wait for, not a crash of the start."""
    down = db.make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test")
    try:
        assert lock_table.size(down) is None
        assert lock_table.warn_if_few_claims_fit(down, 10_000, "g") is None
    finally:
        down.dispose()
