"""Failover as a torture fault (``python -m torture --quick --redis cluster|sentinel``).

The real daemons run against a local Redis Cluster (3 masters, 1 replica each, AOF) or a
Sentinel set (1 master, 1 replica, 3 Sentinels) while the harness kills daemons at every fault
point, stalls masters and fails masters over: it cuts a replica off its master's replication
stream for 1-5 s while a burst of events is committed, kills the master, and counts, before the
replica is promoted, the entries the outbox had marked delivered that the replica lacks
(torture/brokers.py).

- With ``OUTBOX_WAIT_REPLICAS=1`` that count must be 0 at every failover: the relay marks
  nothing a replica has not confirmed (the harness makes any other count a violation).
- Without it the promoted replica lacks entries the outbox calls delivered (a failover goes
  ahead only once some burst events were marked), and the relay's repair must put every one of
  them back: the final check finds nothing lost, duplicated, applied twice or out of order,
  with retention on (entries the old master had trimmed may come back with the group's older
  position: they are ``resurrected``, acknowledged and never applied again).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from torture.brokers import REPLICATED_FAULTS

pytestmark = [pytest.mark.acceptance, pytest.mark.torture, pytest.mark.timeout(400)]



@pytest.mark.parametrize(("topology", "wait", "database"), [
    ("cluster", 1, "postgresql"),
    ("sentinel", 0, "sqlite"),
])
def test_failovers_lose_duplicate_and_reorder_nothing(
    tmp_path: Path, topology: str, wait: int, database: str,
) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torture", "--quick", "--database", database, "--redis",
         topology, "--wait-replicas", str(wait), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=390, check=False,
    )
    assert out.exists(), proc.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["violations"] == [], (run, proc.stdout[-3000:])
    assert run["redis"] == topology and run["wait_replicas"] == wait
    for fault in REPLICATED_FAULTS:
        assert run["infra_faults"].get(fault, 0) >= 1, run["infra_faults"]
    assert run["failovers"] >= 1
    assert len(run["lacked_per_failover"]) + run["failovers_unmeasured"] == run["failovers"]
    assert run["lost"] == run["duplicate_entries"] == run["duplicate_effects"] == 0
    assert run["order_violations"] == run["stream_order_violations"] == 0
    assert run["undelivered"] == run["pending"] == 0 and run["events"] > 0
    measured = list(zip(run["marked_per_failover"], run["lacked_per_failover"], strict=True))
    assert measured, run
    if wait:  # nothing was marked while the replica was cut off, nothing marked went missing
        assert all(marked == lacked == 0 for marked, lacked in measured), measured
    else:
        # Every failover went ahead only with burst events marked, and the promoted replica
        # lacked at least those (appended after the cut-off); repair put them back.
        assert all(lacked >= marked > 0 for marked, lacked in measured), measured
        assert run["repaired_entries"] > 0
    assert proc.returncode == 0
