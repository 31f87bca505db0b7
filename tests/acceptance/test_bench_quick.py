"""``python -m bench --tiny`` runs every scenario end to end (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = [pytest.mark.acceptance, pytest.mark.torture]



def test_bench_tiny_writes_results_and_plots(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--tiny", "--results", str(results), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(results.read_text())
    assert set(data["databases"]) == {"postgresql", "sqlite"}
    for figures in data["databases"].values():
        assert {"baseline", "relay", "consumer", "latency", "producer", "ceiling"} <= set(figures)
        rows = figures["consumer_handlers"]["rows"]  # issue 23: against the hand-written loop
        assert set(rows) == {"loop", "no-op", "one-row", "one-row unpipelined", "batch",
                             "async one-row"}
        assert rows["loop"]["ratio"] == 1.0 and all(r["median"] > 0 for r in rows.values())
        sweep = figures["capacity"]  # issue 24: the sustained-rate sweep
        assert set(sweep["rows"]) == {"200"} and sweep["threads"] == 2
        row = sweep["rows"]["200"]
        assert row["achieved"]["median"] > 0 and row["produced"]["median"] > 0
        assert row["p50"]["median"] <= row["p99"]["median"]
        assert sweep["capacity"] in (0, 200)
        batched = sweep["batched"]  # the same by writers committing what is due
        assert set(batched["rows"]) == {"200"} and batched["per_txn"] == 10
        assert batched["rows"]["200"]["achieved"]["median"] > 0
        assert batched["capacity"] in (0, 200)
    assert {t["name"] for t in data["targets"]} >= {
        "postgresql consumer, one-row handler / hand-written loop",
        "postgresql consumer, batch handler / hand-written loop",
        "postgresql consumer, no-op handler / hand-written loop",
        "postgresql consumer, async one-row handler / hand-written loop",
        "postgresql capacity, ev/s with p99 <= 100 ms, one event per transaction",
        "postgresql capacity, ev/s with p99 <= 100 ms, writers committing what is due "
        "(<= 10 per transaction)",
    }
    assert data["memory"]["processes"].keys() == {"relay", "consumer"}
    assert {t["name"] for t in data["targets"]} >= {"RSS growth of relay (%)"}
    assert sorted(p.name for p in out.glob("*.png")) == [
        "consumer_throughput.png", "latency_cdf.png", "memory_rss.png", "relay_throughput.png",
    ]
    assert "targets:" in proc.stdout
