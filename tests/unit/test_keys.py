"""Key naming: one module, hash tags that keep a partition and its dead letters together."""

from __future__ import annotations

import zlib

import fakeredis
import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from outbox_relay.shared import keys
from outbox_relay.shared.errors import ConfigError

names = st.from_regex(r"[A-Za-z0-9_.\-]{1,64}", fullmatch=True)


def test_documented_names() -> None:
    assert keys.stream_key("outbox", "runs", 0) == "outbox:{runs:0}"
    assert keys.dead_letter_key("outbox", "runs", 0) == "outbox:{runs:0}:dead"
    assert keys.stream_key_pattern("outbox") == "outbox:{*}"
    assert keys.notify_channel("my-app.v2") == "my_app_v2_outbox"
    assert keys.appended_channel("outbox:{runs:0}") == "outbox:{runs:0}:appended"


@given(names, names, st.integers(min_value=0, max_value=1023))
def test_stream_and_dead_letters_share_a_cluster_slot(prefix: str, stream: str, p: int) -> None:
    key = keys.stream_key(prefix, stream, p)
    dead = keys.dead_letter_key(prefix, stream, p)
    assert key_slot(key.encode()) == key_slot(dead.encode())
    # The doorbell channel is under the prefix (the documented ACL grants ``&<prefix>:*``).
    assert keys.appended_channel(key).startswith(f"{prefix}:")
    assert key_slot(key.encode()) == key_slot(f"{stream}:{p}".encode())


@given(names, names, st.integers(min_value=0, max_value=1023))
def test_parse_inverts_stream_key(prefix: str, stream: str, p: int) -> None:
    assert keys.parse_stream_key(prefix, keys.stream_key(prefix, stream, p)) == (stream, p)
    assert keys.parse_stream_key(prefix, keys.dead_letter_key(prefix, stream, p)) is None


@pytest.mark.parametrize(
    "key",
    ["other:{runs:0}", "outbox:runs:0", "outbox:{runs}", "outbox:{runs:x}", "outbox:{:0}",
     "outbox:{runs:0}:dead", "outboxx:{runs:0}"],
)
def test_parse_rejects_foreign_keys(key: str) -> None:
    assert keys.parse_stream_key("outbox", key) is None


def test_scan_pattern_finds_partitions_not_dead_letters() -> None:
    client = fakeredis.FakeRedis()
    for k in ["p:{runs:0}", "p:{runs:1}", "p:{runs:0}:dead", "px:{runs:0}", "other"]:
        client.set(k, "1")
    found = sorted(k.decode() for k in client.scan_iter(match=keys.stream_key_pattern("p")))
    assert found == ["p:{runs:0}", "p:{runs:1}"]


@given(st.text(min_size=1, max_size=80), st.integers(min_value=1, max_value=1024))
def test_partition_is_stable_and_in_range(aggregate_id: str, partitions: int) -> None:
    p = keys.partition_for(aggregate_id, partitions)
    assert 0 <= p < partitions
    assert p == zlib.crc32(aggregate_id.encode()) % partitions


def test_partition_values_never_change_between_releases() -> None:
    # Changing the mapping would split an aggregate's events across partitions mid-flight.
    assert [keys.partition_for(f"run-{i}", 4) for i in range(8)] == [1, 3, 1, 3, 0, 2, 0, 2]
    assert [keys.partition_for(f"run-{i}", 1024) for i in range(4)] == [117, 227, 345, 463]


@pytest.mark.parametrize("bad", ["", "a b", "a:b", "a{b}", "x" * 65, "é", "a*"])
def test_check_name_rejects_unsafe_parts(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        keys.check_name("stream", bad)
    assert info.value.code == "invalid_config"


@given(names)
def test_check_name_accepts_safe_parts(name: str) -> None:
    assert keys.check_name("stream", name) == name
