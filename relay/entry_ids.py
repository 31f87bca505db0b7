"""Explicit stream entry ids: ``<ms>-<seq>``, strictly increasing per partition.

The relay picks each row's id in its claim transaction, before any ``XADD``. Because Redis
refuses an explicit id that is not greater than the stream's top entry, a retry of the same row
can never create a second copy, and a fenced-out relay cannot append behind a newer one.
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


def next_ids(last: str, count: int, now_ms: int) -> list[str]:
    """``count`` ids, each greater than ``last``, tracking the wall clock when it moves ahead.

    A clock that steps back never produces a smaller id: we continue from ``last``.
    """
    last_ms, last_seq = parse(last)
    if now_ms > last_ms:
        return [format_id(now_ms, i) for i in range(count)]
    return [format_id(last_ms, last_seq + 1 + i) for i in range(count)]


def greater(a: str, b: str) -> bool:
    """Whether entry id ``a`` sorts after ``b``."""
    return parse(a) > parse(b)
