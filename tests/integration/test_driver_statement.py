"""``shared.db.DriverStatement``: a hot statement compiled once and run with
``exec_driver_sql``; on psycopg its named array parameters go in binary.

Both databases: the statement answers what the same Core statement answers (literal values
included); on PostgreSQL the arrays the claim and the relay's mark send (strings with NULLs
and non-ASCII text, integers beyond 32 bits, empty arrays) arrive intact in binary.
"""

from __future__ import annotations

import pytest
from sqlalchemy import BigInteger, Engine, String, bindparam, event, exc, func, literal, select
from sqlalchemy.dialects import postgresql

from outbox_relay.shared.db import DriverStatement, is_postgres


def test_literals_are_sent_with_the_callers_parameters(engine: Engine) -> None:
    query = select(literal("r"), func.coalesce(bindparam("b_x", type_=String), literal("d")))
    statement = DriverStatement(query, engine.dialect)
    with engine.connect() as conn:
        assert tuple(statement.execute(conn, {"b_x": "given"}).one()) == ("r", "given")
        assert tuple(statement.execute(conn, {"b_x": None}).one()) == ("r", "d")
        assert tuple(conn.execute(query, {"b_x": "given"}).one()) == ("r", "given")


@pytest.mark.postgresql
@pytest.mark.parametrize(("item", "values"), [
    (String, ["a", None, "é ü 漢", "x" * 600, ""]),
    (BigInteger, [1, -1, 2**40, 0]),
    (String, []),
    (BigInteger, []),
])
def test_binary_arrays_arrive_intact(engine: Engine, item: type, values: list[object]) -> None:
    if not is_postgres(engine):
        pytest.skip("arrays are PostgreSQL's")
    query = select(func.unnest(bindparam("b_values", type_=postgresql.ARRAY(item))))
    statement = DriverStatement(query, engine.dialect, binary=("b_values",))
    assert "%(b_values)b" in statement.sql
    with engine.connect() as conn:
        assert list(statement.execute(conn, {"b_values": values}).scalars()) == values


def test_a_binary_name_the_statement_lacks_is_refused(engine: Engine) -> None:
    query = select(bindparam("b_x", type_=String))
    if not is_postgres(engine):  # other drivers take the statement as compiled
        assert DriverStatement(query, engine.dialect, binary=("b_y",)).sql
        return
    with pytest.raises(ValueError, match="b_y"):
        DriverStatement(query, engine.dialect, binary=("b_y",))


def test_only_psycopg_3_gets_binary_placeholders() -> None:
    """psycopg2 (SQLAlchemy's default driver for ``postgresql://``) has no ``%b``: its
    statement stays as compiled."""
    from sqlalchemy.dialects.postgresql import psycopg as pg3
    from sqlalchemy.dialects.postgresql import psycopg2 as pg2

    query = select(func.unnest(bindparam("b_values", type_=postgresql.ARRAY(BigInteger))))
    assert "%(b_values)b" in DriverStatement(query, pg3.dialect(), binary=("b_values",)).sql
    assert "%(b_values)s" in DriverStatement(query, pg2.dialect(), binary=("b_values",)).sql


def test_rows_are_the_drivers_tuples_and_the_statement_still_goes_through_sqlalchemy(
    engine: Engine,
) -> None:
    """``rows`` (a relay take's read) returns what the Core statement returns, as the
    driver's own tuples, and SQLAlchemy's cursor events still see the statement (tracing,
    the tests' statement recorders); the connection runs the next statement as usual."""
    values = select(func.coalesce(bindparam("b_x", type_=String), literal("d")).label("v"),
                    literal(2**40, BigInteger).label("n")).subquery()
    query = select(values.c.v, values.c.n).union_all(select(literal("z"), literal(1)))
    statement = DriverStatement(query, engine.dialect)
    seen: list[str] = []

    def on_execute(_conn: object, _cursor: object, sql: str, *_args: object) -> None:
        seen.append(sql)

    with engine.connect() as conn:
        event.listen(engine, "before_cursor_execute", on_execute)
        try:
            rows = statement.rows(conn, {"b_x": "given"})
            again = statement.rows(conn, {"b_x": None})
        finally:
            event.remove(engine, "before_cursor_execute", on_execute)
        assert seen == [statement.sql, statement.sql]
        assert [type(r) for r in rows] == [tuple, tuple]
        assert sorted(rows) == sorted(tuple(r) for r in conn.execute(query, {"b_x": "given"}))
        assert sorted(again) == [("d", 2**40), ("z", 1)]


def test_an_error_while_rows_are_fetched_is_sqlalchemys(engine: Engine) -> None:
    """SQLite steps through a result's rows as they are fetched, so a statement can fail
    after it started: that error reaches the caller as SQLAlchemy's (what the relay's
    ``translate_errors`` judges), as when SQLAlchemy reads the rows itself."""
    if is_postgres(engine):
        pytest.skip("psycopg has every row before execute returns: nothing fails in its fetch")
    numbers = func.json_each(literal(str(list(range(1, 11))))).table_valued("value")
    query = select(func.boom(numbers.c.value))
    statement = DriverStatement(query, engine.dialect)

    def boom(n: int) -> int:
        if n > 3:
            raise ValueError("past the third row")
        return n

    with engine.connect() as conn:
        conn.connection.driver_connection.create_function("boom", 1, boom)
        statement.execute(conn, {}).close()  # the statement starts: the first row is fine
        with pytest.raises(exc.OperationalError):
            statement.rows(conn, {})  # the fourth, fetched, is not
        assert statement.execute(conn, {}).fetchmany(2) == [(1,), (2,)]  # usable afterwards
