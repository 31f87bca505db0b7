"""Redis connection factory and error wrapping (redis-py with hiredis)."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any, cast
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import NoPermissionError
from redis.retry import Retry

from outbox_relay.shared.errors import (
    CannotConnectError,
    ConfigError,
    OutboxError,
    UnavailableError,
)
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
        client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=min(timeout_s, 5.0),
            health_check_interval=30,
            retry_on_timeout=False,
        )
    except ValueError as err:
        raise ConfigError(f"invalid Redis URL {redact_url(url)}") from err
    return _locate_errors(client)


def _locate_errors(client: redis.Redis) -> redis.Redis:
    """Have every redis-py error raised on ``client``'s connections say where it happened, so
    our messages name the server (:func:`where`). The pool makes its connections lazily:
    swapping its connection class before the first command covers all of them."""
    pool = client.connection_pool
    pool.connection_class = _located(pool.connection_class)
    return client


@functools.cache
def _located(base: type[Any]) -> type[Any]:
    """redis-py's connection class ``base``, tagging the errors its connect, send and read
    raise with ``redis_where`` (``host:port/db``; never the password). A plain ``try`` costs
    nothing until something fails: ``read_response`` runs once per command."""

    class Located(base):  # type: ignore[misc]
        def connect(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().connect(*args, **kwargs)
            except redis.RedisError as err:
                _tag(err, self)
                raise

        def send_packed_command(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().send_packed_command(*args, **kwargs)
            except redis.RedisError as err:
                _tag(err, self)
                raise

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().read_response(*args, **kwargs)
            except redis.RedisError as err:
                _tag(err, self)
                raise

    Located.__name__ = Located.__qualname__ = f"Located{base.__name__}"
    return Located


def _tag(err: redis.RedisError, connection: Any) -> None:
    if not hasattr(err, "redis_where"):
        err.redis_where = _address(connection)  # type: ignore[attr-defined]


def _address(connection: Any) -> str:
    """``host:port/db`` of a redis-py connection (``path/db`` for a Unix socket, the service
    name for a Sentinel-managed one, whose address changes with failovers)."""
    service = getattr(getattr(connection, "connection_pool", None), "service_name", None)
    if isinstance(service, str):
        base = f"the master of Sentinel service {service}"
    elif path := getattr(connection, "path", ""):
        base = str(path)
    else:
        host = str(getattr(connection, "host", "?"))
        base = f"[{host}]:{connection.port}" if ":" in host else f"{host}:{connection.port}"
    return f"{base}/{getattr(connection, 'db', 0)}"


def where(err: BaseException) -> str:
    """Where a redis-py error happened: ``Redis at host:port/db``, or ``Redis`` when unknown
    (a Redis Cluster client, a test double)."""
    address = getattr(err, "redis_where", None)
    return f"Redis at {address}" if address else "Redis"


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
    # Any: redis-py's Sentinel is untyped before 8.x and typed, with narrower keyword types
    # than its own keyword passing accepts, from 8.x on; either way the client is a Redis.
    sentinel_class: Any = Sentinel
    sentinel = sentinel_class(addresses,
                              sentinel_kwargs={**timeouts, "password": sentinel_password})
    client: redis.Redis = sentinel.master_for(
        service, **_credentials(parts), db=db,
        ssl=parts.scheme.lower().startswith("rediss"), health_check_interval=30,
        retry_on_timeout=False, **timeouts,
    )
    return _locate_errors(client)


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
        nodes = ", ".join(f"{host}:{port}" for host, port in addresses)
        raise UnavailableError(f"no node of the Redis Cluster ({nodes}) answered") from err
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
    """Map connection problems and timeouts to :class:`UnavailableError`, and what retrying
    cannot fix (credentials, an unknown host or database number, a server that is not Redis)
    to :class:`CannotConnectError`; each message says where (:func:`where`).

    A timeout is an *unknown outcome*: the command may or may not have run. Callers that write
    must be able to tell afterwards (the relay does, by explicit entry ids).
    """
    try:
        yield
    except redis.RedisError as err:
        translated = as_outbox_error(err)
        if translated is None:
            raise
        raise translated from err


# Replies by which a server refuses a command for now, not for good: out of memory at
# maxmemory, a replica (READONLY) or a master without its replicas during a failover, a script
# running too long (BUSY). redis-py strips the code of those it has a class for.
_REFUSED_FOR_NOW = ("OOM ", "READONLY ", "MASTERDOWN ", "NOREPLICAS ", "BUSY ")
_REFUSED_CLASSES: tuple[tuple[type[redis.ResponseError], str], ...] = (
    (redis.exceptions.OutOfMemoryError, "OOM"), (redis.exceptions.ReadOnlyError, "READONLY"))


def refused_for_now(err: BaseException) -> UnavailableError | None:
    """The :class:`UnavailableError` of a command Redis refused for now (``OOM`` at
    ``maxmemory``, ``READONLY``, ``MASTERDOWN``, ``NOREPLICAS``, ``BUSY``), for a daemon to
    back off and retry as after an outage; None for any other error. The relay classifies
    its own refusals per stream (relay/refusals.py); consumers use this."""
    if not isinstance(err, redis.ResponseError):
        return None
    text = str(err)
    code = next((c for kind, c in _REFUSED_CLASSES if isinstance(err, kind)), None) or next(
        (c.strip() for c in _REFUSED_FOR_NOW if text.startswith(c)), None)
    if code is None:
        return None
    return UnavailableError(f"{where(err)} refused a command for now ({code})")


def as_outbox_error(err: redis.RedisError) -> OutboxError | None:
    """Our error for a redis-py error, or ``None`` for a command's own refusal (``WRONGTYPE``
    …) that the caller must handle. The CLI uses it on whatever reaches it unwrapped."""
    at = where(err)
    if isinstance(err, redis.AuthenticationError):  # a ConnectionError subclass: check it first
        # Retrying cannot fix a wrong password: exit and say so (CLI status 2). Where is in
        # the debug log: the message stays the one operators and alerts already match.
        log.debug("redis credentials refused (%s)", at)
        return CannotConnectError("Redis refused our credentials (password hidden)")
    if isinstance(err, (redis.ConnectionError, redis.TimeoutError,
                        redis.exceptions.ClusterError, redis.exceptions.TryAgainError,
                        redis.exceptions.SlotNotCoveredError)):
        # ClusterError: the cluster is down or redirections ran out (a failover under way).
        text = redact_url(str(err))
        log.debug("redis error (%s): %s", at, text)
        if any(m in text.lower() for m in ("name or service not known", "nodename nor servname")):
            # "Error -2 connecting to nosuchhost:6379. Name or service not known."
            return CannotConnectError(f"cannot connect to {at}: {text[:200]}")
        return UnavailableError(f"{at} is unavailable or timed out")
    if isinstance(err, redis.exceptions.InvalidResponse):  # "got 'H' as reply type byte"
        log.debug("redis protocol error (%s): %s", at, redact_url(str(err)))
        server = at.replace("Redis at ", "the server at ", 1) if at != "Redis" else "the server"
        return CannotConnectError(f"{server} answered, but not in the Redis protocol: is it "
                                  "Redis? (check OUTBOX_REDIS_URL's host and port)")
    if isinstance(err, NoPermissionError):  # redis-py strips the "NOPERM" prefix from its text
        return UnavailableError(f"{at} refused the command for our user (ACL)")
    if isinstance(err, redis.ResponseError):
        return _response_error(err, at)
    return None


def _response_error(err: redis.ResponseError, at: str) -> OutboxError | None:
    # a pipeline wraps a command's error: "Command # 1 (XCLAIM …) of pipeline caused error: …"
    text = str(err).split(" of pipeline caused error: ", 1)[-1]
    # Redis 7.0 reports an ACL refusal inside a script without the NOPERM code.
    if text.startswith(("NOPERM", "NOAUTH", "WRONGPASS")) or (
        "can't run this command" in text or "has no permissions" in text
    ):
        return UnavailableError(f"{at} refused the command for our user (ACL)")
    if text.startswith("NOGROUP"):
        return UnavailableError(f"the consumer group is missing on {at} (did Redis lose "
                                "data?)")
    if text.startswith(("LOADING", "BUSY ", "MASTERDOWN", "READONLY")):
        return UnavailableError(f"{at} is not ready (loading, busy or read-only)")
    if "DB index is out of range" in text or "invalid DB index" in text:
        # SELECT at connect: the URL's /N is not below the server's `databases` setting
        return CannotConnectError(f"{at}: no such database number (the server answered "
                                  f"{text!r}; its `databases` setting bounds it, 16 by "
                                  "default)")
    return None
