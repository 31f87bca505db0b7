"""The periodic progress line of a daemon: what it did since the last line, and how fast.

A relay or a consumer that only logs its start, its stop and its problems leaves an operator
watching a quiet terminal unable to tell "working" from "stuck" (issue 26: 65 s of a relay,
26 events, 3 log lines). Every ``OUTBOX_PROGRESS_INTERVAL_S`` (60 s; ``off`` or ``--quiet``:
none) each daemon logs one INFO line: the work done since the previous line, its rate, the
total since start, and what is still waiting (the relay's backlog and its oldest row, the
consumer's pending entries and lag on the streams it owns). The counters are the daemon's own
(no query for them); what is waiting costs one query or one Redis pipeline per line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Progress:
    """The counter of one kind of work, read at each line: the count since the previous
    line and its rate per second."""

    last_total: int = 0
    last_at: float = field(default_factory=time.monotonic)

    def since_last(self, total: int, now: float | None = None) -> tuple[int, float]:
        """``(done since the previous call, per second over that time)``; remembers ``total``."""
        now = time.monotonic() if now is None else now
        done, elapsed = total - self.last_total, max(now - self.last_at, 1e-9)
        self.last_total, self.last_at = total, now
        return done, done / elapsed


def age_text(seconds: float | None) -> str:
    """A wait as an operator reads it: ``0.4 s``, ``12 s``, ``3.5 min``, ``2.1 h``; ``-``
    when nothing waits."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
