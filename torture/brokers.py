"""The Redis the torture breaks: one server, a Redis Cluster, or a Sentinel set.

Each broker starts its topology, gives the daemons its URL and the harness a client, and
inflicts its faults when the chaos loop asks (:meth:`Broker.inflict`):

- :class:`SingleRedis` (``--redis single``): ``redis.kill_persistent`` (SIGKILL, restart from
  its AOF), ``redis.restart_empty`` (restart with nothing) and ``redis.stall`` (SIGSTOP).
  An empty restart must destroy something the repair has to put back: the harness first
  stops every write (``CLIENT PAUSE … WRITE``: no append, acknowledgement or trim can move
  the streams any more), lists the partition streams' entries and counts those the outbox
  had marked delivered (:meth:`Probe.marked_among`). With none, it unpauses and tries again
  a second later; otherwise it kills and restarts with nothing, and records the count
  (``destroyed``). Each of those entries is at or above its stream's trim floor (it was still
  in the stream after every trim so far) and its row is marked, so only the relay's repair
  can bring it back: a run with an empty restart must show repaired entries, and the final
  check must find every one of them delivered.
- :class:`ClusterRedis` (``--redis cluster``: 3 masters, 1 replica each, AOF) and
  :class:`SentinelRedis` (``--redis sentinel``: 1 master, 1 replica, 3 Sentinels):
  ``redis.failover`` and ``redis.stall`` (a master stopped for less than the failure timeout).

A failover first cuts the replica off its master's replication stream
(:meth:`LocalCluster.cut_off`) and, while the load goes on, commits a burst of events to the
master's partition streams and waits until the outbox marked them delivered or 1-5 s passed,
restarting dead daemons meanwhile (the chaos loop's ``tend``: the failover holds the loop);
the count of burst events marked by then is recorded. Then it kills the master: the replica is
promoted without what the master took meanwhile. Right after the kill, while the replica is
still a replica (checked: otherwise the measurement is dropped and counted as unmeasured), the
harness counts the entries the outbox had marked delivered on that master's streams that the
replica does not hold (:meth:`Probe.lacked`). An entry the replica lacks has an id above the
replica's ``last-generated-id`` (replication is ordered, and the relay's ids only grow), so
trimmed entries are never mistaken for lost ones.

With ``OUTBOX_WAIT_REPLICAS=1`` the relay marks nothing a replica has not confirmed, and the
only replica is cut off: both the burst marked and the lacked count must be 0 (the harness
makes any other count a violation). Without it every burst event marked before the kill was
appended after the cut-off, so the lacked count is at least the marked count (anything less
is a violation: the probe would be measuring nothing), and the relay's repair must put every
lacked entry back (the final check finds nothing lost). A failover whose burst was not marked
at all in time (``expect_marks``: without WAIT) would test nothing: it is called off (the
replica resumes and reconnects; counted as ``aborted``) and tried again a second later, as is
one that picked a cluster master holding no partition of the burst's stream. The
killed master is restarted and rejoins as a replica of the promoted one before the next fault.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import redis

from outbox_relay.shared.redis_conn import connect_redis
from torture.procs import RedisServer
from torture.redis_sets import LocalCluster, LocalSentinelSet, node_client, wait_for

log = logging.getLogger("torture")

QUICK_FAULTS = ("redis.kill_persistent", "redis.restart_empty", "redis.stall")
SINGLE_FAULTS = (*QUICK_FAULTS, "redis.refuse_appends")
REFUSAL_WAIT_S = 5.0  # longest wait for a relay to be refused once maxmemory is set
REPLICATED_FAULTS = ("redis.failover", "redis.stall")
CUT_OFF_S = (1.0, 5.0)  # below the failure timeout: the stopped replica must stay electable
NODE_TIMEOUT_MS = 6_000
STALL_S = (0.5, 1.5)  # well below the failure timeout: a stall is not a failover

class Probe(Protocol):
    """What a failover asks of the harness (torture/harness.py ``LedgerProbe``)."""

    def burst(self, keys: list[str]) -> list[str]:
        """Commit a few events whose partition streams are among ``keys``; their ids."""
        ...

    def can_burst(self, keys: list[str]) -> bool:
        """Whether :meth:`burst` would commit anything to ``keys``."""
        ...

    def marked(self, event_ids: list[str]) -> int:
        """How many of ``event_ids`` the outbox marked delivered."""
        ...

    def lacked(self, replica: redis.Redis, keys: list[str]) -> int:
        """How many entries the outbox marked delivered on ``keys`` the replica lacks: those
        above the replica's ``last-generated-id`` of their stream."""
        ...

    def marked_among(self, entries: dict[str, list[str]]) -> int:
        """How many of ``entries`` (stream key: entry ids) the outbox marked delivered."""
        ...

    def oom_attempts(self) -> dict[int, int] | None:
        """The undelivered outbox rows whose last append Redis refused for memory
        (``last_error = 'redis_oom'``): ``{seq: attempts}``; None when the outbox could not be
        read (the database is being broken too)."""
        ...


