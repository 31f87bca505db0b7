"""``relay.outgoing.new_batch``: the rows a take returns, built whole (``tuple.__new__``) on
its hot path, are exactly the named tuples ``OutboxRow(...)`` would build, with every field
after ``entry_id`` at its default; a row an earlier version of the relay claimed keeps its id,
is a retry, and puts the batch in id order."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from outbox_relay.relay import entry_ids
from outbox_relay.relay.outgoing import Batch, OutboxRow, new_batch

text = st.text(max_size=8)
maybe_text = st.none() | text
columns = st.tuples(  # the 12 columns a take reads before entry_id, as the driver returns them
    st.integers(min_value=1, max_value=2**40), text, text, st.integers(0, 63), maybe_text,
    maybe_text, st.none() | st.integers(0, 2**40), text, text, text, text,
    st.integers(0, 2**42),
)


def unique_seqs(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    seen: dict[int, tuple[Any, ...]] = {}
    for r in rows:
        seen.setdefault(r[0], r)
    return [seen[s] for s in sorted(seen)]


@given(st.lists(columns, min_size=1, max_size=30), st.integers(0, 2**42))
def test_fresh_rows_are_the_named_tuples_the_fields_make(
    drawn: list[tuple[Any, ...]], now: int
) -> None:
    rows: list[tuple[Any, ...]] = [(*r, None) for r in unique_seqs(drawn)]  # never claimed
    runs = [(rows[0][0], rows[-1][0])]
    batches, last, out = new_batch(rows, runs, now, "0-0", [])
    ms = entry_ids.batch_ms("0-0", now)
    expected = [OutboxRow(*r[:12], entry_ids.format_id(ms, r[0])) for r in rows]
    assert out == expected
    assert all(type(r) is OutboxRow and len(r) == len(OutboxRow._fields) for r in out)
    assert all(not r.retry and not r.check_only for r in out)
    assert batches == [Batch(runs[0][0], runs[0][1], ms)]
    assert last == entry_ids.format_id(ms, rows[-1][0])


def test_a_row_an_earlier_version_claimed_keeps_its_id_and_goes_first() -> None:
    cols = (1, "e", "s", 0, None, None, None, "t", "src", "{}", "{}", 0)
    rows = [(5, *cols[1:], None), (6, *cols[1:], "100-0")]
    _batches, _last, out = new_batch(rows, [(5, 6)], 200_000, "0-0", [])
    assert [(r.seq, r.entry_id, r.retry) for r in out] == [
        (6, "100-0", True), (5, f"{entry_ids.batch_ms('0-0', 200_000)}-5", False)]


def test_no_rows_leave_the_record_as_it_was() -> None:
    recorded = [Batch(1, 2, 3)]
    assert new_batch([], [], 10, "3-2", recorded) == (recorded, "3-2", [])
