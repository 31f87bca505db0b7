"""The relay's 1 x 1 rows measured run for run with the strong baseline (bench/run.py): their
run-by-run ratios, also after two passes are merged (bench/report.py)."""

from __future__ import annotations

from typing import Any

from bench import report


def one_pass(loop: list[float], relay: list[float]) -> dict[str, Any]:
    return {"baseline": {"500": report.summary(loop)},
            "relay": {"b500 p1": {**report.summary(relay), "alternated_with_baseline": True},
                      "b500 p2": report.summary([r * 2 for r in relay])}}


def test_an_alternated_row_is_paired_run_by_run_and_others_are_not() -> None:
    r = one_pass([100.0, 50.0], [90.0, 60.0])
    report.add_ratios(r, "sqlite")
    row = r["relay"]["b500 p1"]
    assert row["paired_ratios"] == [0.9, 1.2]  # each to the loop's run of its round
    assert row["ratio"] == 75.0 / 75.0  # the medians' ratio stays what the targets read
    assert "paired_ratios" not in r["relay"]["b500 p2"]  # measured apart: no pairs to take
    assert "(run by run 0.90 / 1.20, median 1.05)" in report._paired_text(row)


def test_rows_of_unequal_runs_get_no_pairs() -> None:
    """A row with runs missing on one side is not paired by position (and the report, written
    after the whole run was measured, does not fail on it)."""
    r = one_pass([100.0, 50.0], [90.0])
    report.add_ratios(r, "sqlite")
    assert "paired_ratios" not in r["relay"]["b500 p1"] and "ratio" in r["relay"]["b500 p1"]


def test_merged_passes_pair_every_run_in_order() -> None:
    first, second = one_pass([100.0, 50.0], [90.0, 60.0]), one_pass([80.0, 40.0], [40.0, 40.0])
    for p in (first, second):
        report.add_ratios(p, "sqlite")
    merged = report.merge_passes([{"sqlite": first}, {"sqlite": second}])["sqlite"]
    assert merged["relay"]["b500 p1"]["paired_ratios"] == [0.9, 1.2, 0.5, 1.0]
    assert merged["relay"]["b500 p1"]["alternated_with_baseline"] is True