@dataclass
class FailoverTally:
    """What the failovers did: how many, and what the promoted replicas lacked."""

    failovers: int = 0
    lacked: list[int] = field(default_factory=list)  # per measured failover
    marked: list[int] = field(default_factory=list)  # burst events marked before each kill
    unmeasured: int = 0  # the replica was promoted before the measurement finished
    aborted: int = 0  # called off: no burst event was marked in time (without WAIT)


class Broker(Protocol):
    """What the chaos loop and the harness need of the Redis under test."""

    url: str
    faults: tuple[str, ...]
    failovers: FailoverTally

    def client(self) -> redis.Redis: ...

    def inflict(self, fault: str, rng: random.Random, tend: Callable[[], None]) -> bool:
        """Inflict ``fault``; False if nothing was done (try again soon). ``tend`` restarts
        dead daemons: call it while waiting on them."""
        ...

    def resume(self) -> None: ...

    def stop(self) -> None: ...


class SingleRedis:
    """One ``redis-server`` with AOF (:class:`torture.procs.RedisServer`)."""

    faults: tuple[str, ...] = SINGLE_FAULTS

    def __init__(
        self, workdir: Path, stream_keys: list[str], probe: Probe,
        stall_s: tuple[float, float] = (1.0, 3.0), faults: tuple[str, ...] = SINGLE_FAULTS,
    ) -> None:
        self.faults = faults
        self.server = RedisServer(workdir)
        self.server.start()
        self.url = self.server.url
        self.stream_keys = stream_keys
        self.probe = probe
        self.stall_s = stall_s
        self.failovers = FailoverTally()
        self.destroyed: list[int] = []  # marked entries each empty restart destroyed
        self.refused: list[int] = []  # writes refused (OOM) by each refuse_appends fault
        self.unmet = 0  # refuse_appends faults during which no relay tried to append

    def client(self) -> redis.Redis:
        return self.server.client()

    def inflict(self, fault: str, rng: random.Random, tend: Callable[[], None]) -> bool:
        """False (nothing done) for an empty restart that would destroy no entry the outbox
        marked delivered: losing nothing would prove nothing about the repair."""
        if fault == "redis.restart_empty":
            destroyed = self._pause_and_count_marked()
            if not destroyed:
                self._unpause()
                return False
            log.info("broker fault: %s (%d marked entries destroyed)", fault, destroyed)
            self.server.kill()
            self.server.start(wipe=True)
            self.destroyed.append(destroyed)
            return True
        if fault == "redis.refuse_appends":
            return self._refuse_appends(rng, tend)
        log.info("broker fault: %s", fault)
        if fault == "redis.kill_persistent":
            self.server.kill()
            self.server.start()
        else:
            self.server.pause()
            time.sleep(rng.uniform(*self.stall_s))  # the stall itself, not a wait
            self.server.resume()
        return True

    def _refuse_appends(self, rng: random.Random, tend: Callable[[], None]) -> bool:
        """Redis refuses every write that needs memory (``maxmemory 1``, ``noeviction``: the
        relay's append scripts answer OOM) while a burst of events is committed, until a
        relay has tried to append one of them and been refused (the outbox records the failed
        attempt), then for a stall's length; then takes writes again. The relay must back off
        and deliver everything after (the verdict requires its refusal lines). When no relay
        was refused within :data:`REFUSAL_WAIT_S`, the try is counted as unmet (the verdict
        needs at least one met) and the loop goes on: a failed try costs one short wait.
        Nothing is done (False) when the outbox cannot be read first: without the rows refused
        before, a refusal of an earlier fault would pass for one of this fault."""
        refused_rows = self.probe.oom_attempts()
        if refused_rows is None:
            return False
        client = self.server.client()
        refused = 0
        try:
            before = (_oom_errors(client), _failed_scripts(client))
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", 1)
            self.probe.burst(self.stream_keys)  # something to append, whatever the backlog

            def relay_refused() -> bool:
                # A refused XADD is recorded on the row it was for, the first of its batch
                # (the rest are not appended): a row of a backlog ahead of the burst as well as
                # a burst row. A refused retried batch is not recorded (the relay retries it
                # under its ids): then Redis counted a script refused with OOM (only the
                # relay's scripts write with commands Redis refuses at maxmemory).
                now = self.probe.oom_attempts() or {}  # unreadable now: ask again
                return any(n > refused_rows.get(seq, 0) for seq, n in now.items()) or (
                    _oom_errors(client) > before[0] and _failed_scripts(client) > before[1])

            deadline = time.monotonic() + REFUSAL_WAIT_S
            while not relay_refused() and time.monotonic() < deadline:
                tend()  # a relay killed meanwhile is restarted, so one gets to try
                time.sleep(0.1)  # polling the outbox's and Redis's records of the attempt
            if relay_refused():
                refused = max(_oom_errors(client) - before[0], 1)
                time.sleep(rng.uniform(*self.stall_s))  # the refusal lasts: the fault itself
            else:
                self.unmet += 1  # no relay tried meanwhile; the verdict needs one that did
        except (redis.ConnectionError, redis.TimeoutError):
            return False
        finally:
            # Down: it restarts from its command line, without the limit.
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                client.config_set("maxmemory", 0)
            client.close()
        if refused:
            log.info("broker fault: redis.refuse_appends (%d writes refused with OOM)", refused)
            self.refused.append(refused)
        else:
            log.info("broker fault: redis.refuse_appends (no relay tried to append)")
        return True  # a failed try costs one wait, never a loop of them

    def _pause_and_count_marked(self) -> int:
        """Stop every client's writes (10 s at most: the kill follows at once, or
        :meth:`_unpause`), then count the partition streams' entries the outbox marked
        delivered: exactly what a kill now destroys of what only repair can put back."""
        client = self.server.client()
        try:
            client.client_pause(10_000, all=False)  # WRITE mode: reads still answer
            present = {k: [_text(entry_id) for entry_id, _ in client.xrange(k) or []]
                       for k in self.stream_keys}
        except (redis.ConnectionError, redis.TimeoutError):
            return 0
        finally:
            client.close()
        return self.probe.marked_among({k: ids for k, ids in present.items() if ids})

    def _unpause(self) -> None:
        client = self.server.client()
        try:
            client.client_unpause()
        except (redis.ConnectionError, redis.TimeoutError):
            pass  # down: nothing is paused any more
        finally:
            client.close()

    def resume(self) -> None:
        self.server.resume()

    def stop(self) -> None:
        self.server.stop()


