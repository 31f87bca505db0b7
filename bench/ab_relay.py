"""A/B of the relay's backlog drain, in process, for comparing two trees of the code.

``PYTHONPATH=<tree>/src:<tree> python bench/ab_relay.py <db> <events> <batch> <partitions>``
seeds ``events`` undelivered rows (bench/env.py), drains them with one :class:`Relay` in this
process (``run(until_idle=True)``, the collector paced as ``outbox relay`` paces it) and
prints one JSON line: events/s of the drain alone (the seeding is not timed). Run the trees
alternately on the same machine (``ab`` below).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def drain(kind: str, events: int, batch: int, partitions: int) -> dict[str, float]:
    """One run in this process, with whatever ``relay`` and ``bench`` the path imports."""
    from bench import env
    from outbox_relay.relay.daemon import Relay
    from outbox_relay.shared import gc_pace
    from outbox_relay.shared.redis_conn import connect_redis
    from outbox_relay.shared.settings import RelaySettings

    target = env.open_target(kind, tempfile.gettempdir())
    try:
        target.reset(partitions)
        target.seed(events, partitions)
        settings = RelaySettings.model_validate({
            "database_url": target.url, "redis_url": env.REDIS_URL, "key_prefix": target.prefix,
            "partitions": partitions, "batch_size": batch, "node_id": "ab",
        })
        relay = Relay(settings, target.engine, connect_redis(env.REDIS_URL))
        gc_pace.pace(settings.gc_threshold)  # as `outbox relay` runs
        t0 = time.perf_counter()
        stats = relay.run(until_idle=True)
        elapsed = time.perf_counter() - t0
        assert stats.delivered == events, stats
        return {"events_per_s": round(events / elapsed), "seconds": round(elapsed, 3)}
    finally:
        target.close()


def ab(trees: list[str], kind: str, events: int, batch: int, partitions: int,
       runs: int) -> dict[str, list[int]]:
    """Alternate the trees ``runs`` times each (fresh process per run); events/s per tree."""
    out: dict[str, list[int]] = {tree: [] for tree in trees}
    for _ in range(runs):
        for tree in trees:
            code = f"exec(open({__file__!r}).read())"  # not the script's folder on the path
            line = subprocess.run(
                [sys.executable, "-c", code, kind, str(events), str(batch), str(partitions)],
                env={**os.environ, "PYTHONPATH": f"{tree}/src{os.pathsep}{tree}"},
                cwd=tree, check=True,
                capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1]
            out[tree].append(int(json.loads(line)["events_per_s"]))
    return out


if __name__ == "__main__":
    if sys.argv[1] == "ab":  # ab <kind> <events> <batch> <partitions> <runs> <tree> <tree>...
        _, _, kind, n, b, p, r, *trees = sys.argv
        print(json.dumps(ab(trees, kind, int(n), int(b), int(p), int(r))))
    else:
        kind, n, b, p = sys.argv[1:5]
        print(json.dumps(drain(kind, int(n), int(b), int(p))))
