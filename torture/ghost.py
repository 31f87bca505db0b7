"""A fenced-out consumer's late commands, as a fault of the torture.

A consumer that lost its lease without noticing (its process paused after its lease check) can
still have commands reach Redis after the new owner took its streams over: a read
(``XREADGROUP >``) that leaves new entries in its own pending list, or an ``XCLAIM`` (of its
pending pass, or putting back a waiting entry's delivery counter) that moves entries out of the
owner's. The owner must take them back and still apply every aggregate in order (design.md flow
3, the read rule; ``consumer/daemon.py`` ``_behind_foreign``). The torture's pauses make such
late commands rare and their timing luck (one PostgreSQL run of 2026-12-06 met one:
docs/guarantees.md); this fault sends them on purpose, from a ghost consumer that then never
comes back, as a process killed right after would not: the entries waiting for a retry (each
holding its aggregate's later revisions back; read from the retry table), the oldest pending
entries of a stream or a random few of its first page are claimed away from their owner, or
the next new entries are read.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import redis

log = logging.getLogger("torture")

Blocker = tuple[str, str, str]  # (stream key, group, entry id) of an entry waiting for a retry
GHOST_CLAIM = "consumer.ghost_claim"  # pending entries moved away from their owner
GHOST_READ = "consumer.ghost_read"  # new entries read by a consumer that has no lease


class Ghost:
    """A fenced-out consumer's late commands on random (stream key, group) pairs, in bursts
    from a thread of its own (:meth:`start`, :meth:`stop`), one every ``every_s`` seconds on
    average; :attr:`counts` says how many bursts claimed entries away or read new ones."""

    def __init__(self, client: Callable[[], redis.Redis],
                 targets: Sequence[tuple[str, str]], *, every_s: float, seed: int,
                 blockers: Callable[[], list[Blocker]] | None = None) -> None:
        self.client = client
        self.targets = list(targets)
        self.blockers = blockers
        self.every_s = every_s
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ghost", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.rng.expovariate(1 / self.every_s)):
            done = self.haunt(self.rng)
            if done is not None:
                self.counts[done] += 1

    def haunt(self, rng: random.Random, for_s: float = 2.0, gap_s: float = 0.002) -> str | None:
        """Late commands ``gap_s`` apart for ``for_s`` seconds on one random (stream key,
        group): the owner's window that matters is short (between its pending pass's take
        over and its first read, a millisecond), and one command a few seconds apart would
        seldom land in it; for two seconds (two of the torture's pending checks), every pass
        the owner starts meets one. The fault it was (:data:`GHOST_CLAIM` if any command
        claimed entries away, else :data:`GHOST_READ` if any read new ones), or None when it
        found nothing to take (no pending or new entry, no group yet, Redis down)."""
        aimed = self._blockers(rng)
        key, group = (aimed[0][0], aimed[0][1]) if aimed else self._target(rng)
        ids: list[Any] = [entry_id for _, _, entry_id in aimed]
        done: set[str] = set()
        until = time.monotonic() + for_s
        while True:
            found = (self._steal(key, group, ids, "ghost-0") if ids
                     else self._one(rng, key, group))
            if found is not None:
                done.add(found)
            if time.monotonic() >= until or self._stop.wait(gap_s):
                break
        moved = GHOST_CLAIM if GHOST_CLAIM in done else None
        return moved or (GHOST_READ if done else None)

    def _blockers(self, rng: random.Random) -> list[Blocker]:
        """Half the time (when given ``blockers``), the entries whose handler failed and
        waits for its retry, on one random (stream key, group) of them: each holds its
        aggregate's later revisions back, and moving it out of its owner's pending list is
        what could let them by."""
        if self.blockers is None or rng.random() < 0.5:
            return []
        try:
            found = self.blockers()
        except Exception as err:  # the database under its own faults: aim at random instead
            log.debug("ghost: no blockers (%s)", type(err).__name__)
            return []
        if not found:
            return []
        key, group, _ = rng.choice(found)
        return [b for b in found if (b[0], b[1]) == (key, group)]

    def _steal(self, key: str, group: str, ids: list[Any], name: str) -> str | None:
        """``XCLAIM`` these entries to ``name`` away from whoever holds them; a claim counts
        only if Redis moved one (an entry acknowledged meanwhile is ignored)."""
        try:
            got: Any = self.client().xclaim(key, group, name, 0, ids, justid=True)
        except redis.RedisError as err:
            log.debug("ghost of %s: %s", key, type(err).__name__)
            return None
        return GHOST_CLAIM if got else None

    def _target(self, rng: random.Random) -> tuple[str, str]:
        """A random pair on which a consumer other than a ghost holds pending entries (the
        only ones a claim can move), else any pair (a read may still take new entries)."""
        try:
            pipe = self.client().pipeline(transaction=False)
            for key, group in self.targets:
                pipe.xpending(key, group)
            replies: Any = pipe.execute(raise_on_error=False)
        except redis.RedisError:
            replies = []
        held = [t for t, reply in zip(self.targets, replies, strict=False)
                if isinstance(reply, dict) and any(
                    not c["name"].startswith(b"ghost-") for c in reply.get("consumers") or [])]
        return rng.choice(held or self.targets)

    def _one(self, rng: random.Random, key: str, group: str) -> str | None:
        name = f"ghost-{rng.randrange(5)}"
        try:
            client = self.client()
            rows: Any = client.xpending_range(key, group, min="-", max="+", count=20)
            owned = [r["message_id"] for r in rows if not r["consumer"].startswith(b"ghost-")]
            if owned and rng.random() < 0.9:
                oldest = owned[:rng.randint(1, 5)]
                taken = (oldest if rng.random() < 0.5
                         else rng.sample(owned, rng.randint(1, len(owned))))
                return self._steal(key, group, taken, name)
            if rng.random() < 0.1:
                got: Any = client.xreadgroup(group, name, {key: ">"}, count=rng.randint(1, 3))
                return GHOST_READ if got else None
            return None
        except redis.RedisError as err:  # down, stalled, no group yet: nothing to haunt
            log.debug("ghost of %s: %s", key, type(err).__name__)
            return None