def _oom_errors(client: redis.Redis) -> int:
    """Commands Redis has refused with OOM since it started (``INFO errorstats``)."""
    stats = client.info("errorstats")
    entry = stats.get("errorstat_OOM") or {}
    return int(entry.get("count", 0)) if isinstance(entry, dict) else 0


def _failed_scripts(client: redis.Redis) -> int:
    """Scripts that ended in an error since Redis started (``INFO commandstats``)."""
    stats = client.info("commandstats")
    return sum(int(v.get("failed_calls", 0)) for k, v in stats.items()
               if k in ("cmdstat_evalsha", "cmdstat_eval") and isinstance(v, dict))


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Replicated:
    """A master/replica topology under fault: the failover and stall both kinds share.

    Subclasses say where the topology is (``self.topology``: a :class:`LocalCluster` or a
    :class:`LocalSentinelSet`), which master to hit and its replica, which stream keys it
    holds, how to read the replica, and what to wait for after the kill and the restart.
    """

    faults: tuple[str, ...] = REPLICATED_FAULTS
    topology: LocalCluster | LocalSentinelSet
    url: str

    def __init__(self, stream_keys: list[str], probe: Probe, expect_marks: bool) -> None:
        self.stream_keys = stream_keys
        self.probe = probe
        self.expect_marks = expect_marks
        self.failovers = FailoverTally()
        self._paused: int | None = None
        self._client: redis.Redis | None = None

    def client(self) -> redis.Redis:
        """One client, kept (it follows failovers on its own)."""
        if self._client is None:
            self._client = connect_redis(self.url, timeout_s=5)
        return self._client

    def inflict(self, fault: str, rng: random.Random, tend: Callable[[], None]) -> bool:
        master, replica = self._pick(rng)
        log.info("broker fault: %s of the master on %d", fault, master)
        if fault == "redis.stall":
            self._paused = master
            self.topology.pause(master)
            time.sleep(rng.uniform(*STALL_S))  # the stall itself, not a wait
            self.topology.resume(master)
            self._paused = None
            return True
        keys = self._keys_of(master)
        if self.expect_marks and not self.probe.can_burst(keys):
            return False  # a master without a burst stream: pick again soon
        self.topology.cut_off(replica)
        marked = _while_cut_off(self.probe, keys, rng, tend)
        if self.expect_marks and marked == 0:
            log.info("failover called off: no burst event was marked in time")
            self.topology.resume(replica)
            self._wait_relinked(master, replica)
            self.failovers.aborted += 1
            return False
        self.topology.kill(master)
        self.topology.resume(replica)
        with self._replica_client(replica) as client:
            lacked = self.probe.lacked(client, keys)
            still_replica = client.info("replication").get("role") == "slave"
        if still_replica:
            self.failovers.lacked.append(lacked)
            self.failovers.marked.append(marked)
        else:  # promoted before the measurement ended: it might have taken writes already
            self.failovers.unmeasured += 1
        self._wait_promoted(master, replica)
        self.topology.restart(master)  # rejoins as a replica of the promoted one
        self._wait_rejoined(master)
        self.failovers.failovers += 1
        return True

    def _wait_relinked(self, master: int, replica: int) -> None:
        """After a called-off failover: wait until the resumed replica is linked to its master
        again, seen from both sides (the next cut-off closes that link). Right after
        ``SIGCONT`` the replica may still report its old, closed link as up, so the master must
        list it too; its offset is not waited for (under load it never stays equal)."""
        def linked() -> bool:
            return (int(self.topology.replication(master).get("connected_slaves", 0)) >= 1
                    and self.topology.replication(replica).get("master_link_status") == "up")

        wait_for(linked, timeout=60, what=f"the replica on {replica} to reconnect")

    def _pick(self, rng: random.Random) -> tuple[int, int]:
        raise NotImplementedError

    def _keys_of(self, master: int) -> list[str]:
        raise NotImplementedError

    def _replica_client(self, replica: int) -> redis.Redis:
        raise NotImplementedError

    def _wait_promoted(self, master: int, replica: int) -> None:
        raise NotImplementedError

    def _wait_rejoined(self, master: int) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        if self._paused is not None:
            self.topology.resume(self._paused)

    def stop(self) -> None:
        self.topology.stop()


