"""Explicit entry ids: always increasing per partition, whatever the wall clock does."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox_relay.relay import entry_ids

ms = st.integers(min_value=0, max_value=2**48)
seqs = st.integers(min_value=0, max_value=2**32)
ids = st.builds(entry_ids.format_id, ms, seqs)


@given(ms, seqs)
def test_format_and_parse_are_inverse(m: int, s: int) -> None:
    assert entry_ids.parse(entry_ids.format_id(m, s)) == (m, s)


def test_parse_accepts_an_id_without_sequence() -> None:
    assert entry_ids.parse("1700000000000") == (1700000000000, 0)


def batch(last: str, seqs: list[int], now: int) -> list[str]:
    """The ids a claim gives rows ``seqs`` (ascending) after ``last``."""
    ms = entry_ids.batch_ms(last, now)
    return [entry_ids.format_id(ms, s) for s in seqs]


@given(ids, st.lists(seqs, min_size=1, max_size=50, unique=True), ms)
def test_a_batch_is_increasing_and_after_last_whatever_its_seqs(
    last: str, rows: list[int], now: int
) -> None:
    out = batch(last, sorted(rows), now)
    chain = [last, *out]
    assert all(entry_ids.greater(b, a) for a, b in itertools.pairwise(chain))


@given(st.lists(st.tuples(st.lists(seqs, min_size=1, max_size=20, unique=True), ms),
                min_size=1, max_size=30))
def test_successive_claims_never_go_back_even_when_the_clock_or_the_seqs_do(
    steps: list[tuple[list[int], int]],
) -> None:
    last = entry_ids.ZERO
    issued: list[str] = []
    for rows, now in steps:  # a later batch may hold smaller seqs (late commits, gaps)
        out = batch(last, sorted(rows), now)
        issued += out
        last = out[-1]
    parsed = [entry_ids.parse(i) for i in issued]
    assert parsed == sorted(parsed)
    assert len(set(parsed)) == len(parsed)


@given(ids)
def test_batches_follow_the_clock_when_it_moves_ahead(last: str) -> None:
    last_ms, _ = entry_ids.parse(last)
    assert entry_ids.batch_ms(last, last_ms + 5) == last_ms + 5


def test_clock_step_back_continues_above_last() -> None:
    assert entry_ids.batch_ms("2000-5", 1000) == 2001


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [("1-1", "1-0", True), ("1-0", "1-1", False), ("2-0", "1-99", True), ("10-0", "9-0", True),
     ("1-1", "1-1", False)],
)
def test_greater_compares_numerically(a: str, b: str, expected: bool) -> None:
    assert entry_ids.greater(a, b) is expected
