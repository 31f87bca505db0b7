"""What every daemon loop shares: a capped, jittered backoff after ``unavailable``, and
SIGTERM/SIGINT asking the loop to finish its current round.

The relay and the consumer loops are different, their way of waiting out Redis or the database
and of stopping is not: kept here once so the two cannot drift apart.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
from collections.abc import Callable
from types import FrameType

from outbox_relay.shared.errors import UnavailableError

MIN_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0


class Backoff:
    """Doubling delays from :data:`MIN_BACKOFF_S` to :data:`MAX_BACKOFF_S`, each drawn
    uniformly from its upper half (so restarted daemons do not retry in step)."""

    def __init__(self) -> None:
        self.current = 0.0

    def reset(self) -> None:
        """After a success: the next failure starts from the shortest delay again."""
        self.current = 0.0

    def sleep(self, err: UnavailableError, stop: threading.Event, log: logging.Logger) -> float:
        """Log ``err`` with the delay, then wait it out (or until ``stop`` is set); the delay."""
        self.current = min(max(self.current * 2, MIN_BACKOFF_S), MAX_BACKOFF_S)
        delay = random.uniform(self.current / 2, self.current)
        log.warning("%s; retrying in %.2fs", err.message, delay)
        stop.wait(delay)
        return delay


def stop_on_signals(stop: Callable[[], None], log: logging.Logger, what: str) -> None:
    """SIGTERM and SIGINT call ``stop`` (which must be safe in a signal handler), logging that
    the loop finishes ``what`` first."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %s: finishing the current %s", signum, what)
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
