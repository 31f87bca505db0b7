"""Start-up that waits out a database or Redis that is not there yet (or restarting).

A daemon started next to its database (compose, a rolling restart, a killed session) must not
exit just because the first connection failed: its run loop retries with backoff, and so must
the steps before it (schema check, recovery sweep). Only ``unavailable`` is retried; a schema
that is too new or not migrated, or a bad setting, fails at once.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from outbox_relay.shared.errors import UnavailableError

T = TypeVar("T")
log = logging.getLogger("outbox.startup")


def until_available(step: Callable[[], T], what: str, patience_s: float) -> T:
    """Run ``step``, retrying :class:`UnavailableError` with capped, jittered backoff for up to
    ``patience_s`` seconds; then raise the last error."""
    deadline = time.monotonic() + patience_s
    backoff = 0.1
    while True:
        try:
            return step()
        except UnavailableError as err:
            if time.monotonic() + backoff > deadline:
                raise
            delay = random.uniform(backoff / 2, backoff)
            log.warning("%s: %s; retrying in %.1fs", what, err.message, delay)
            time.sleep(delay)
            backoff = min(backoff * 2, 5.0)
