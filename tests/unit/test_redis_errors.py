"""Redis errors reach callers as our errors, also when a pipeline wraps them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis

from outbox_relay.shared.errors import CannotConnectError, UnavailableError
from outbox_relay.shared.redis_conn import connect_redis, translate_redis_errors
from tests.helpers import free_port
from tests.not_redis import not_redis_server


def test_a_missing_group_inside_a_pipeline_is_unavailable_not_a_crash() -> None:
    """A consumer's pipelined XCLAIM/XACK after Redis lost its data answers NOGROUP wrapped in
    "Command # 1 (…) of pipeline caused error: …": the daemon must see UnavailableError (it
    backs off and recreates its groups), not a raw ResponseError that ends the process."""
    client = fakeredis.FakeRedis()
    client.xadd("s", {"a": "1"})
    pipe = client.pipeline(transaction=False)
    pipe.xack("s", "nogroup", "1-1")
    pipe.xclaim("s", "nogroup", "c", 0, ["1-1"], justid=True)
    with pytest.raises(UnavailableError) as caught, translate_redis_errors():
        try:
            pipe.execute()
        except redis.ResponseError as err:
            assert "of pipeline caused error: NOGROUP" in str(err)  # the wrapped form
            raise
    assert "consumer group is missing" in caught.value.message


def test_other_errors_are_not_swallowed() -> None:
    with pytest.raises(redis.ResponseError), translate_redis_errors():
        raise redis.ResponseError("Command # 1 (XADD) of pipeline caused error: WRONGTYPE x")


# -- where: host, port and database, never the password (issue 26, findings 1 and 3) --------


@pytest.fixture
def closed_port() -> int:
    """A loopback port nobody listens on."""
    return free_port()


@pytest.fixture
def not_redis() -> Iterator[int]:
    """A host that answers but is not Redis (its port)."""
    with not_redis_server() as port:
        yield port


def test_a_redis_that_is_down_is_unavailable_naming_host_port_and_db(closed_port: int) -> None:
    client = connect_redis(f"redis://user:hunter2@127.0.0.1:{closed_port}/5", timeout_s=1)
    with pytest.raises(UnavailableError) as caught, translate_redis_errors():
        client.ping()
    assert caught.value.message == (
        f"Redis at 127.0.0.1:{closed_port}/5 is unavailable or timed out")
    assert "hunter2" not in str(caught.value)


def test_a_pipeline_error_names_where_too(closed_port: int) -> None:
    pipe = connect_redis(f"redis://127.0.0.1:{closed_port}/2", timeout_s=1).pipeline()
    pipe.xlen("a")
    with pytest.raises(UnavailableError) as caught, translate_redis_errors():
        pipe.execute()
    assert f"127.0.0.1:{closed_port}/2" in caught.value.message


def test_a_unix_socket_is_named_by_its_path(tmp_path: Path) -> None:
    client = connect_redis(f"unix://{tmp_path}/redis.sock?db=3", timeout_s=1)
    with pytest.raises(UnavailableError) as caught, translate_redis_errors():
        client.ping()
    assert caught.value.message == f"Redis at {tmp_path}/redis.sock/3 is unavailable or timed out"


def test_a_server_that_is_not_redis_cannot_be_connected_to(not_redis: int) -> None:
    """Not retried (retrying cannot make it Redis): the CLI exits 2 with the URL to fix."""
    client = connect_redis(f"redis://:hunter2@127.0.0.1:{not_redis}/0", timeout_s=2)
    with pytest.raises(CannotConnectError) as caught, translate_redis_errors():
        client.ping()
    assert caught.value.message.startswith(
        f"the server at 127.0.0.1:{not_redis}/0 answered, but not in the Redis protocol")
    assert "hunter2" not in str(caught.value)


def test_a_database_number_the_server_lacks_cannot_be_connected_to() -> None:
    """``SELECT 99`` at connect answers "DB index is out of range" (a ResponseError, which
    was a traceback): retrying cannot fix the URL."""
    err = redis.ResponseError("DB index is out of range")
    err.redis_where = "redis.internal:6379/99"  # type: ignore[attr-defined]
    with pytest.raises(CannotConnectError) as caught, translate_redis_errors():
        raise err
    assert caught.value.message.startswith(
        "Redis at redis.internal:6379/99: no such database number")


def test_an_error_without_a_place_still_reads_well() -> None:
    """A client we did not make (fakeredis, a cluster node's) has no place to name."""
    with pytest.raises(UnavailableError) as caught, translate_redis_errors():
        raise redis.ConnectionError("Connection closed by server.")
    assert caught.value.message == "Redis is unavailable or timed out"


def test_a_redis_cluster_that_does_not_answer_names_its_nodes(closed_port: int) -> None:
    with pytest.raises(UnavailableError) as caught:
        connect_redis(f"redis+cluster://u:hunter2@127.0.0.1:{closed_port},127.0.0.1:1",
                      timeout_s=1)
    assert caught.value.message == (
        f"no node of the Redis Cluster (127.0.0.1:{closed_port}, 127.0.0.1:1) answered")
    assert "hunter2" not in str(caught.value)
