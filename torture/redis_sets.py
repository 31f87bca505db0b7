"""Local Redis topologies on free loopback ports, for the tests and the torture harness.

* :class:`LocalCluster`: a Redis Cluster of ``masters`` masters with ``replicas`` replicas each
  (``redis-server --cluster-enabled yes`` processes, joined by ``redis-cli --cluster create``),
  with the moves a test needs: find the master of a key, kill a node, fail over by kill or by
  ``CLUSTER FAILOVER``, cut a replica off its master's replication stream and resume it.
* :class:`LocalSentinelSet`: 1 master, 1 replica and 3 Sentinels monitoring them.

Every process is a child started with :class:`subprocess.Popen` (never ``--daemonize``), its
output in ``node.log`` in its own folder under ``workdir``, and is stopped by its pid. Waits poll
a condition with a timeout. A missing ``redis-server``/``redis-cli``, or one without cluster
support, raises :class:`TopologyUnsupported` (tests turn it into ``pytest.skip``); anything else
that goes wrong raises :class:`TopologyError`.

Timings (2 cores, Redis 7.0.15, measured with ``python -m torture.redis_sets``): a 3-master,
3-replica cluster with AOF is up (every node ``cluster_state:ok``, every replica's link up,
every node's view complete and in agreement) in 2.2 to 3.9 s from the first ``Popen``, about
2 s of it in ``redis-cli --cluster create`` (which waits in 1 s steps for the nodes to join);
``--repl-diskless-sync-delay 0`` spares the 5 s a master otherwise waits before a replica's
first sync. A failover by ``SIGKILL`` with the default 2 s node timeout takes 3.6 to 5 s until
every surviving node is ``cluster_state:ok`` with the replica owning the slots; the killed node
restarted is back as the new master's linked replica within 0.2 s; a ``CLUSTER FAILOVER``
takes 0.2 to 2 s. The Sentinel set is up in 0.2 to 1.1 s (Sentinels start once the replica is
linked, so their first ``INFO`` of the master finds it); ``SENTINEL FAILOVER`` promotes in
about 1.2 s; a former master is reconfigured as a replica by the Sentinels about 10 s after it
is back (their ``INFO`` period).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis

HOST = "127.0.0.1"
BUS_OFFSET = 10_000  # a cluster node's bus port is its port + 10000
NODE_TIMEOUT_MS = 2_000
POLL_S = 0.02
CLIENT_TIMEOUT_S = 2.0
# A master waits repl-diskless-sync-delay (5 s by default) for more replicas before it starts
# a full sync: every replica's link would come up 5 s late.
FAST_SYNC = ("--repl-diskless-sync-delay", "0")


class TopologyUnsupported(RuntimeError):
    """``redis-server``/``redis-cli`` is missing or cannot run this topology (tests skip)."""


class TopologyError(RuntimeError):
    """A topology did not start, or did not reach the state waited for in time."""


def wait_for(predicate: Callable[[], object], *, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it is truthy; :class:`TopologyError` after ``timeout`` s.

    A Redis error inside ``predicate`` counts as "not yet" (a node may be starting, or down).
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            if predicate():
                return
        except (redis.RedisError, OSError) as err:
            last = err
        if time.monotonic() > deadline:
            detail = f" (last error: {last})" if last is not None else ""
            raise TopologyError(f"timed out after {timeout}s waiting for {what}{detail}")
        time.sleep(POLL_S)


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(taken: set[int], *, bus: bool = False) -> int:
    """A loopback port nobody listens on now and not in ``taken`` (added to it); with ``bus``,
    also its cluster bus port (port + 10000)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port in taken or (bus and (port + BUS_OFFSET > 65_535 or port + BUS_OFFSET in taken
                                      or not _port_is_free(port + BUS_OFFSET))):
            continue
        taken.update({port, port + BUS_OFFSET} if bus else {port})
        return port
    raise TopologyError("found no free loopback port")


def conf_quoted(path: Path) -> str:
    """A path as one argument of a Redis config file (a temp folder may hold a space)."""
    return '"' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise TopologyUnsupported(f"no {name} binary on PATH")
    return path