class ClusterRedis(_Replicated):
    """A local Redis Cluster (3 masters with a replica each, AOF) under fault."""

    def __init__(self, workdir: Path, stream_keys: list[str], probe: Probe,
                 expect_marks: bool) -> None:
        super().__init__(stream_keys, probe, expect_marks)
        self.cluster = self.topology = LocalCluster(
            workdir, masters=3, replicas=1, appendonly=True,
            node_timeout_ms=NODE_TIMEOUT_MS).start()
        self.url = self.cluster.url  # the first masters; any live node is enough to connect

    def _pick(self, rng: random.Random) -> tuple[int, int]:
        master = rng.choice(self.cluster.master_ports())
        return master, self.cluster.replica_of(master)

    def _keys_of(self, master: int) -> list[str]:
        return [k for k in self.stream_keys if self.cluster.master_of(k) == master]

    def _replica_client(self, replica: int) -> redis.Redis:
        return self.cluster.client(replica, readonly=True)  # else MOVED

    def _wait_promoted(self, master: int, replica: int) -> None:
        self.cluster.wait_failover(master, replica, timeout=60)

    def _wait_rejoined(self, master: int) -> None:
        self.cluster.wait_ready(timeout=60)


class SentinelRedis(_Replicated):
    """A local Sentinel set (1 master, 1 replica, 3 Sentinels) under fault."""

    def __init__(self, workdir: Path, stream_keys: list[str], probe: Probe,
                 expect_marks: bool) -> None:
        super().__init__(stream_keys, probe, expect_marks)
        self.set = self.topology = LocalSentinelSet(
            workdir, down_after_ms=NODE_TIMEOUT_MS).start()
        self.url = self.set.url

    def _pick(self, rng: random.Random) -> tuple[int, int]:
        master = self.set.master_port_now()
        replica = self.set.replica_port if master == self.set.master_port else \
            self.set.master_port
        return master, replica

    def _keys_of(self, master: int) -> list[str]:
        return self.stream_keys  # one master holds every stream

    def _replica_client(self, replica: int) -> redis.Redis:
        return node_client(replica)

    def _wait_promoted(self, master: int, replica: int) -> None:
        self.set.wait_promoted(replica, timeout=60)

    def _wait_rejoined(self, master: int) -> None:
        self.set.wait_replica_linked(master, timeout=60)


