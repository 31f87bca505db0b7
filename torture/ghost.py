"""A fenced-out consumer's late commands, as a fault of the torture.

A consumer that lost its lease without noticing (its process paused after its lease check) can
still have commands reach Redis after the new owner took its streams over: a read
(``XREADGROUP >``) that leaves new entries in its own pending list, or an ``XCLAIM`` (of its
pending pass, or putting back a waiting entry's delivery counter) that moves entries out of the
owner's. The owner must take them back and still apply every aggregate in order (design.md flow
3, the read rule; ``consumer/daemon.py`` ``_behind_foreign``). The torture's pauses make such
late commands rare and their timing luck (one PostgreSQL run of 2026-12-06 met one:
docs/guarantees.md); this fault sends them on purpose, from a ghost consumer that then never
comes back, as a process killed right after would not: the oldest pending entries of a stream
(the likeliest to hold their aggregate's later revisions back) or a random few of the first
page are claimed away from their owner, or the next new entries are read.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

import redis

log = logging.getLogger("torture")

GHOST_CLAIM = "consumer.ghost_claim"  # pending entries moved away from their owner
GHOST_READ = "consumer.ghost_read"  # new entries read by a consumer that has no lease


class Ghost:
    """Sends one late command of a fenced-out consumer to a random (stream key, group)."""

    def __init__(self, client: Callable[[], redis.Redis],
                 targets: Sequence[tuple[str, str]]) -> None:
        self.client = client
        self.targets = list(targets)

    def haunt(self, rng: random.Random) -> str | None:
        """One command; the fault it was (:data:`GHOST_CLAIM`, :data:`GHOST_READ`), or None
        when it found nothing to take (no pending or new entry, no group yet, Redis down)."""
        key, group = rng.choice(self.targets)
        name = f"ghost-{rng.randrange(5)}"
        try:
            client = self.client()
            rows: Any = client.xpending_range(key, group, min="-", max="+", count=20)
            if rows and rng.random() < 0.75:
                ids = [r["message_id"] for r in rows]
                oldest = ids[:rng.randint(1, 5)]
                taken = oldest if rng.random() < 0.5 else rng.sample(ids, rng.randint(1, len(ids)))
                client.xclaim(key, group, name, 0, taken, justid=True)
                log.info("%s claimed %d pending entries of %s away", name, len(taken), key)
                return GHOST_CLAIM
            got: Any = client.xreadgroup(group, name, {key: ">"}, count=rng.randint(1, 3))
            return GHOST_READ if got else None
        except redis.RedisError as err:  # down, stalled, no group yet: nothing to haunt
            log.debug("ghost of %s: %s", key, type(err).__name__)
            return None
