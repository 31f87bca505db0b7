"""Retrying a failing handler: exponential backoff with jitter, up to a horizon.

A handler that raises is retried, not dead-lettered (design invariant 9): the claim records
the event's attempts and a durable next attempt time (``outbox_consumer_retries``, one row per
group and event), so a restart or a takeover by another consumer of the group does not retry
early, and a retry storm after a restart cannot happen. Until its next attempt is due the entry
is ``waiting``: its handler does not run and the delivery does not count (its counter is put
back). While a strict event retries, the later events of its aggregate wait behind it; other
aggregates keep flowing.

It ends in one of three ways: the handler succeeds (applied, the row is deleted); it raises a
*permanent* error (:class:`PermanentError`, or an exception the policy's ``permanent`` says is
one) and the event is dead-lettered at once as ``rejected``; or its first failure is older
than the policy's ``horizon`` and it is dead-lettered as ``retry_horizon``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

REJECTED = "rejected"
RETRY_HORIZON = "retry_horizon"


class PermanentError(Exception):
    """Raise it from a handler to dead-letter the event at once (reason ``rejected``): it can
    never succeed (invalid for this service, a business rule refuses it), so retrying it only
    delays its aggregate's later events. The message is copied to the letter, so keep
    secrets and personal data out of it."""


Reject = PermanentError  # the name some users know from other frameworks


def _never(_err: BaseException) -> bool:
    return False


@dataclass(frozen=True)
class Retry:
    """When to try a failing handler again.

    Attempt ``n`` (1 = the first failure) waits ``min(cap_s, first_delay_s * factor**(n-1))``,
    spread by ``jitter`` (0.2: a uniformly random 80-120 % of it, so the consumers of many
    failing events do not retry in lockstep). After ``horizon_s`` seconds since the first
    failure the event is dead-lettered (``retry_horizon``). ``permanent(err)`` says which
    exceptions are never worth retrying (besides :class:`PermanentError`)."""

    first_delay_s: float = 1.0
    factor: float = 2.0
    cap_s: float = 60.0
    jitter: float = 0.2
    horizon_s: float = 6 * 3600.0
    permanent: Callable[[BaseException], bool] = field(default=_never, compare=False)

    def __post_init__(self) -> None:
        if self.first_delay_s < 0 or self.cap_s < self.first_delay_s:
            raise ValueError("Retry needs 0 <= first_delay_s <= cap_s")
        if self.factor < 1:
            raise ValueError("Retry factor must be at least 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("Retry jitter must be between 0 and 1")
        if self.horizon_s < 0:
            raise ValueError("Retry horizon_s cannot be negative")

    @classmethod
    def from_settings(cls, settings: Any) -> Retry:
        """The group's default policy from ``ConsumerSettings`` (``OUTBOX_RETRY_*``)."""
        return cls(first_delay_s=settings.retry_first_delay_s, factor=settings.retry_factor,
                   cap_s=settings.retry_max_delay_s, jitter=settings.retry_jitter,
                   horizon_s=settings.retry_horizon)

    def delay_s(self, attempts: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds from the ``attempts``-th failure to the next attempt."""
        exponent = min(max(attempts - 1, 0), 64)  # 2.0**64 s is far beyond any cap
        base = min(self.cap_s, self.first_delay_s * self.factor**exponent)
        return base * (1 - self.jitter + 2 * self.jitter * rand())

    def is_permanent(self, err: BaseException) -> bool:
        """Whether ``err`` dead-letters at once (``rejected``)."""
        return isinstance(err, PermanentError) or bool(self.permanent(err))


@dataclass(frozen=True)
class Verdict:
    """What one failure of a handler leads to: dead (``reason``) or retried at ``next_ms``."""

    attempts: int
    first_failed_ms: int
    next_ms: int | None = None
    reason: str | None = None  # REJECTED or RETRY_HORIZON when dead


def judge(policy: Retry, err: BaseException | None, error: str, attempts: int,
          first_failed_ms: int | None, now_ms: int) -> Verdict:
    """The verdict on a failure: ``attempts`` and ``first_failed_ms`` are the event's earlier
    ones (0 and None for a first failure); ``err`` None means its exception is gone (a failure
    of the optimistic path that was not re-run), judged by ``error`` alone as not permanent."""
    attempts += 1
    first = now_ms if first_failed_ms is None else first_failed_ms
    if err is not None and policy.is_permanent(err):
        return Verdict(attempts, first, reason=REJECTED)
    if now_ms - first >= policy.horizon_s * 1000:
        return Verdict(attempts, first, reason=RETRY_HORIZON)
    return Verdict(attempts, first, next_ms=now_ms + round(policy.delay_s(attempts) * 1000))