def _while_cut_off(
    probe: Probe, keys: list[str], rng: random.Random, tend: Callable[[], None]
) -> int:
    """While the replica is cut off: commit a burst of events to the master's streams and give
    the relays until they marked all of them, or the cut-off's random length, whichever comes
    first (restarting dead daemons meanwhile); how many were marked. Without ``WAIT`` they
    mark at once and the promoted replica will lack them; with it the marks cannot come (no
    replica confirms), and the cut-off runs its whole length."""
    ids = probe.burst(keys)
    deadline = time.monotonic() + rng.uniform(*CUT_OFF_S)
    while True:
        marked = probe.marked(ids) if ids else 0
        if (ids and marked == len(ids)) or time.monotonic() >= deadline:
            return marked
        tend()
        time.sleep(0.05)


def last_generated_id(replica: redis.Redis, key: str) -> str:
    """The replica's ``last-generated-id`` of ``key`` (``0-0`` when it holds no such stream);
    a cluster replica must be read with ``READONLY`` (else ``MOVED``, raised)."""
    try:
        raw = replica.xinfo_stream(key)["last-generated-id"]
    except redis.ResponseError as err:
        if "no such key" not in str(err).lower():
            raise
        return "0-0"
    return raw.decode() if isinstance(raw, bytes) else str(raw)
