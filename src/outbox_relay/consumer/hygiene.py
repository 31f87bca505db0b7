"""Group hygiene: forget the consumers that left a group, and dead letters past their retention.

Why: every consumer name ever used stays in its group on every partition stream until someone
removes it, and names default to ``host:pid``, so each restart of each consumer adds one more
(``XINFO CONSUMERS``). The heartbeat rows of consumer ownership and the dead-letter streams grow
the same way. The consumer daemon runs :meth:`GroupHygiene.run` as a periodic task
(:mod:`shared.periodic`) on the partition streams it owns now, so each key of a group is looked
after by one consumer at a time. What it guarantees:

- **A consumer is removed only when it has nothing pending.** ``XGROUP DELCONSUMER`` drops the
  consumer's pending entries with it (they would be lost: no one could read or take them over).
  So one script per key does the check and the delete (:data:`consumer.streams.DROP_IDLE`):
  ``XINFO CONSUMERS``, then ``DELCONSUMER`` only for consumers idle longer than
  ``consumer_idle_s`` with ``pending`` 0, never the caller itself. Redis runs a script alone,
  so nothing can be delivered to a consumer between the check and the delete. Removing a
  consumer that is in fact alive but idle costs nothing: its next ``XREADGROUP`` or
  ``XCLAIM`` creates it again.
- **Heartbeat rows** (``outbox_consumer_nodes``) that expired more than ``consumer_idle_s`` ago
  are deleted, of any group (:func:`consumer.ownership.forget_nodes` says why that is safe).
- **Dead letters** older than ``retention_dead_letters`` are trimmed with an exact
  ``XTRIM <key>:dead MINID <now - retention>``: a letter's id is the Redis time it was written
  (``XADD *`` in :func:`consumer.streams.dead_letter`), so the trim removes exactly the letters
  past their retention and never a newer one (``~`` could keep some older ones for a while; it is
  exact because the streams are small and tests can rely on it). ``now`` is this host's clock:
  a skew between it and Redis's shifts the cut-off by the skew, nothing more. ``outbox dlq``
  reads and replays with ranges that tolerate letters disappearing (a trimmed letter is just no
  longer listed; ``show`` of one says it does not exist), and an event whose letter was trimmed
  keeps its ``dead`` inbox receipt until inbox retention prunes it. Several groups share a
  partition's dead-letter stream (each letter names its ``dlq.group``): the shortest retention
  among their consumers applies to all of them.

Each rule is off when its setting is 0. Redis or database unavailable: the task is retried at
its next interval (:class:`shared.periodic.Periodic`). This module decides; it sends no command
itself: the script is :func:`consumer.streams.drop_idle_consumers`, the trim
:func:`consumer.letter_streams.trim_before`, the heartbeat rows'
:func:`consumer.ownership.forget_nodes`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis
from sqlalchemy import Engine

from outbox_relay.consumer import letter_streams, ownership, streams
from outbox_relay.shared import keys
from outbox_relay.shared.periodic import Periodic
from outbox_relay.shared.settings import ConsumerSettings

if TYPE_CHECKING:
    from outbox_relay.consumer.daemon import Consumer

log = logging.getLogger(__name__)

MAX_INTERVAL_S = 60.0

@dataclass
class HygieneStats:
    """Counters since start (exported as metrics)."""

    consumers_removed: int = 0
    node_rows_removed: int = 0
    dead_letters_trimmed: int = 0


class GroupHygiene:
    """The hygiene of one consumer's group on the partition streams that consumer owns."""

    def __init__(
        self,
        settings: ConsumerSettings,
        engine: Engine,
        client: redis.Redis,
        leases: ownership.Leases,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.leases = leases
        self.stats = HygieneStats()

    @property
    def enabled(self) -> bool:
        """Whether any rule is on."""
        return bool(self.settings.consumer_idle_s or self.settings.retention_dead_letters)

    @property
    def interval_s(self) -> float:
        """How often to run: a quarter of the shortest enabled limit, at most every minute."""
        limits = [s for s in (self.settings.consumer_idle_s,
                              self.settings.retention_dead_letters) if s]
        return min([MAX_INTERVAL_S, *(s / 4 for s in limits)])

    def run(self) -> None:
        """One pass over the keys this consumer may read now (none while its leases are stale:
        another consumer may own them by now)."""
        owned = self.leases.readable()
        s = self.settings
        if s.consumer_idle_s:
            limit_ms = int(s.consumer_idle_s * 1000)
            self.stats.consumers_removed += len(self.remove_idle_consumers(owned, limit_ms))
            self.stats.node_rows_removed += ownership.forget_nodes(self.engine, limit_ms)
        if s.retention_dead_letters:
            cutoff = int(time.time() * 1000) - int(s.retention_dead_letters * 1000)
            dead = [keys.dead_letter_key(s.key_prefix, *self.leases.ids[k]) for k in owned]
            self.stats.dead_letters_trimmed += self.trim_dead_letters(dead, cutoff)

    def remove_idle_consumers(self, stream_keys: list[str], idle_ms: int) -> list[str]:
        """Remove, on each key, the group's consumers idle more than ``idle_ms`` with nothing
        pending, except ourselves (:func:`consumer.streams.drop_idle_consumers`); their
        names."""
        group, me = self.settings.group, self.leases.consumer
        removed = streams.drop_idle_consumers(self.client, stream_keys, group, idle_ms, me)
        if removed:
            log.info("removed %d idle consumer(s) with nothing pending from group %s: %s",
                     len(removed), group, sorted(set(removed)))
        return removed

    def trim_dead_letters(self, dead_keys: list[str], cutoff_ms: int) -> int:
        """``XTRIM key MINID cutoff_ms`` (exact) on each dead-letter stream
        (:func:`consumer.letter_streams.trim_before`); the number of letters removed."""
        trimmed = letter_streams.trim_before(self.client, dead_keys, cutoff_ms)
        if trimmed:
            log.info("trimmed %d dead letter(s) older than the retention", trimmed)
        return trimmed


def install(consumer: Consumer) -> GroupHygiene | None:
    """Register the hygiene of ``consumer``'s group as its periodic task ``group hygiene`` and
    attach its counters as ``consumer.hygiene_stats``; None (nothing registered) when every
    rule is off."""
    hygiene = GroupHygiene(consumer.settings, consumer.engine, consumer.client, consumer.leases)
    if not hygiene.enabled:
        return None
    consumer.periodic.append(Periodic("group hygiene", hygiene.interval_s, hygiene.run))
    consumer.hygiene_stats = hygiene.stats
    return hygiene