def node_client(port: int, **kwargs: Any) -> redis.Redis:
    """A plain client of one node (bytes replies, short timeouts)."""
    return redis.Redis(host=HOST, port=port, socket_timeout=CLIENT_TIMEOUT_S,
                       socket_connect_timeout=CLIENT_TIMEOUT_S, **kwargs)


def _answers(port: int) -> bool:
    try:
        with node_client(port) as c:
            return bool(c.ping())
    except redis.RedisError:
        return False


@dataclass
class Process:
    """One ``redis-server`` child: its port, folder, log and handle."""

    name: str
    port: int
    folder: Path
    argv: list[str]
    proc: subprocess.Popen[bytes]

    @property
    def log(self) -> Path:
        return self.folder / "node.log"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class _Processes:
    """The children of one topology; stopped by pid, never by name."""

    workdir: Path
    procs: list[Process] = field(default_factory=list)

    def spawn(self, name: str, port: int, argv: list[str]) -> Process:
        folder = self.workdir / name
        folder.mkdir(parents=True, exist_ok=True)
        process = Process(name, port, folder, argv, self._popen(folder, argv))
        self.procs.append(process)
        return process

    def respawn(self, process: Process) -> None:
        """Start a process that exited again, with the same command line and folder."""
        if process.alive:
            raise TopologyError(f"{process.name} (port {process.port}) still runs")
        process.proc = self._popen(process.folder, process.argv)

    @staticmethod
    def _popen(folder: Path, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(folder / "node.log", "ab") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=folder,
                                    stdin=subprocess.DEVNULL)

    def by_port(self, port: int) -> Process:
        for p in self.procs:
            if p.port == port:
                return p
        raise KeyError(f"no node of ours on port {port}")

    def wait_answering(self, procs: Iterable[Process], timeout: float) -> None:
        for p in procs:
            def up(p: Process = p) -> bool:
                if not p.alive:
                    raise TopologyError(f"{p.name} (port {p.port}) exited with status "
                                        f"{p.proc.returncode}:\n{p.log_tail()}")
                return _answers(p.port)

            wait_for(up, timeout=timeout, what=f"{p.name} to answer on port {p.port}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every live child (SIGCONT first, in case it was stopped), wait, SIGKILL
        those that do not exit in ``timeout`` s."""
        for p in self.procs:
            if p.alive:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.send_signal(signal.SIGCONT)
                    p.proc.terminate()
        for p in self.procs:
            try:
                p.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()


@dataclass(frozen=True)
class NodeInfo:
    """One line of ``CLUSTER NODES`` as seen by some node."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    link: str
    slots: tuple[tuple[int, int], ...]

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def failing(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})

    def owns(self, slot: int) -> bool:
        return any(lo <= slot <= hi for lo, hi in self.slots)


