"""Refused appends: a stream Redis refuses waits, alone, with exponential backoff and jitter.

Redis refuses an append for reasons a hot retry cannot change: out of memory (``redis_oom``),
an ACL without ``XADD`` on the key (``redis_acl``), a key of another type
(``redis_wrongtype``), a server loading or read-only (``redis_not_ready``), an id the stream
cannot follow (``redis_error``). The refused row stays pending (and every later row of its
stream waits behind it, relay/append.py), so the stream is **backing off**: its rows are not
taken (:func:`relay.outgoing.take_fresh` skips them) until its next attempt is due, each wait
twice the one before (``refusal_first_delay_s`` … ``refusal_max_delay_s``), with jitter so
relays do not retry in step. Other streams, of the same partition or others, keep flowing.

One WARNING per change of state, not per attempt: ``accepted → refused`` and a new reason
log; ``refused → refused`` (same reason) is silent; ``refused → accepted`` logs the recovery.
``outbox_relay_stream_backoff{stream,partition,reason}`` is 1 while a stream backs off
(relay/metrics.py); ``outbox status`` names the streams whose rows Redis refused.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

StreamId = tuple[str, int]  # (stream, partition)


@dataclass
class Refusal:
    """A stream backing off: why, since when, how many refused attempts, when to try again."""

    reason: str
    since: float
    attempts: int
    delay_s: float
    next_at: float


class StreamBackoff:
    """The backing-off streams of one relay, and the one function that moves between states."""

    def __init__(
        self, first_s: float = 0.5, max_s: float = 30.0, jitter: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.first_s, self.max_s, self.jitter = first_s, max_s, jitter
        self._clock, self._rand = clock, rand
        self.refused: dict[StreamId, Refusal] = {}

    def outcome(self, stream: StreamId, reason: str | None) -> None:
        """What Redis said about the stream's last append: ``reason`` when refused, None when
        every row it was sent landed. Logs a WARNING when the state changes."""
        now = self._clock()
        was = self.refused.get(stream)
        name = f"{stream[0]}:{stream[1]}"
        extra = {"stream": stream[0], "partition": stream[1], "error": reason}
        if reason is None:
            if was is not None:
                del self.refused[stream]
                log.warning("stream %s accepts appends again after %.1fs of %s (%d refused "
                            "attempts)", name, now - was.since, was.reason, was.attempts,
                            extra={**extra, "error": was.reason, "count": was.attempts})
            return
        if was is None or was.reason != reason:
            delay = self.first_s
            attempts = 1 if was is None else was.attempts + 1
            since = now if was is None else was.since
            log.warning("stream %s: Redis refused an append (%s); its rows wait, retried with "
                        "backoff (other streams go on)", name, reason, extra=extra)
        else:
            delay = min(was.delay_s * 2, self.max_s)
            attempts, since = was.attempts + 1, was.since
        wait = delay * (1 - self.jitter + 2 * self.jitter * self._rand())
        self.refused[stream] = Refusal(reason, since, attempts, delay, now + wait)

    def waiting(self) -> dict[int, frozenset[str]]:
        """``{partition: streams}`` whose next attempt is not due yet (not to be taken)."""
        now = self._clock()
        out: dict[int, set[str]] = {}
        for (stream, partition), r in self.refused.items():
            if r.next_at > now:
                out.setdefault(partition, set()).add(stream)
        return {p: frozenset(s) for p, s in out.items()}

    def forget_partition(self, partition: int) -> None:
        """The partition's lease is gone: its streams are another relay's business."""
        for stream in [s for s in self.refused if s[1] == partition]:
            del self.refused[stream]
