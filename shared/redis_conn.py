"""Redis connection factory and error wrapping (redis-py with hiredis)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import redis
from redis.exceptions import NoPermissionError

from outbox_relay.shared.errors import CannotConnectError, ConfigError, UnavailableError
from outbox_relay.shared.redaction import redact_url

log = logging.getLogger(__name__)


SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379


def connect_redis(url: str, *, timeout_s: float = 5.0) -> redis.Redis:
    """A client for ``url`` (``redis://``, ``rediss://``, ``unix://``, or a Sentinel set:
    ``redis+sentinel://``/``rediss+sentinel://``, see :func:`sentinel_master`) with bounded
    timeouts.

    Responses stay ``bytes``: entry fields may hold anything a foreign producer wrote, and the
    envelope parser decides what is valid UTF-8.
    """
    if url.split("://", 1)[0].lower() in SENTINEL_SCHEMES:
        return sentinel_master(url, timeout_s=timeout_s)
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
    from urllib.parse import parse_qs, unquote, urlsplit

    from redis.sentinel import Sentinel

    invalid = ConfigError(f"invalid Sentinel URL {redact_url(url)}: expected "
                          "redis+sentinel://[user:password@]host[:port],…/service[/db]")
    try:
        parts = urlsplit(url)
        addresses = []
        for item in parts.netloc.rpartition("@")[2].split(","):
            host, colon, port = item.strip().rpartition(":")
            if not colon or host.endswith(":") or (item.strip().startswith("[")
                                                   and not host.endswith("]")):
                host, port = item.strip(), ""  # no port (an IPv6 address has colons of its own)
            addresses.append((host.strip("[]"), int(port) if port else SENTINEL_PORT))
        path = [unquote(p) for p in parts.path.split("/") if p]
        query = parse_qs(parts.query, strict_parsing=bool(parts.query))
    except ValueError:
        raise invalid from None
    if (not 1 <= len(path) <= 2 or not all(host for host, _ in addresses)
            or (len(path) == 2 and not path[1].isdigit())):
        raise invalid
    if unknown := sorted(set(query) - {"sentinel_password"}):
        raise ConfigError(f"invalid Sentinel URL {redact_url(url)}: unknown parameter(s) "
                          f"{', '.join(unknown)} (known: sentinel_password)")
    service, db = path[0], int(path[1]) if len(path) == 2 else 0
    timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": min(timeout_s, 5.0)}
    sentinel_password = query.get("sentinel_password", [None])[0]
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        addresses, sentinel_kwargs={**timeouts, "password": sentinel_password})
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        service, username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None, db=db,
        ssl=parts.scheme.lower().startswith("rediss"), health_check_interval=30,
        retry_on_timeout=False, **timeouts,
    )
    return client


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
    except (redis.ConnectionError, redis.TimeoutError) as err:
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
