"""Redis errors reach callers as our errors, also when a pipeline wraps them."""

from __future__ import annotations

import fakeredis
import pytest
import redis

from outbox_relay.shared.errors import UnavailableError
from outbox_relay.shared.redis_conn import translate_redis_errors


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
