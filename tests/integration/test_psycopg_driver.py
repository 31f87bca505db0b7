"""``shared.psycopg_driver``: psycopg's pipeline mode is used only where it can be entered.

A libpq older than 14 (a system libpq with psycopg's C or pure-Python implementation) has no
pipeline mode, and entering it raises psycopg's own ``NotSupportedError``, which would escape
every claim as a raw driver error: there the claim runs unpipelined instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine

from outbox_relay.consumer.pipelining import pipelined
from outbox_relay.shared import psycopg_driver
from outbox_relay.shared.db import is_postgres


@pytest.fixture
def fresh_capability() -> Iterator[None]:
    psycopg_driver._pipeline_supported.cache_clear()
    yield
    psycopg_driver._pipeline_supported.cache_clear()


def test_pipeline_mode_only_where_libpq_has_it(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, fresh_capability: None
) -> None:
    with engine.connect() as conn, pipelined(conn) as pipe:
        assert pipe.on == is_postgres(engine)  # the bundled libpq has it
    if not is_postgres(engine):
        return
    psycopg_driver._pipeline_supported.cache_clear()
    monkeypatch.setattr(psycopg.Pipeline, "is_supported", classmethod(lambda cls: False))
    with engine.connect() as conn:
        assert psycopg_driver.pipelining_connection(conn) is None
        with pipelined(conn) as pipe:
            assert not pipe.on
            assert conn.exec_driver_sql("SELECT 1").scalar() == 1
