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


def connect_redis(url: str, *, timeout_s: float = 5.0) -> redis.Redis:
    """A client for ``url`` (``redis://``, ``rediss://``, ``unix://``) with bounded timeouts.

    Responses stay ``bytes``: entry fields may hold anything a foreign producer wrote, and the
    envelope parser decides what is valid UTF-8.
    """
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
