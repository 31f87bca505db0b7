"""The relay's counters since start: what :meth:`relay.daemon.Relay.run` returns, logged at
shutdown and read by the metrics (relay/metrics.py), tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RelayStats:
    """Counters since start (logged at shutdown, read by tests and benchmarks)."""

    rounds: int = 0
    delivered: int = 0
    already_present: int = 0
    ordering_gaps: int = 0
    failed: int = 0
    not_appended: int = 0  # rows left behind a gap or refusal in their stream (taken again)
    unknown_outcomes: int = 0
    lease_losses: int = 0
    lease_acquisitions: int = 0  # partitions taken (or taken again under a new epoch)