def parse_cluster_nodes(text: str) -> list[NodeInfo]:
    """Parse a ``CLUSTER NODES`` reply (slots being migrated, ``[…]``, are left out)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        address = parts[1].split(",", 1)[0].split("@", 1)[0]
        port = int(address.rpartition(":")[2] or 0)
        slots = []
        for item in parts[8:]:
            if item.startswith("["):
                continue
            lo, _, hi = item.partition("-")
            slots.append((int(lo), int(hi or lo)))
        out.append(NodeInfo(parts[0], port, frozenset(parts[2].split(",")),
                            None if parts[3] == "-" else parts[3], parts[7], tuple(slots)))
    return out


def _text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _fields(reply: Any) -> dict[str, str]:
    """A Sentinel reply about one instance (a flat list of names and values, or a map)."""
    items = list(reply.items()) if isinstance(reply, dict) else list(
        zip(reply[::2], reply[1::2], strict=True))
    return {_text(k): _text(v) for k, v in items}


class _Topology:
    """What both topologies share: their processes, by port, and the faults on one of them."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes = _Processes(workdir)
        self.start_seconds: float | None = None  # how long start() took

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        """Terminate every process (by pid), wait, SIGKILL those that do not exit."""
        self.processes.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def ports(self) -> list[int]:
        """Every process's port, live or not, in start order."""
        return [p.port for p in self.processes.procs]

    def live_ports(self) -> list[int]:
        """The ports of the processes that run."""
        return [p.port for p in self.processes.procs if p.alive]

    def replication(self, port: int) -> dict[str, Any]:
        """``INFO replication`` of one server."""
        with node_client(port) as c:
            return dict(c.info("replication"))

    def kill(self, port: int) -> None:
        """SIGKILL the server on ``port`` (and reap it)."""
        p = self.processes.by_port(port)
        if p.alive:
            p.proc.kill()
        p.proc.wait()

    def respawn(self, port: int, timeout: float = 30.0) -> None:
        """Start a killed server again with its command line and folder; wait until it
        answers."""
        process = self.processes.by_port(port)
        self.processes.respawn(process)
        self.processes.wait_answering([process], timeout=timeout)

    def pause(self, port: int) -> None:
        """SIGSTOP the server on ``port``: it holds its connections but answers nothing."""
        self.processes.by_port(port).proc.send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        """SIGCONT a server :meth:`pause` or :meth:`cut_off` stopped."""
        self.processes.by_port(port).proc.send_signal(signal.SIGCONT)

    def cut_off(self, replica_port: int) -> int:
        """Hold replication back: SIGSTOP the replica on ``replica_port``, then make its master
        close the replication link (``CLIENT KILL TYPE replica``), so that nothing the master
        takes from now on reaches the replica, not even from the kernel's socket buffers (a
        replica only stopped would read them after :meth:`resume`, though its master be dead).
        After :meth:`resume` the replica reconnects and catches up from the master's backlog
        if the master still runs. Returns the master's port."""
        master = int(self.replication(replica_port)["master_port"])
        self.pause(replica_port)
        with node_client(master) as c:
            if int(c.client_kill_filter(_type="replica")) < 1:
                raise TopologyError(f"the master on {master} had no replica link to close")
        return master

    def wait_replica_synced(self, replica_port: int, timeout: float = 10.0) -> None:
        """Wait until the replica on ``replica_port`` has processed its master's whole
        replication stream (equal replication offsets)."""
        def synced() -> bool:
            info = self.replication(replica_port)
            if info.get("master_link_status") != "up":
                return False
            master = self.replication(int(info["master_port"]))
            return int(master["master_repl_offset"]) == int(info["slave_repl_offset"])

        wait_for(synced, timeout=timeout, what=f"the replica on {replica_port} to catch up")


