"""The quick soak (``python -m torture --soak --quick``): steady load, retention on, sizes flat.

90 s at 300 events/s on each database with retention of seconds (delivered rows 20 s, receipts
25 s, streams kept 5 s; ``torture.soak.QUICK``), no faults. Sizes are sampled every 5 s; the
table sizes and stream lengths must be flat (the last third's maximum within 1.2 times the
middle third's, the middle third past the retention's warm-up), retention must have deleted
(rows and receipts pruned, entries trimmed), and the torture's checks must pass: nothing lost,
nothing duplicated, order kept. The 30-minute soak at 1,000 events/s is the same command with
``--duration 1800 --rate 1000`` (``make soak``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from torture.soak import FLAT_SERIES

pytestmark = [pytest.mark.acceptance, pytest.mark.torture, pytest.mark.timeout(300)]



@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_quick_soak_stays_flat_and_loses_nothing(tmp_path: Path, database: str) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torture", "--soak", "--quick", "--database", database,
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False,
    )
    assert out.exists(), proc.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["violations"] == [], (run["violations"], proc.stdout[-3000:])
    assert run["flatness"]["verdict"] == "flat", run["flatness"]
    assert set(run["flatness"]["series"]) == set(FLAT_SERIES)
    assert len(run["samples"]) >= 15
    assert run["events"] > 0 and run["strict_events"] > 0
    assert run["lost"] == run["duplicate_entries"] == run["duplicate_effects"] == 0
    assert run["order_violations"] == run["stream_order_violations"] == 0
    # Retention acted: the ledger holds far more than the tables kept.
    assert run["rows_pruned"] > 0 and run["receipts_pruned"] > 0 and run["entries_trimmed"] > 0
    last = run["samples"][-1]
    assert last["outbox_events"] < run["events"] and last["outbox_inbox"] < run["events"]
    assert proc.returncode == 0
