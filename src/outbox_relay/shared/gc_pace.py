"""The garbage collector's pace in a daemon: how many new container objects start a young
collection (``gc.set_threshold``'s first number).

Why: a consumer's claim holds tens of thousands of young objects for its whole length (the
batch's entries, events, handler arguments, SQLAlchemy and psycopg objects), and at Python's
default of 700 the collector starts a young collection every few events, walking those live
objects again each time and moving them into older generations whose collections walk them
once more. Raised to 10,000 (the older generations' counts kept), the same claims took ~30 %
less CPU with a one-row handler and ~20 % less with none (``bench/PERFORMANCE.md``). Only
objects in reference cycles wait for the collector at all; every other object is still freed
the moment it is no longer used, so memory grows by at most the cycles of 10,000 allocations.

It changes the whole process, so the library never sets it on its own: ``outbox relay`` and
``outbox consume`` do (``OUTBOX_GC_THRESHOLD``, 0 leaves Python's), and a service that runs a
:class:`~outbox_relay.consumer.daemon.Consumer` in its own process may call :func:`pace`.
"""

from __future__ import annotations

import gc

DEFAULT_THRESHOLD = 10_000


def pace(threshold: int = DEFAULT_THRESHOLD) -> None:
    """Start a young collection every ``threshold`` new container objects (0 or less: leave
    the collector as it is). The older generations' thresholds are kept."""
    if threshold <= 0:
        return
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(threshold, middle, old)
