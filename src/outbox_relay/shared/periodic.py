"""Housekeeping a daemon runs between rounds (trimming, retention, group hygiene).

Each task runs on the daemon's own loop thread, at most every ``interval_s``, so it never races
the loop's own Redis and database work and needs no locks. A task that fails because Redis or
the database is unavailable is retried at its next interval; the loop goes on.

A task marked ``background`` (the consumer's receipt pruning on PostgreSQL, the relay's stream
trim and repair check) runs instead on a thread of its own, one run at a time: it shares
nothing with the loop but the engine's pool and the Redis client (both thread-safe), and a pass
of deletes that waits on the disk for a second must not stop the loop from consuming for that
second (the soak showed the consumers falling behind once inbox pruning began; the relay's trim
and check held its rounds 25-70 ms every 5-10 s, the tail of its latency). What it needs of the
loop's state (the leases held, the streams known) is copied on the loop thread when it starts
(``inputs``) and passed to ``run``, never read from the thread while the loop changes it.
:func:`shutdown` waits for a running one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from outbox_relay.shared.errors import UnavailableError

log = logging.getLogger(__name__)


@dataclass
class Periodic:
    """One housekeeping task: ``run(*inputs())`` at most every ``interval_s`` seconds."""

    name: str
    interval_s: float
    run: Callable[..., object]
    next_at: float = 0.0  # monotonic; 0 = due at the first call
    runs: int = 0
    failures: int = 0
    background: bool = False  # run on a thread of its own, one run at a time
    # Called on the loop thread when a run starts: the arguments of ``run`` (a copy of the
    # loop's state the run reads, so a background run never sees it change under it).
    inputs: Callable[[], tuple[Any, ...]] = tuple
    _thread: ThreadPoolExecutor | None = field(default=None, repr=False)
    _running: Future[None] | None = field(default=None, repr=False)

    def maybe_run(self, now: float | None = None) -> bool:
        """Run if due (started, for a background task still running its previous run: not
        yet); True if it ran or was started."""
        now = time.monotonic() if now is None else now
        if now < self.next_at or (self._running is not None and not self._running.done()):
            return False
        self.next_at = now + self.interval_s
        args = self.inputs()
        if not self.background:
            self._run_once(args)
            return True
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"outbox-{self.name}")
        self._running = self._thread.submit(self._run_once, args)
        return True

    def _run_once(self, args: tuple[Any, ...]) -> None:
        try:
            self.run(*args)
            self.runs += 1
        except UnavailableError as err:
            self.failures += 1
            log.warning("%s: %s; retrying in %.0fs", self.name, err.message, self.interval_s)
        except Exception:
            if not self.background:
                raise  # on the loop thread: the daemon's own handling decides
            self.failures += 1  # nobody would see it raise on its thread: say so, go on
            log.exception("%s failed; retrying in %.0fs", self.name, self.interval_s)

    def shutdown(self) -> None:
        """Wait for a background run to finish (the daemon is stopping)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def run_due(tasks: list[Periodic]) -> None:
    """Run every due task, in order."""
    now = time.monotonic()
    for task in tasks:
        task.maybe_run(now)


def shutdown(tasks: list[Periodic]) -> None:
    """Wait for every background task's run in progress (called when a daemon stops)."""
    for task in tasks:
        task.shutdown()
