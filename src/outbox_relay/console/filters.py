"""The console's filters and paging, read from a request and checked before anything runs.

Everything an operator types is checked here and refused with ``invalid_request`` (422) saying
which value is wrong: a stream that cannot be a stream name, a negative partition, an age that
is not a duration, a word longer than any reason or type. So nothing odd reaches Redis or the
database, and a typo is never read as "no filter".
"""

from __future__ import annotations

from dataclasses import dataclass

from outbox_relay.consumer.dead_letters import Filter
from outbox_relay.shared import keys
from outbox_relay.shared.errors import ConfigError, InvalidRequestError
from outbox_relay.shared.settings import parse_duration

MAX_WORD = 256  # the longest event type the outbox stores (outbox_events.type)


@dataclass(frozen=True)
class Asked:
    """The filter fields of a request, as typed (query parameters or a JSON body)."""

    stream: str | None = None
    partition: int | None = None
    group: str | None = None
    reason: str | None = None
    type: str | None = None
    older_than: str | None = None
    newer_than: str | None = None


def to_filter(asked: Asked) -> Filter:
    """A :class:`consumer.dead_letters.Filter`, or ``invalid_request`` naming the bad value."""
    stream = _blank_is_none(asked.stream)
    if stream is not None:
        try:
            keys.check_name("stream", stream)
        except ConfigError as err:
            raise InvalidRequestError(f"stream: {err.message}") from None
    if asked.partition is not None and not 0 <= asked.partition < 2**31:
        raise InvalidRequestError("partition: must be 0 or more")
    return Filter(
        stream=stream, partition=asked.partition,
        group=_word("group", asked.group), reason=_word("reason", asked.reason),
        type=_word("type", asked.type),
        older_than_ms=_age("older_than", asked.older_than),
        newer_than_ms=_age("newer_than", asked.newer_than),
    )


def page_size(limit: int, most: int) -> int:
    """``limit`` if it is 1 to ``most``, else ``invalid_request``."""
    if not 1 <= limit <= most:
        raise InvalidRequestError(f"limit: must be 1 to {most}")
    return limit


def _word(name: str, value: str | None) -> str | None:
    value = _blank_is_none(value)
    if value is not None and (len(value) > MAX_WORD or not value.isprintable()):
        raise InvalidRequestError(f"{name}: at most {MAX_WORD} printable characters")
    return value


def _age(name: str, value: str | None) -> int:
    value = _blank_is_none(value)
    if value is None:
        return 0
    try:
        seconds = parse_duration(value)
    except ValueError as err:
        raise InvalidRequestError(f"{name}: {err}") from None
    if seconds > 100 * 365 * 86400:
        raise InvalidRequestError(f"{name}: at most 100 years")
    return int(seconds * 1000)


def _blank_is_none(value: str | None) -> str | None:
    if value is None or not value.strip():
        return None
    return value.strip()
