"""A/B of the relay's ratio to the strong loop, for comparing two trees of the code.

``PYTHONPATH=<tree>/src:<tree> python bench/ab_ratio.py <db> <events> <batch> <rounds>``
drains a seeded backlog of ``events`` rows of one partition ``rounds`` times with the strong
loop (:mod:`bench.baseline`) and with one :class:`Relay` (``run(until_idle=True)``), one
after the other in this process, and prints one JSON line: ``{"loop": [...], "relay":
[...]}`` in events/s. Why both: a change to the schema (an index) moves the loop too, and on
this shared machine absolute figures drift twofold within minutes; each round's relay / loop
pair is measured seconds apart, so their ratio is what two trees compare.

``python bench/ab_ratio.py ab <db> <events> <batch> <runs> <tree> <tree>...`` alternates the
trees ``runs`` times (a fresh process of 2 rounds each) and prints per tree the paired
ratios' median and both medians.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def rounds(kind: str, events: int, batch: int, count: int) -> dict[str, list[int]]:
    """``count`` loop/relay pairs in this process, with whatever code the path imports."""
    from bench import env
    from bench.baseline import drain_baseline
    from outbox_relay.relay.daemon import Relay
    from outbox_relay.shared import gc_pace
    from outbox_relay.shared.redis_conn import connect_redis
    from outbox_relay.shared.settings import RelaySettings

    target = env.open_target(kind, tempfile.gettempdir())
    out: dict[str, list[int]] = {"loop": [], "relay": []}
    gc_pace.pace(RelaySettings().gc_threshold)  # as `outbox relay` runs, for both alike
    try:
        for _ in range(count):
            target.reset(1)
            target.seed(events, 1)
            t0 = time.perf_counter()
            assert drain_baseline(target, 0, batch) == events
            out["loop"].append(round(events / (time.perf_counter() - t0)))
            target.reset(1)
            target.seed(events, 1)
            settings = RelaySettings.model_validate({
                "database_url": target.url, "redis_url": env.REDIS_URL,
                "key_prefix": target.prefix, "partitions": 1, "batch_size": batch,
                "node_id": "ab"})
            client = connect_redis(env.REDIS_URL)
            relay = Relay(settings, target.engine, client)
            t0 = time.perf_counter()
            assert relay.run(until_idle=True).delivered == events
            out["relay"].append(round(events / (time.perf_counter() - t0)))
            client.close()
    finally:
        target.close()
    return out


def ab(trees: list[str], kind: str, events: int, batch: int, runs: int) -> dict[str, object]:
    """Alternate the trees ``runs`` times each (fresh process per run)."""
    got: dict[str, dict[str, list[int]]] = {t: {"loop": [], "relay": []} for t in trees}
    for _ in range(runs):
        for tree in trees:
            code = f"exec(open({__file__!r}).read())"  # not the script's folder on the path
            line = subprocess.run(
                [sys.executable, "-c", code, kind, str(events), str(batch), "2"],
                env={**os.environ, "PYTHONPATH": f"{tree}/src{os.pathsep}{tree}"},
                cwd=tree, check=True, capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1]
            for name, values in json.loads(line).items():
                got[tree][name] += values
    return {tree: {
        "relay / loop (median of pairs)": round(statistics.median(
            r / b for r, b in zip(v["relay"], v["loop"], strict=True)), 3),
        "relay": statistics.median(v["relay"]), "loop": statistics.median(v["loop"]),
        "pairs": len(v["relay"]),
    } for tree, v in got.items()}


if __name__ == "__main__":
    if sys.argv[1] == "ab":  # ab <kind> <events> <batch> <runs> <tree> <tree>...
        _, _, kind, n, b, r, *trees = sys.argv
        print(json.dumps(ab(trees, kind, int(n), int(b), int(r))))
    else:
        kind, n, b, c = sys.argv[1:5]
        print(json.dumps(rounds(kind, int(n), int(b), int(c))))
