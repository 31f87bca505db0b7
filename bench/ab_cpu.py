"""A/B of the relay's CPU per event, in process, for comparing two trees of the code.

Like ``bench/ab_relay.py``, but the figure is the relay process's CPU time per delivered event
(``time.process_time`` over the drain: every thread, and SQLite's work, which runs in the
process), not events/s: on a busy machine wall time mostly measures the other jobs, CPU time
much less so. PostgreSQL's backend CPU is not counted (it is not the relay's Python).

``python bench/ab_cpu.py ab <sqlite|postgresql> <events> <batch> <runs> <tree> <tree>...``
alternates the trees ``runs`` times (a fresh process per run, seeding untimed) and prints each
tree's µs per event: the runs, their median and spread ``(max - min) / median``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def drain(kind: str, events: int, batch: int) -> dict[str, float]:
    """One drain of one partition in this process, with whatever code the path imports."""
    from bench import env
    from outbox_relay.relay.daemon import Relay
    from outbox_relay.shared.redis_conn import connect_redis
    from outbox_relay.shared.settings import RelaySettings

    target = env.open_target(kind, tempfile.gettempdir())
    try:
        target.reset(1)
        target.seed(events, 1)
        settings = RelaySettings.model_validate({
            "database_url": target.url, "redis_url": env.REDIS_URL, "key_prefix": target.prefix,
            "partitions": 1, "batch_size": batch, "node_id": "ab-cpu",
        })
        relay = Relay(settings, target.engine, connect_redis(env.REDIS_URL))
        t0, cpu0 = time.perf_counter(), time.process_time()
        stats = relay.run(until_idle=True)
        cpu, elapsed = time.process_time() - cpu0, time.perf_counter() - t0
        assert stats.delivered == events, stats
        return {"cpu_us_per_event": round(cpu * 1e6 / events, 2),
                "events_per_s": round(events / elapsed)}
    finally:
        target.close()


def ab(trees: list[str], kind: str, events: int, batch: int, runs: int) -> dict[str, Any]:
    """Alternate the trees ``runs`` times each; CPU µs per event per tree."""
    out: dict[str, list[float]] = {tree: [] for tree in trees}
    for _ in range(runs):
        for tree in trees:
            code = f"exec(open({__file__!r}).read())"  # not the script's folder on the path
            line = subprocess.run(
                [sys.executable, "-c", code, kind, str(events), str(batch)],
                env={**os.environ, "PYTHONPATH": f"{tree}/src{os.pathsep}{tree}"},
                cwd=tree, check=True,
                capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1]
            out[tree].append(json.loads(line)["cpu_us_per_event"])
    return {
        tree: {"runs": values, "median": statistics.median(values),
               "spread": round((max(values) - min(values)) / statistics.median(values), 3)}
        for tree, values in out.items()
    }


if __name__ == "__main__":
    if sys.argv[1] == "ab":  # ab <kind> <events> <batch> <runs> <tree> <tree>...
        _, _, kind, n, b, r, *trees = sys.argv
        print(json.dumps(ab(trees, kind, int(n), int(b), int(r)), indent=1))
    else:
        kind, n, b = sys.argv[1:4]
        print(json.dumps(drain(kind, int(n), int(b))))
