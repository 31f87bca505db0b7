"""Explicit entry ids: always increasing per partition, whatever the wall clock does."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay import entry_ids

ms = st.integers(min_value=0, max_value=2**48)
seqs = st.integers(min_value=0, max_value=2**32)
ids = st.builds(entry_ids.format_id, ms, seqs)


@given(ms, seqs)
def test_format_and_parse_are_inverse(m: int, s: int) -> None:
    assert entry_ids.parse(entry_ids.format_id(m, s)) == (m, s)


def test_parse_accepts_an_id_without_sequence() -> None:
    assert entry_ids.parse("1700000000000") == (1700000000000, 0)


@given(ids, st.integers(min_value=1, max_value=50), ms)
def test_next_ids_are_strictly_increasing_and_after_last(last: str, count: int, now: int) -> None:
    out = entry_ids.next_ids(last, count, now)
    assert len(out) == count
    chain = [last, *out]
    assert all(entry_ids.greater(b, a) for a, b in itertools.pairwise(chain))


@given(st.lists(st.tuples(st.integers(min_value=1, max_value=20), ms), min_size=1, max_size=30))
def test_successive_claims_never_go_back_even_when_the_clock_does(
    steps: list[tuple[int, int]],
) -> None:
    last = entry_ids.ZERO
    issued: list[str] = []
    for count, now in steps:
        batch = entry_ids.next_ids(last, count, now)
        issued += batch
        last = batch[-1]
    parsed = [entry_ids.parse(i) for i in issued]
    assert parsed == sorted(parsed)
    assert len(set(parsed)) == len(parsed)


@given(ids, st.integers(min_value=1, max_value=10))
def test_ids_follow_the_clock_when_it_moves_ahead(last: str, count: int) -> None:
    last_ms, _ = entry_ids.parse(last)
    out = entry_ids.next_ids(last, count, last_ms + 1)
    assert out == [f"{last_ms + 1}-{i}" for i in range(count)]


def test_clock_step_back_continues_from_last() -> None:
    assert entry_ids.next_ids("2000-5", 2, 1000) == ["2000-6", "2000-7"]


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [("1-1", "1-0", True), ("1-0", "1-1", False), ("2-0", "1-99", True), ("10-0", "9-0", True),
     ("1-1", "1-1", False)],
)
def test_greater_compares_numerically(a: str, b: str, expected: bool) -> None:
    assert entry_ids.greater(a, b) is expected