class LocalCluster(_Topology):
    """A Redis Cluster on free loopback ports under ``workdir``.

    ``with LocalCluster(path) as cluster:`` starts it (:meth:`start`) and stops every node at
    the end (:meth:`stop`). :attr:`url` is the ``redis+cluster://`` URL of the current masters.
    """

    def __init__(
        self, workdir: Path, masters: int = 3, replicas: int = 1, appendonly: bool = True,
        node_timeout_ms: int = NODE_TIMEOUT_MS, start_timeout_s: float = 30.0,
    ) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        super().__init__(workdir)
        self.masters = masters
        self.replicas = replicas
        self.appendonly = appendonly
        self.node_timeout_ms = node_timeout_ms
        self.start_timeout_s = start_timeout_s

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> Self:
        """Start the nodes, create the cluster, wait until it is fully up; returns self."""
        server, cli = _binary("redis-server"), _binary("redis-cli")
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        taken: set[int] = set()
        try:
            nodes = [self._spawn_node(server, free_port(taken, bus=True), i)
                     for i in range(self.masters * (1 + self.replicas))]
            self._wait_nodes_answer(nodes)
            self._create(cli, [n.port for n in nodes])
            self.wait_ready(timeout=self.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        return self

    def _spawn_node(self, server: str, port: int, index: int) -> Process:
        name = f"node{index}-{port}"
        folder = self.workdir / name
        return self.processes.spawn(name, port, [
            server, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--appendonly", "yes" if self.appendonly else "no", "--save", "",
            "--bind", HOST, "--port", str(port), "--dir", str(folder), *FAST_SYNC,
        ])

    def _wait_nodes_answer(self, nodes: list[Process]) -> None:
        try:
            self.processes.wait_answering(nodes, timeout=self.start_timeout_s)
        except TopologyError as err:
            text = str(err)
            if any(m in text for m in ("Bad directive", "cluster-enabled", "FATAL CONFIG")):
                raise TopologyUnsupported(f"redis-server cannot run a cluster node: {text}") \
                    from err
            raise

    def _create(self, cli: str, ports: list[int]) -> None:
        argv = [cli, "--cluster", "create", *(f"{HOST}:{p}" for p in ports),
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False,
                                  timeout=self.start_timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as err:
            raise TopologyError(f"redis-cli --cluster create did not finish in "
                                f"{self.start_timeout_s}s") from err
        (self.workdir / "cluster-create.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            output = (done.stdout + done.stderr).strip()
            if "Unrecognized option" in output or "Unknown --cluster subcommand" in output:
                raise TopologyUnsupported(f"redis-cli has no --cluster support: {output[:300]}")
            raise TopologyError(f"redis-cli --cluster create failed ({done.returncode}): "
                                f"{output[-1500:]}")

    # -- what the cluster looks like ------------------------------------------------------------

    def client(self, port: int, *, readonly: bool = False) -> redis.Redis:
        """A plain (non-cluster) client of one node; ``readonly`` sends ``READONLY`` on its one
        connection, so a replica answers reads of the slots of its master."""
        if not readonly:
            return node_client(port)
        c = node_client(port, single_connection_client=True)
        c.execute_command("READONLY")  # type: ignore[no-untyped-call]
        return c

    def view(self, port: int | None = None) -> list[NodeInfo]:
        """``CLUSTER NODES`` as node ``port`` sees it (default: the first live node)."""
        if port is None:
            port = self._a_live_port()
        with node_client(port) as c:
            return parse_cluster_nodes(_text(c.execute_command("CLUSTER", "NODES")))

    def _a_live_port(self) -> int:
        for port in self.live_ports():
            if _answers(port):
                return port
        raise TopologyError("no node of the cluster answers")

    def cluster_info(self, port: int) -> dict[str, str]:
        """``CLUSTER INFO`` of one node as a dict."""
        with node_client(port) as c:
            text = _text(c.execute_command("CLUSTER", "INFO"))
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def master_ports(self) -> list[int]:
        """The ports of the masters that own slots (as a live node sees it), sorted."""
        return sorted(n.port for n in self.view() if n.is_master and n.slots
                      and not n.failing)

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:P1,127.0.0.1:P2,…``: the current masters."""
        return "redis+cluster://" + ",".join(f"{HOST}:{p}" for p in self.master_ports())

    def slot_of(self, key: str | bytes) -> int:
        """``CLUSTER KEYSLOT key``."""
        with node_client(self._a_live_port()) as c:
            return int(c.execute_command("CLUSTER", "KEYSLOT", key))

    def master_of(self, key: str | bytes) -> int:
        """The port of the master that owns ``key``'s slot."""
        slot = self.slot_of(key)
        for n in self.view():
            if n.is_master and n.owns(slot):
                return n.port
        raise TopologyError(f"no master owns slot {slot} of {key!r}")

    def replica_of(self, master_port: int) -> int:
        """The port of a (healthy) replica of the master on ``master_port``."""
        nodes = self.view()
        master = next((n for n in nodes if n.port == master_port), None)
        if master is None or not master.is_master:
            raise TopologyError(f"port {master_port} is not a master of the cluster")
        for n in nodes:
            if n.master_id == master.node_id and not n.is_master and not n.failing:
                return n.port
        raise TopologyError(f"the master on port {master_port} has no healthy replica")

    # -- waits --------------------------------------------------------------------------------

    def _in_step(self, ports: list[int]) -> bool:
        """Every node of ``ports``: ``cluster_state:ok``, a view of every live node without
        failure flags and the same slot map; every replica's link to its master up."""
        slot_maps = set()
        live = set(ports)
        for port in ports:
            if self.cluster_info(port).get("cluster_state") != "ok":
                return False
            nodes = [n for n in self.view(port) if n.port in live]
            if len(nodes) != len(live) or any(n.failing or n.link != "connected"
                                              for n in nodes):
                return False
            slot_maps.add(frozenset((n.port, n.slots) for n in nodes if n.is_master))
            if not any(n.is_master for n in nodes if n.port == port) and (
                    self.replication(port).get("master_link_status") != "up"):
                return False
        return len(slot_maps) == 1

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every live node agrees the cluster is up (see :meth:`_in_step`)."""
        wait_for(lambda: self._in_step(self.live_ports()), timeout=timeout,
                 what="every node to report cluster_state:ok with every replica linked")

    def wait_failover(self, old_master: int, replica: int, timeout: float = 30.0) -> int:
        """Wait until ``replica`` is the master of ``old_master``'s slots in every live node's
        view and every live node reports ``cluster_state:ok``; returns ``replica``."""
        live = self.live_ports()

        def promoted() -> bool:
            for port in live:
                if self.cluster_info(port).get("cluster_state") != "ok":
                    return False
                mine = next((n for n in self.view(port) if n.port == replica), None)
                if mine is None or not mine.is_master or not mine.slots:
                    return False
            return True

        wait_for(promoted, timeout=timeout,
                 what=f"the replica on {replica} to take over from the master on {old_master}")
        return replica

    # -- faults -------------------------------------------------------------------------------

    def restart(self, port: int, timeout: float = 30.0) -> None:
        """Start a killed node again on its port, with its folder (``nodes.conf``, AOF): it
        rejoins the cluster (a former master whose replica took over becomes that replica's
        replica and resyncs from it); wait until every live node is in step again."""
        self.respawn(port, timeout)
        self.wait_ready(timeout=timeout)

    def failover_by_kill(self, master_port: int, timeout: float = 30.0) -> int:
        """SIGKILL the master on ``master_port``; wait until its replica is promoted and the
        surviving nodes report ``cluster_state:ok``; return the new master's port."""
        replica = self.replica_of(master_port)
        self.kill(master_port)
        return self.wait_failover(master_port, replica, timeout)

    def failover_graceful(self, replica_port: int, timeout: float = 30.0) -> int:
        """``CLUSTER FAILOVER`` on the replica on ``replica_port`` (no data lost: the master
        stops taking writes until the replica caught up); wait until the replica is master
        and the former master its linked replica; return the former master's port."""
        old = int(self.replication(replica_port)["master_port"])
        with node_client(replica_port) as c:
            c.execute_command("CLUSTER", "FAILOVER")
        self.wait_failover(old, replica_port, timeout)
        wait_for(lambda: self._in_step(self.live_ports()), timeout=timeout,
                 what=f"the former master on {old} to follow {replica_port}")
        return old


class LocalSentinelSet(_Topology):
    """1 master, 1 replica and 3 Sentinels (quorum 2) on free loopback ports under
    ``workdir``, without persistence. :attr:`url` is the ``redis+sentinel://`` URL."""

    def __init__(
        self, workdir: Path, service: str = "outboxmaster", down_after_ms: int = 2_000,
        failover_timeout_ms: int = 5_000, start_timeout_s: float = 40.0,
    ) -> None:
        super().__init__(workdir)
        self.service = service
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.start_timeout_s = start_timeout_s
        taken: set[int] = set()
        self.master_port = free_port(taken)
        self.replica_port = free_port(taken)
        self.sentinel_ports = [free_port(taken) for _ in range(3)]

    @property
    def url(self) -> str:
        hosts = ",".join(f"{HOST}:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def sentinel(self, i: int = 0) -> redis.Redis:
        """A client of Sentinel ``i``."""
        return node_client(self.sentinel_ports[i])

    def master_port_now(self) -> int:
        """The port of the master the first Sentinel names now."""
        return self.master_named_by(0)

    def start(self) -> Self:
        """Start master, replica and Sentinels; wait until the replica's link is up and every
        Sentinel knows the replica; returns self."""
        server = _binary("redis-server")
        started = time.monotonic()
        try:
            for name, port, extra in (
                ("master", self.master_port, []),
                ("replica", self.replica_port, ["--replicaof", HOST, str(self.master_port)]),
            ):
                self.processes.spawn(name, port, [
                    server, "--port", str(port), "--bind", HOST, "--save", "",
                    "--appendonly", "no", "--dir", str(self.workdir / name), *FAST_SYNC,
                    *extra])
            self.processes.wait_answering(self.processes.procs, timeout=15)
            # Sentinels learn of replicas from the master's INFO, polled every 10 s: started
            # once the replica is linked, their first poll finds it.
            wait_for(self._replica_linked, timeout=self.start_timeout_s,
                     what="the replica's link to the master")
            for i, port in enumerate(self.sentinel_ports):
                folder = self.workdir / f"sentinel{i}"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "sentinel.conf").write_text("\n".join([
                    f"port {port}", f"bind {HOST}", f"dir {conf_quoted(folder)}",
                    f"sentinel monitor {self.service} {HOST} {self.master_port} 2",
                    f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                    f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
                ]) + "\n")
                self.processes.spawn(f"sentinel{i}", port,
                                     [server, str(folder / "sentinel.conf"), "--sentinel"])
            self.processes.wait_answering(self.processes.procs, timeout=15)
            wait_for(self._replica_known, timeout=self.start_timeout_s,
                     what="the sentinels to know the replica")
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        return self

    def _replica_linked(self) -> bool:
        with node_client(self.replica_port) as r:
            return bool(r.info("replication").get("master_link_status") == "up")

    def _replica_known(self) -> bool:
        """Every Sentinel knows the replica as one it could promote: connected, no failure
        flag, its link to the master up (``SENTINEL FAILOVER`` says ``NOGOODSLAVE`` before)."""
        if not self._replica_linked():
            return False
        for i in range(len(self.sentinel_ports)):
            with self.sentinel(i) as s:
                replicas = s.execute_command("SENTINEL", "REPLICAS", self.service)
            fields = [_fields(r) for r in replicas]
            if len(fields) != 1 or fields[0].get("flags") != "slave" or (
                    fields[0].get("master-link-status") != "ok"):
                return False
        return True

    def master_named_by(self, i: int) -> int:
        """The port of the master Sentinel ``i`` names now."""
        with self.sentinel(i) as s:
            _host, port = s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return int(port)

    def wait_promoted(self, port: int, timeout: float = 30.0) -> None:
        """Wait until the server on ``port`` is a master and every Sentinel names it."""
        def promoted() -> bool:
            if self.replication(port).get("role") != "master":
                return False
            return all(self.master_named_by(i) == port for i in range(len(self.sentinel_ports)))

        wait_for(promoted, timeout=timeout, what=f"the Sentinels to promote {port}")

    def wait_replica_linked(self, port: int, timeout: float = 30.0) -> None:
        """Wait until the server on ``port`` is a replica of the master the Sentinels name,
        with its link up."""
        def linked() -> bool:
            info = self.replication(port)
            return bool(info.get("role") == "slave" and info.get("master_link_status") == "up"
                        and int(info["master_port"]) == self.master_port_now())

        wait_for(linked, timeout=timeout, what=f"{port} to replicate the current master")

    def restart(self, port: int, timeout: float = 30.0) -> None:
        """Start a killed server again (same port, folder and command line) and wait until it
        answers; the Sentinels make a former master a replica of the current one (wait for it
        with :meth:`wait_replica_linked`)."""
        self.respawn(port, timeout)


def main() -> None:
    """``python -m torture.redis_sets [workdir]``: start a cluster, fail over one master by
    kill and one gracefully; start a Sentinel set, fail its master over by kill and bring it
    back as a replica; print how long each step took."""
    import sys
    import tempfile

    base = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="cluster-"))
    with LocalCluster(base / f"c{os.getpid()}") as cluster:
        print(f"cluster up in {cluster.start_seconds:.2f}s: {cluster.url}")
        master = cluster.master_ports()[0]
        t = time.monotonic()
        new = cluster.failover_by_kill(master)
        print(f"failover by kill {master} -> {new} in {time.monotonic() - t:.2f}s")
        other = next(p for p in cluster.master_ports() if p != new)
        replica = cluster.replica_of(other)
        t = time.monotonic()
        cluster.failover_graceful(replica)
        print(f"graceful failover {other} -> {replica} in {time.monotonic() - t:.2f}s")
    with LocalSentinelSet(base / f"s{os.getpid()}") as sset:
        print(f"sentinel set up in {sset.start_seconds:.2f}s: {sset.url}")
        master, replica = sset.master_port, sset.replica_port
        t = time.monotonic()
        sset.cut_off(replica)
        sset.kill(master)
        sset.resume(replica)
        sset.wait_promoted(replica)
        print(f"sentinel failover by kill {master} -> {replica} in {time.monotonic() - t:.2f}s")
        t = time.monotonic()
        sset.restart(master)
        sset.wait_replica_linked(master)
        print(f"{master} back as a replica in {time.monotonic() - t:.2f}s")


if __name__ == "__main__":
    main()
