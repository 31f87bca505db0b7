"""Which statements a handler may leave in flight on PostgreSQL (consumer/pipelining.py): only
a plain one-row insert, whose result a handler cannot read anything but ``rowcount == 1`` from;
anything else waits for its result."""

from __future__ import annotations

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, insert
from sqlalchemy.dialects import postgresql

from outbox_relay.consumer.pipelining import _PLAIN_INSERT

_t = Table("things", MetaData(), Column("id", Integer, primary_key=True),
           Column("name", String))


def _sql(stmt: object) -> str:
    return str(stmt.compile(dialect=postgresql.psycopg.dialect()))  # type: ignore[attr-defined]


@pytest.mark.parametrize("statement", [
    "INSERT INTO invoices (order_id, total) VALUES (%(id)s, %(t)s)",
    'insert into "order" VALUES (%s, %s)',
    "INSERT INTO billing.invoices (a) VALUES (%(a)s);",
    _sql(insert(_t).values(id=1, name="x")),
])
def test_a_one_row_insert_of_parameters_is_left_in_flight(statement: str) -> None:
    assert _PLAIN_INSERT.match(statement)


@pytest.mark.parametrize("statement", [
    "INSERT INTO t (a) VALUES (%(a)s) RETURNING t.id",
    "INSERT INTO t (a) VALUES (%(a)s) ON CONFLICT DO NOTHING",
    "INSERT INTO t (a) VALUES (%(a)s), (%(b)s)",
    "INSERT INTO t (a) SELECT a FROM u",
    "INSERT INTO t (a) VALUES (now())",
    "INSERT INTO t (a) VALUES ('x(y')",
    "WITH x AS (SELECT 1) INSERT INTO t VALUES (1)",
    "UPDATE t SET a = 1",
    "DELETE FROM t",
    "SELECT 1",
    "INSERT INTO t (a) VALUES (%(a)s); DELETE FROM t",
    "INSERT INTO t DEFAULT VALUES",
    _sql(insert(_t).values(name="x").returning(_t.c.id)),
    _sql(postgresql.insert(_t).values(id=1).on_conflict_do_nothing()),
    _sql(insert(_t).values([{"id": 1}, {"id": 2}])),
])
def test_anything_else_waits_for_its_result(statement: str) -> None:
    assert not _PLAIN_INSERT.match(statement)
