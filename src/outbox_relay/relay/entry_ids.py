"""Explicit stream entry ids: ``<ms>-<seq>``, strictly increasing per partition.

A taken batch's ids are ``<batch ms>-<outbox seq>``: the relay records the batch on its lease
row in the take transaction, before any ``XADD`` (so any retry uses the same ids), and writes
each row's id when it marks the row delivered. Because Redis refuses an explicit id that is not
greater than the stream's top entry, a retry of the same row can never create a second copy,
and a fenced-out relay cannot append behind a newer one.
"""

from __future__ import annotations

ZERO = "0-0"


def parse(entry_id: str) -> tuple[int, int]:
    """``"1700000000000-3"`` → ``(1700000000000, 3)``."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def format_id(ms: int, seq: int) -> str:
    """``(1700000000000, 3)`` → ``"1700000000000-3"``."""
    return f"{ms}-{seq}"


def batch_ms(last: str, now_ms: int) -> int:
    """The ``ms`` of a new batch's ids ``<ms>-<seq>``: the clock (the relay passes the
    database's, the one clock every relay host shares with the trim's keep-for cutoff), but
    above ``last``'s.

    Every id of the batch is then greater than every id assigned before, whatever its seq (a
    row committed late, or a retried gap, has a smaller seq than rows already appended). A
    clock that steps back never produces a smaller id: we continue from ``last``. At most one
    batch per millisecond and partition, so ids run ahead of the clock only above ~1,000
    batches/s and catch up when the rate falls.
    """
    return max(now_ms, parse(last)[0] + 1)


def greater(a: str, b: str) -> bool:
    """Whether entry id ``a`` sorts after ``b``."""
    return parse(a) > parse(b)
