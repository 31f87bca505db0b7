"""The doorbell: an idle consumer wakes when the relay appends, instead of on its next poll.

Bounded reads (consumer/streams.py) run in a script, and a script cannot block, so a consumer
waiting for new entries polls: 1 ms, doubling to :data:`consumer.streams.POLL_MAX_S`. That pause
was the latency an entry saw on an idle consumer (up to 20 ms, the largest stage at p99 in
``python -m bench --only latency``), and an idle consumer sent 50 reads a second.

The relay publishes ``1`` on each stream's appended channel (:func:`shared.keys.appended_channel`)
when its append script added entries. A consumer subscribes to the channels of the streams it
reads, on a connection of its own, and waits on it between two reads: a message ends the wait
at once, and while the doorbell works the pause grows to :data:`RING_POLL_MAX_S` instead.

PostgreSQL consumers only (consumer/daemon.py), a precaution: on SQLite every consumer the
append wakes asks for the one write lock just as the relay settles that append.

Only a doorbell: the consumer reads the streams for what is there, whatever rang. Pub/Sub
delivers at most once, so a message lost while the connection was down costs that entry at
most one :data:`RING_POLL_MAX_S` pause, never the entry. On any Redis error the doorbell goes
quiet (the consumer polls as without it) and reconnects :data:`RETRY_S` later. A message
published between a read that found nothing and the wait is not lost: it waits in the
subscription's socket and ends the wait at once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import redis

from outbox_relay.shared import keys

log = logging.getLogger(__name__)

RING_POLL_MAX_S = 0.25
"""The longest pause between two reads while the doorbell works (without it:
:data:`consumer.streams.POLL_MAX_S`)."""
RETRY_S = 5.0
"""After a Redis error, how long the doorbell stays quiet before it subscribes again."""


class Doorbell:
    """The appended channels of the streams one consumer reads (see the module docstring)."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._pubsub: Any = None
        self._channels: frozenset[str] = frozenset()
        self._wanted: frozenset[str] = frozenset()
        self._quiet_until = 0.0
        self._failed = False  # failed once already: later failures are logged at DEBUG

    @property
    def working(self) -> bool:
        """Subscribed to every stream it was asked to listen to (:meth:`listen`)."""
        return self._pubsub is not None and self._channels == self._wanted

    def listen(self, stream_keys: list[str]) -> None:
        """Subscribe to the appended channels of exactly ``stream_keys`` (the streams about to
        be read); a no-op when they are those already subscribed to."""
        self._wanted = frozenset(keys.appended_channel(k) for k in stream_keys)
        if self._channels == self._wanted and self._pubsub is not None:
            return
        if time.monotonic() < self._quiet_until:
            return
        try:
            if self._pubsub is None:
                self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                self._channels = frozenset()
            gone, new = self._channels - self._wanted, self._wanted - self._channels
            if gone:
                self._pubsub.unsubscribe(*sorted(gone))
            if new:
                self._pubsub.subscribe(*sorted(new))
            self._channels = self._wanted
        except (redis.RedisError, OSError) as err:
            self._fail(err)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the bell; True when it rang (then read at once).
        Sleeps the whole time when the doorbell is not working."""
        if not self.working:
            time.sleep(timeout_s)
            return False
        deadline = time.monotonic() + timeout_s
        try:
            # get_message gives None for a (un)subscribe confirmation it skips, not only when
            # the time is up: wait again for what is left.
            while (left := deadline - time.monotonic()) > 0:
                if self._pubsub.get_message(timeout=left) is not None:
                    while self._pubsub.get_message(timeout=0) is not None:
                        pass  # several streams rang: one read serves them all
                    return True
            return False
        except (redis.RedisError, OSError, ValueError) as err:
            self._fail(err)
            return False

    def max_pause_s(self, polling_max_s: float) -> float:
        """The longest pause between two reads: :data:`RING_POLL_MAX_S` while the doorbell
        works, ``polling_max_s`` otherwise."""
        return RING_POLL_MAX_S if self.working else polling_max_s

    def close(self) -> None:
        """Drop the subscription connection."""
        pubsub, self._pubsub, self._channels = self._pubsub, None, frozenset()
        if pubsub is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                pubsub.close()

    def _fail(self, err: BaseException) -> None:
        """Go quiet for :data:`RETRY_S`; said at INFO once (an ACL that refuses ``SUBSCRIBE``
        would otherwise log every few seconds), then at DEBUG."""
        level = logging.DEBUG if self._failed else logging.INFO
        self._failed = True
        log.log(level, "consumer doorbell off for %.0f s after %s (reads poll every 1-20 ms "
                "meanwhile)", RETRY_S, type(err).__name__)
        self.close()
        self._quiet_until = time.monotonic() + RETRY_S
