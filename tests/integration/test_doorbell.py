"""The doorbell (consumer/doorbell.py): the relay publishes on a stream's appended channel when
its append added entries; a consumer waiting for new entries wakes on it instead of its next
poll, and polls as before when the doorbell is down. Real Redis (a cluster when
OUTBOX_TEST_REDIS_URL names one)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from outbox_relay.consumer import doorbell, streams
from outbox_relay.relay import append
from outbox_relay.shared import keys
from tests.helpers import outbox_row

pytestmark = pytest.mark.integration


def subscribed(client: redis.Redis, channel: str) -> Any:
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel)
    return pubsub


def next_message(pubsub: Any, timeout_s: float = 5.0) -> Any:
    """The next published message, waiting up to ``timeout_s`` (None if none came; the
    subscription's confirmation is skipped)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        message = pubsub.get_message(timeout=left)
        if message is not None:
            return message
    return None


def assert_no_ring_before_marker(client: redis.Redis, pubsub: Any, channel: str) -> None:
    """Publish a marker after the call under test: the next message must be it (a ring the
    call sent would come first: one server, one channel, in order). No wait for an absence."""
    client.publish(channel, "marker")
    message = next_message(pubsub)
    assert message is not None and message["data"] == b"marker", message


def test_the_relay_rings_once_per_append_that_added_entries(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    key = keys.stream_key(key_prefix, "orders", 0)
    pubsub = subscribed(redis_client, keys.appended_channel(key))
    rows = [outbox_row(seq=i, event_id=f"o-{i}:order.placed:1", entry_id=f"1764000000123-{i}")
            for i in range(1, 4)]
    verdicts = append.append(redis_client, key_prefix, rows, epoch=1)
    assert len(verdicts.delivered) == 3
    message = next_message(pubsub)
    assert message is not None and message["data"] == b"1"
    # The same batch again adds nothing (every entry is "already" there): no ring.
    again = append.append(redis_client, key_prefix, rows, epoch=1)
    assert again.already == 3
    assert_no_ring_before_marker(redis_client, pubsub, keys.appended_channel(key))
    # A fenced-out relay writes nothing and rings nothing.
    with pytest.raises(Exception, match="newer relay"):
        append.append(redis_client, key_prefix, [outbox_row(
            seq=9, event_id="o-9:order.placed:1", entry_id="1764000000999-0")], epoch=0)
    assert_no_ring_before_marker(redis_client, pubsub, keys.appended_channel(key))
    pubsub.close()


def test_a_waiting_read_wakes_on_the_ring(redis_client: redis.Redis, key_prefix: str) -> None:
    """The read waits (block 10 s); an append by the relay from another thread ends the wait
    through the doorbell, not through a poll (the pauses grow to 250 ms while it works)."""
    key = keys.stream_key(key_prefix, "orders", 0)
    streams.ensure_groups(redis_client, [key], "g")
    bell = doorbell.Doorbell(redis_client)
    bell.listen([key])
    assert bell.working
    rings: list[bool] = []
    wait = bell.wait
    waiting = threading.Event()

    def counted(timeout_s: float) -> bool:
        waiting.set()  # the read found nothing and waits: now the relay appends
        # Only the ring can end this wait in time: with the read's own first pause (a few
        # ms) a slow machine's append came after it, and the next poll found the entry (a
        # CI run saw rings == [False]). A ring sent before the wait began is still read.
        rang = wait(max(timeout_s, 10.0))
        rings.append(rang)
        return rang

    bell.wait = counted  # type: ignore[method-assign]

    def relay() -> None:
        assert waiting.wait(10)
        append.append(redis_client, key_prefix, [outbox_row(seq=1, entry_id="1764000000123-1")],
                      epoch=1)

    thread = threading.Thread(target=relay)
    thread.start()
    try:
        entries = streams.read(redis_client, {key: ">"}, "g", "c1", count=10, block_ms=10_000,
                               bell=bell)
    finally:
        thread.join()
        bell.close()
    assert [e.entry_id for e in entries] == ["1764000000123-1"]
    assert rings and rings[-1] is True  # the wait that ended was ended by the ring


def test_a_broken_doorbell_polls_and_comes_back(
    redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = keys.stream_key(key_prefix, "orders", 0)
    bell = doorbell.Doorbell(redis_client)
    bell.listen([key])
    assert bell.working

    class Broken:
        def get_message(self, timeout: float = 0.0) -> Any:
            raise redis.ConnectionError("gone")

        def close(self) -> None:
            pass

    bell._pubsub = Broken()
    assert bell.wait(0.01) is False  # no exception: the error turns the doorbell off
    assert not bell.working
    assert bell.max_pause_s(streams.POLL_MAX_S) == streams.POLL_MAX_S
    bell.listen([key])  # within the quiet time: stays off
    assert not bell.working
    monkeypatch.setattr(bell, "_quiet_until", 0.0)
    bell.listen([key])
    assert bell.working and bell.max_pause_s(streams.POLL_MAX_S) == doorbell.RING_POLL_MAX_S
    redis_client.publish(keys.appended_channel(key), "1")
    assert bell.wait(5.0) is True
    bell.close()


def test_listen_follows_the_streams_read(redis_client: redis.Redis, key_prefix: str) -> None:
    """Only the streams about to be read ring: a stream given back stops ringing."""
    a, b = (keys.stream_key(key_prefix, "orders", p) for p in (0, 1))
    bell = doorbell.Doorbell(redis_client)
    bell.listen([a, b])
    bell.listen([b])
    redis_client.publish(keys.appended_channel(a), "1")
    assert bell.wait(0.3) is False
    redis_client.publish(keys.appended_channel(b), "1")
    assert bell.wait(5.0) is True
    bell.close()
