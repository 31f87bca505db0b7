"""Every Redis key name, in one place.

A partition's stream and its dead-letter stream share the hash tag ``{stream:partition}``, so on
Redis Cluster they live in the same slot. With the default prefix ``outbox`` the names are::

    outbox:{runs:0}          the stream of partition 0 of stream "runs"
    outbox:{runs:0}:dead     its dead-letter stream
    outbox:{runs:0}:fence    the relay fence: the highest lease epoch that wrote to the stream
    outbox:{runs:0}:appended a Pub/Sub channel (not a key): the relay publishes on it when it
                             appended to the stream, so idle consumers read at once

``redis-cli`` users: ``XRANGE 'outbox:{runs:0}' - +``, ``XINFO GROUPS 'outbox:{runs:0}'``.
"""

from __future__ import annotations

import re
import zlib

from outbox_relay.shared.errors import ConfigError

DEFAULT_PREFIX = "outbox"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a safe key part (no braces, colons or spaces), else raise."""
    if not _NAME.match(value):
        raise ConfigError(
            f"{kind} {value!r} must be 1-64 characters of letters, digits, '_', '.', '-'",
        )
    return value


def partition_for(aggregate_id: str, partitions: int) -> int:
    """Map an aggregate to a partition, stably across processes and releases (CRC-32)."""
    return zlib.crc32(aggregate_id.encode("utf-8")) % partitions


def stream_key(prefix: str, stream: str, partition: int) -> str:
    """Key of one partition of a logical stream."""
    return f"{prefix}:{{{stream}:{partition}}}"


def dead_letter_key(prefix: str, stream: str, partition: int) -> str:
    """Key of the dead-letter stream beside ``stream_key`` (same cluster slot)."""
    return f"{stream_key(prefix, stream, partition)}:dead"


def fence_key(prefix: str, stream: str, partition: int) -> str:
    """Key of the relay fence of ``stream_key`` (same cluster slot): a string holding the
    highest partition lease epoch that appended to (or repaired) that stream. Scripts that write
    the stream refuse a caller whose epoch is lower (``redis-cli GET 'outbox:{runs:0}:fence'``)."""
    return f"{stream_key(prefix, stream, partition)}:fence"


def appended_channel(stream_key: str) -> str:
    """The Pub/Sub channel on which the relay says "entries were appended to ``stream_key``"
    (the message is ``1``; ``redis-cli SUBSCRIBE 'outbox:{runs:0}:appended'``). A doorbell only:
    consumers read the stream for what is there, and still poll when no message comes."""
    return f"{stream_key}:appended"


def parse_stream_key(prefix: str, key: str) -> tuple[str, int] | None:
    """Invert :func:`stream_key`; ``None`` for keys that are not ours."""
    head = f"{prefix}:{{"
    if not (key.startswith(head) and key.endswith("}")):
        return None
    stream, _, part = key[len(head) : -1].rpartition(":")
    if not stream or not part.isdigit():
        return None
    return stream, int(part)


def stream_key_pattern(prefix: str) -> str:
    """A ``SCAN MATCH`` pattern for all our partition streams (not the dead-letter ones)."""
    return f"{prefix}:{{*}}"


def notify_channel(prefix: str) -> str:
    """PostgreSQL ``LISTEN``/``NOTIFY`` channel on which producers wake relays."""
    return f"{prefix.replace('-', '_').replace('.', '_')}_outbox"
