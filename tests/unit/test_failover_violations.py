"""The failover torture's verdict on its measurements (torture/harness.py
``failover_violations``): each condition fails the run when it does not hold."""

from __future__ import annotations

from torture.brokers import FailoverTally
from torture.harness import failover_violations


def test_with_wait_nothing_may_be_marked_or_lacked() -> None:
    assert failover_violations(FailoverTally(lacked=[0, 0], marked=[0, 0]), 1) == []
    assert failover_violations(FailoverTally(lacked=[0, 3], marked=[0, 0]), 1) == [
        "marked_entries_missing_after_failover:3"]
    assert failover_violations(FailoverTally(lacked=[0, 0], marked=[2, 0]), 1) == [
        "marked_without_replica_confirmation:2"]


def test_without_wait_each_failover_lacks_at_least_what_it_marked() -> None:
    assert failover_violations(FailoverTally(lacked=[5, 40], marked=[5, 10]), 0) == []
    assert failover_violations(FailoverTally(lacked=[5, 9], marked=[5, 10]), 0) == [
        "failover_lacked_less_than_marked:[(10, 9)]"]
