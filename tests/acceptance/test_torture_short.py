"""The short torture run (``python -m torture --quick --run-worker``) as part of ``make test``.

Real daemons as subprocesses on SQLite and PostgreSQL with a Redis of the harness's own,
including 2 run workers; every producer, relay, consumer and worker fault point fires at least
once, Redis is SIGKILLed, restarted empty and stalled, PostgreSQL sessions are terminated.
Three producer threads write the same aggregates (compare-and-set revisions, transactions held
open) and handlers fail transiently; the verdict must be clean, every created run terminal, and
order kept: no stream or apply-order violation, no ``out_of_order`` letter, no strict event
skipped (design.md flow 3, invariant 6).

Consumers and workers are paused (SIGSTOP/SIGCONT), most of the time for longer than their
3 s lease (issue 21). The handlers' downstream is down for 15 s mid-run: every call fails, and
afterwards every event is applied once, in order, with no dead letter (invariant 9). A quarter
of the ``item.changed`` events chain one hop: their handler enqueues an ``item.relayed`` event
on its claim connection, which a second group applies; the ledger checks the chain end to end.

Retention runs throughout (the harness's default, ``torture.harness.AGGRESSIVE``): streams are
trimmed each second down to what a group still needs, delivered rows pruned after 20 s and
receipts after 30 s; the run must show that they deleted (rows and receipts pruned, entries
trimmed, counted from the torture's ledger) and that every disappearance met its condition.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from torture.brokers import QUICK_FAULTS
from torture.chaos import DB_FAULT, POINTS_BY_KIND

pytestmark = [pytest.mark.acceptance, pytest.mark.torture, pytest.mark.timeout(660)]

KILLED_KINDS = ("producer", "relay", "consumer", "worker")


def test_quick_torture_on_both_databases_loses_duplicates_and_reorders_nothing(
    tmp_path: Path,
) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torture", "--quick", "--database", "both", "--run-worker",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=650, check=False,
    )
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for run in report["runs"]:
        assert run["violations"] == [], (run, proc.stdout[-3000:])
        assert run["events"] > 0
        assert run["runs"] > 0
        assert run["run_worker"] is True
        assert run["runs_not_terminal"] == 0
        assert run["lost"] == run["duplicate_entries"] == run["duplicate_effects"] == 0
        assert run["order_violations"] == run["stream_order_violations"] == 0
        assert run["out_of_order"] == run["skipped"] == run["not_applied"] == 0
        assert run["strict_events"] > 0  # the concurrent writers' strict types were tested
        assert run["handler_failures"] > 0  # and some handler calls failed, then retried
        # Pauses outlasting the consumer lease, and shorter ones (issue 21).
        assert run["pauses_past_lease"] >= 1 and run["pauses_short"] >= 1, run["pauses"]
        # The downstream outage: calls failed throughout, nothing dead (issue 22).
        assert run["outage_seconds"] >= 15 and run["outage_failures"] > 0
        assert run["dead_letters"] == 0
        # The chained hop, end to end.
        assert run["chained_events"] == run["chain_sources"] == run["chained_applied"] > 0
        assert run["chain_missing"] == run["chain_orphans"] == 0
        for kind in KILLED_KINDS:
            for point in POINTS_BY_KIND[kind]:
                assert run["kills"].get(point, 0) >= 1, (run["database"], point)
        for fault in QUICK_FAULTS:
            assert run["infra_faults"].get(fault, 0) >= 1
        # Each empty restart destroyed entries the outbox had marked delivered (counted while
        # Redis refused every write, torture/brokers.py): only the repair brings those back.
        destroyed = run["destroyed_per_empty_restart"]
        assert len(destroyed) == run["infra_faults"]["redis.restart_empty"]
        assert all(n > 0 for n in destroyed), destroyed
        assert run["repaired_entries"] > 0
        retained = run["retention"]
        assert retained["settings"]["OUTBOX_STREAM_TRIM"] == "true"  # on by default
        assert run["rows_pruned"] > 0 and run["receipts_pruned"] > 0, retained
        assert run["entries_trimmed"] > 0 and retained["trimmed_recorded"] > 0, retained
        # The ledger and the tables agree on what was pruned.
        assert retained["outbox_rows"] + run["rows_pruned"] == run["events"]
        assert retained["receipts_pruned"] == run["receipts_pruned"]
        assert run["rows_missing"] == run["receipts_pruned_wrongly"] == 0
        assert run["foreign_receipts"] == run["lost_receipts"] == 0
    postgres = next(r for r in report["runs"] if r["database"] == "postgresql")
    assert postgres["infra_faults"].get(DB_FAULT, 0) >= 1
    assert proc.returncode == 0
