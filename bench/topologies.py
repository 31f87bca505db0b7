"""Private Redis Clusters for the cluster rows: 1 master and 3 masters, no replicas, no AOF.

Both are :class:`torture.redis_sets.LocalCluster` (``redis-server --cluster-enabled yes``
children on free loopback ports, stopped by pid). ``LocalCluster`` builds its cluster with
``redis-cli --cluster create``, which wants at least 3 masters; the 1-master topology
(:class:`OneMasterCluster`) is the same class with one node that assigns itself every slot
(``CLUSTER ADDSLOTSRANGE 0 16383``), so both rows run the very same cluster client code
(``redis+cluster://`` URLs: one ``EVALSHA`` per partition stream, ``XREADGROUP`` split per
stream), and only the number of masters differs.

These servers are ours alone, so between runs they are emptied with ``FLUSHALL`` (never the
shared Redis on 6379, whose keys the benchmark deletes by prefix).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from outbox_relay.shared import keys
from outbox_relay.shared.redis_conn import connect_redis
from torture.redis_sets import LocalCluster, TopologyError, node_client


class OneMasterCluster(LocalCluster):
    """A one-node Redis Cluster holding all 16,384 slots."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, masters=3, replicas=0, appendonly=False)
        self.masters = 1  # LocalCluster's own check wants 3 for redis-cli --cluster create

    def _create(self, cli: str, ports: list[int]) -> None:
        del cli
        if len(ports) != 1:
            raise TopologyError(f"a one-master cluster has one node, not {len(ports)}")
        with node_client(ports[0]) as c:
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)


@dataclass
class Topology:
    """A started cluster, its URL, a cluster client and its master ports."""

    name: str
    cluster: LocalCluster
    url: str
    client: redis.Redis
    masters: list[int]

    def flush(self) -> None:
        """Empty every master (ours alone; see the module doc)."""
        for port in self.masters:
            with node_client(port) as c:
                c.flushall()

    def cpu_seconds(self) -> dict[int, float]:
        """``used_cpu_user + used_cpu_sys`` of every master (``INFO cpu``)."""
        out = {}
        for port in self.masters:
            with node_client(port) as c:
                info: dict[str, Any] = c.info("cpu")
            out[port] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        return out

    def commandstats(self) -> dict[str, dict[str, float]]:
        """``INFO commandstats`` summed over the masters: calls and µs per command."""
        total: dict[str, dict[str, float]] = {}
        for port in self.masters:
            with node_client(port) as c:
                stats: dict[str, Any] = c.info("commandstats")
            for name, v in stats.items():
                entry = total.setdefault(name.removeprefix("cmdstat_"), {"calls": 0, "usec": 0})
                entry["calls"] += float(v["calls"])
                entry["usec"] += float(v["usec"])
        return total

    def reset_stats(self) -> None:
        for port in self.masters:
            with node_client(port) as c:
                c.config_resetstat()

    def partitions_per_master(self, stream: str, partitions: int) -> list[int]:
        """How many of the partition streams each master holds (by slot)."""
        owner = {}
        for n in self.cluster.view():
            if n.is_master:
                for lo, hi in n.slots:
                    owner[(lo, hi)] = n.port
        counts = dict.fromkeys(self.masters, 0)
        for p in range(partitions):
            slot = key_slot(keys.stream_key("x", stream, p).encode())
            port = next(port for (lo, hi), port in owner.items() if lo <= slot <= hi)
            counts[port] += 1
        return [counts[port] for port in self.masters]

    def close(self) -> None:
        self.client.close()
        self.cluster.stop()


def start(name: str, masters: int, workdir: Path) -> Topology:
    """Start a cluster of ``masters`` masters (1 or >= 3) under ``workdir``."""
    cluster = (OneMasterCluster(workdir) if masters == 1
               else LocalCluster(workdir, masters=masters, replicas=0, appendonly=False))
    cluster.start()
    try:
        url = cluster.url
        client = connect_redis(url)
        return Topology(name, cluster, url, client, cluster.master_ports())
    except BaseException:
        cluster.stop()
        raise


@contextmanager
def started(specs: list[tuple[str, int]], workdir: Path) -> Iterator[list[Topology]]:
    """Start every ``(name, masters)`` topology; stop them all at the end."""
    up: list[Topology] = []
    try:
        for name, masters in specs:
            up.append(start(name, masters, workdir / name.replace(" ", "-")))
        yield up
    finally:
        for t in up:
            t.close()
