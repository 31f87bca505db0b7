"""``python -m bench --tiny`` runs every scenario end to end (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]


def test_bench_tiny_writes_results_and_plots(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--tiny", "--results", str(results), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(results.read_text())
    assert set(data["databases"]) == {"postgresql", "sqlite"}
    for figures in data["databases"].values():
        assert {"baseline", "relay", "consumer", "latency", "producer", "ceiling"} <= set(figures)
    assert data["memory"]["processes"].keys() == {"relay", "consumer"}
    assert {t["name"] for t in data["targets"]} >= {"RSS growth of relay (%)"}
    assert sorted(p.name for p in out.glob("*.png")) == [
        "consumer_throughput.png", "latency_cdf.png", "memory_rss.png", "relay_throughput.png",
    ]
    assert "targets:" in proc.stdout
