"""``shared.last_write``: a transaction's last write sent with its ``COMMIT`` (psycopg's
pipeline mode; unchanged elsewhere), as the relay's take and settle end.

Both databases: what was written commits; a last write that fails raises the SQLAlchemy
error it would have raised and nothing of the transaction commits; the connection goes back
to the pool usable (out of pipeline mode).
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, insert, select, update
from sqlalchemy.exc import IntegrityError

from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.last_write import begin_with_last_write
from outbox_relay.shared.schema import relay_leases

FIRST, SECOND = 9001, 9002


def lease(partition: int) -> dict[str, object]:
    return {"partition": partition, "owner": None, "epoch": 0, "expires_at_ms": 0,
            "last_entry_id": "0-0"}


def last_ids(engine: Engine) -> dict[int, str]:
    with engine.connect() as conn:
        rows = conn.execute(select(relay_leases.c.partition, relay_leases.c.last_entry_id)
                            .where(relay_leases.c.partition.in_([FIRST, SECOND]))).all()
    return {p: e for p, e in rows}


def test_the_last_write_commits_with_the_rest(engine: Engine) -> None:
    with begin_with_last_write(engine) as (conn, last_write):
        conn.execute(insert(relay_leases).values(**lease(FIRST)))
        last_write.send()
        pipelined = getattr(conn.connection.driver_connection, "_pipeline", None)
        assert (pipelined is not None) == is_postgres(engine)  # really unawaited on psycopg
        conn.execute(update(relay_leases).where(relay_leases.c.partition == FIRST)
                     .values(last_entry_id="5-1"))

    assert last_ids(engine) == {FIRST: "5-1"}


def test_a_failing_last_write_raises_and_commits_nothing(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(insert(relay_leases).values(**lease(FIRST)))

    with pytest.raises(IntegrityError), begin_with_last_write(engine) as (conn, last_write):
        conn.execute(insert(relay_leases).values(**lease(SECOND)))
        last_write.send()
        conn.execute(insert(relay_leases).values(**lease(FIRST)))  # the key is taken

    assert last_ids(engine) == {FIRST: "0-0"}  # SECOND's insert went with the failure
    with begin_with_last_write(engine) as (conn, last_write):  # the pool's connection works
        last_write.send()
        conn.execute(update(relay_leases).where(relay_leases.c.partition == FIRST)
                     .values(last_entry_id="7-1"))
    assert last_ids(engine) == {FIRST: "7-1"}
