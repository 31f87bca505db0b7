"""Housekeeping a daemon runs between rounds (trimming, retention, group hygiene).

Each task runs on the daemon's own loop thread, at most every ``interval_s``, so it never races
the loop's own Redis and database work and needs no locks. A task that fails because Redis or
the database is unavailable is retried at its next interval; the loop goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from outbox_relay.shared.errors import UnavailableError

log = logging.getLogger(__name__)


@dataclass
class Periodic:
    """One housekeeping task: ``run()`` at most every ``interval_s`` seconds."""

    name: str
    interval_s: float
    run: Callable[[], object]
    next_at: float = 0.0  # monotonic; 0 = due at the first call
    runs: int = 0
    failures: int = 0

    def maybe_run(self, now: float | None = None) -> bool:
        """Run if due; True if it ran (whether or not it succeeded)."""
        now = time.monotonic() if now is None else now
        if now < self.next_at:
            return False
        self.next_at = now + self.interval_s
        try:
            self.run()
            self.runs += 1
        except UnavailableError as err:
            self.failures += 1
            log.warning("%s: %s; retrying in %.0fs", self.name, err.message, self.interval_s)
        return True


def run_due(tasks: list[Periodic]) -> None:
    """Run every due task, in order."""
    now = time.monotonic()
    for task in tasks:
        task.maybe_run(now)
