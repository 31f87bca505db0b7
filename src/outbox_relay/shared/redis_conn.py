"""Redis connection factory and error wrapping (redis-py with hiredis)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, cast
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import NoPermissionError
from redis.retry import Retry

from outbox_relay.shared.errors import CannotConnectError, ConfigError, UnavailableError
from outbox_relay.shared.redaction import redact_url

log = logging.getLogger(__name__)


SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
CLUSTER_PORT = 6379


def connect_redis(url: str, *, timeout_s: float = 5.0) -> redis.Redis:
    """A client for ``url`` (``redis://``, ``rediss://``, ``unix://``; a Sentinel set:
    ``redis+sentinel://``, see :func:`sentinel_master`; a Redis Cluster: ``redis+cluster://``,
    see :func:`cluster_client`) with bounded timeouts.

    Responses stay ``bytes``: entry fields may hold anything a foreign producer wrote, and the
    envelope parser decides what is valid UTF-8.
    """
    scheme = url.split("://", 1)[0].lower()
    if not _userinfo_in_netloc(url):
        # an unencoded "/", "?" or "#" in the password: the parser would take its end for a host
        raise ConfigError(f"invalid Redis URL {redact_url(url)}: percent-encode the password")
    if scheme in SENTINEL_SCHEMES:
        return sentinel_master(url, timeout_s=timeout_s)
    if scheme in CLUSTER_SCHEMES:
        return cluster_client(url, timeout_s=timeout_s)
    try:
        return redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=min(timeout_s, 5.0),
            health_check_interval=30,
            retry_on_timeout=False,
        )
    except ValueError as err:
        raise ConfigError(f"invalid Redis URL {redact_url(url)}") from err


def _userinfo_in_netloc(url: str) -> bool:
    """Whether every ``@`` of ``url`` is in its network location (where the user-info is)."""
    try:
        netloc = urlsplit(url).netloc
    except ValueError:  # a malformed URL: the parser that reads it says so
        return True
    return url.count("@") == netloc.count("@")


def sentinel_master(url: str, *, timeout_s: float = 5.0) -> redis.Redis:
    """A client of the master a Sentinel set names, following it across failovers.

    ``redis+sentinel://[user:password@]host[:port][,host[:port]…]/service[/db]`` (ports default
    to 26379; ``rediss+sentinel`` for TLS to the master; ``?sentinel_password=`` when the
    Sentinels have their own password). The client asks the Sentinels for the master on every
    new connection; after a failover the old master's connections fail (``READONLY``, reset)
    and surface as ``unavailable``, which every daemon retries, reconnecting to the new master.
    With ``OUTBOX_WAIT_REPLICAS`` the relay marks rows delivered only once a replica has them;
    without it, the relay's repair (each stream compared with the outbox) refills what the
    promoted replica lacked.
    """
    from redis.sentinel import Sentinel

    shape = "redis+sentinel://[user:password@]host[:port],…/service[/db]"
    parts, addresses, path, query = _split_hosts_url(url, SENTINEL_PORT, shape,
                                                     known={"sentinel_password"})
    if not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
        raise _invalid(url, shape)
    service, db = path[0], int(path[1]) if len(path) == 2 else 0
    timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": min(timeout_s, 5.0)}
    sentinel_password = query.get("sentinel_password", [None])[0]
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        addresses, sentinel_kwargs={**timeouts, "password": sentinel_password})
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        service, **_credentials(parts), db=db,
        ssl=parts.scheme.lower().startswith("rediss"), health_check_interval=30,
        retry_on_timeout=False, **timeouts,
    )
    return client


def cluster_client(url: str, *, timeout_s: float = 5.0) -> redis.Redis:
    """A Redis Cluster client (redis-py's ``RedisCluster``) from
    ``redis+cluster://[user:password@]host[:port][,host[:port]…]`` (``rediss+cluster`` for
    TLS; ports default to 6379; any reachable node is enough, the client learns the others).

    Every command of ours names keys of one partition only (one hash tag, one slot:
    shared/keys.py), so each goes to the master that owns that partition's slot; reads that
    span partitions are split per partition (consumer/streams.py), and the durability barrier
    (``WAIT``) goes to each master that took writes (relay/append.py). After a failover the
    client re-reads the slot map on its next error (``unavailable`` once, then retried).

    Returned as the plain client type: the cluster client offers the same commands, and the
    modules that must act differently ask :func:`is_cluster`. Raises ``unavailable`` when no
    listed node answers (the daemons wait for one at start-up, see cli/startup.py).
    """
    shape = "redis+cluster://[user:password@]host[:port],…"
    parts, addresses, path, _query = _split_hosts_url(url, CLUSTER_PORT, shape, known=set())
    if path not in ([], ["0"]):
        raise ConfigError(f"invalid Redis Cluster URL {redact_url(url)}: a cluster has only "
                          "database 0 (expected " + shape + ")")
    try:
        with translate_redis_errors():
            cluster = RedisCluster(
                startup_nodes=[ClusterNode(host, port)  # type: ignore[no-untyped-call]
                               for host, port in addresses],
                **_credentials(parts), ssl=parts.scheme.lower().startswith("rediss"),
                socket_timeout=timeout_s, socket_connect_timeout=min(timeout_s, 5.0),
                health_check_interval=30,
                # a moved slot or a failover: re-read the slot map and retry, briefly
                retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3),
            )
    except redis.exceptions.RedisClusterException as err:
        raise UnavailableError("no node of the Redis Cluster answered") from err
    return cast(redis.Redis, cluster)


def is_cluster(client: redis.Redis) -> bool:
    """Whether ``client`` talks to a Redis Cluster (see :func:`cluster_client`)."""
    return isinstance(client, RedisCluster)


def node_of(client: redis.Redis, key: str) -> Any:
    """The cluster node (redis-py ``ClusterNode``) that owns ``key``'s slot, as a
    ``target_nodes`` argument; ``None`` outside a cluster (the one server)."""
    if not is_cluster(client):
        return None
    return client.get_node_from_key(key)  # type: ignore[attr-defined]


def _split_hosts_url(
    url: str, default_port: int, shape: str, *, known: set[str]
) -> tuple[SplitResult, list[tuple[str, int]], list[str], dict[str, list[str]]]:
    """Split ``scheme://[user:password@]host[:port],host[:port]…/path?query`` (hosts may be
    bracketed IPv6 addresses): the parts, the addresses, the path items and the parameters.
    A malformed URL or an unknown parameter is ``invalid_config`` with the password hidden."""
    try:
        parts = urlsplit(url)
        addresses = []
        for item in parts.netloc.rpartition("@")[2].split(","):
            host, colon, port = item.strip().rpartition(":")
            if not colon or host.endswith(":") or (item.strip().startswith("[")
                                                   and not host.endswith("]")):
                host, port = item.strip(), ""  # no port (an IPv6 address has colons of its own)
            addresses.append((host.strip("[]"), int(port) if port else default_port))
        path = [unquote(p) for p in parts.path.split("/") if p]
        query = parse_qs(parts.query, strict_parsing=bool(parts.query))
    except ValueError:
        raise _invalid(url, shape) from None
    if not all(host for host, _ in addresses):
        raise _invalid(url, shape)
    if unknown := sorted(set(query) - known):
        listed = ", ".join(sorted(known)) or "none"
        raise ConfigError(f"invalid Redis URL {redact_url(url)}: unknown parameter(s) "
                          f"{', '.join(unknown)} (known: {listed})")
    return parts, addresses, path, query


def _invalid(url: str, shape: str) -> ConfigError:
    return ConfigError(f"invalid Redis URL {redact_url(url)}: expected {shape}")


def _credentials(parts: SplitResult) -> dict[str, Any]:
    return {"username": unquote(parts.username) if parts.username else None,
            "password": unquote(parts.password) if parts.password else None}


@contextlib.contextmanager
def translate_redis_errors() -> Iterator[None]:
    """Map connection problems and timeouts to :class:`UnavailableError`.

    A timeout is an *unknown outcome*: the command may or may not have run. Callers that write
    must be able to tell afterwards (the relay does, by explicit entry ids).
    """
    try:
        yield
    except redis.AuthenticationError as err:  # a ConnectionError subclass: catch it first
        # Retrying cannot fix a wrong password: exit and say so (CLI status 2).
        raise CannotConnectError("Redis refused our credentials (password hidden)") from err
    except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError,
            redis.exceptions.TryAgainError, redis.exceptions.SlotNotCoveredError) as err:
        # ClusterError: the cluster is down or redirections ran out (a failover under way).
        text = redact_url(str(err))
        log.debug("redis error: %s", text)
        if any(m in text.lower() for m in ("name or service not known", "nodename nor servname")):
            # "Error -2 connecting to nosuchhost:6379. Name or service not known."
            raise CannotConnectError(f"cannot connect to Redis: {text[:200]}") from err
        raise UnavailableError("Redis is unavailable or timed out") from err
    except NoPermissionError as err:  # redis-py strips the "NOPERM" prefix from its text
        raise UnavailableError("Redis refused the command for our user (ACL)") from err
    except redis.ResponseError as err:
        # a pipeline wraps a command's error: "Command # 1 (XCLAIM …) of pipeline caused error: …"
        text = str(err).split(" of pipeline caused error: ", 1)[-1]
        # Redis 7.0 reports an ACL refusal inside a script without the NOPERM code.
        if text.startswith(("NOPERM", "NOAUTH", "WRONGPASS")) or (
            "can't run this command" in text or "has no permissions" in text
        ):
            raise UnavailableError("Redis refused the command for our user (ACL)") from err
        if text.startswith("NOGROUP"):
            raise UnavailableError("the consumer group is missing (did Redis lose data?)") from err
        if text.startswith(("LOADING", "BUSY ", "MASTERDOWN", "READONLY")):
            raise UnavailableError("Redis is not ready (loading, busy or read-only)") from err
        raise
