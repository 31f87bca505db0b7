"""Configuration: one pydantic-settings object per daemon, read once in the entry point.

Every field is an ``OUTBOX_<NAME>`` environment variable and a CLI flag; its description is
also its ``--help`` text. URLs follow SQLAlchemy (``postgresql+psycopg://``, ``sqlite:///``)
and redis-py (``redis://user:password@host:6379/0``, ``rediss://`` for TLS) forms.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox_relay.shared.errors import ConfigError
from outbox_relay.shared.keys import DEFAULT_PREFIX, check_name

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any) -> float:
    """Seconds from ``90``, ``"90s"``, ``"15m"``, ``"2h"``, ``"7d"``, ``"500ms"``; ``"off"`` and
    ``0`` mean 0 (the rule is off). Anything else is a clear validation error."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or e.g. 90s, 15m, 2h, 7d, off")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    text = str(value).strip().lower()
    if text in ("off", "never", "none", ""):
        return 0.0
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{value!r} is not a duration (e.g. 90s, 15m, 2h, 7d, off)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


Duration = Annotated[float, BeforeValidator(parse_duration)]
"""Seconds; the environment and flags also accept ``15m``/``2h``/``7d``/``off``."""


def declared_groups(value: str) -> dict[str, list[str]]:
    """``{stream: [group, ...]}`` from ``"runs:workers,orders:billing,orders:shipping"``
    (``OUTBOX_STREAM_GROUPS``); a malformed pair is a clear validation error."""
    declared: dict[str, list[str]] = {}
    for pair in (p.strip() for p in value.split(",")):
        if not pair:
            continue
        stream, sep, group = pair.partition(":")
        if not sep:
            raise ValueError(f"{pair!r} is not stream:group (e.g. runs:workers)")
        try:
            check_name("stream", stream.strip())
            check_name("group", group.strip())
        except ConfigError as err:
            raise ValueError(str(err)) from None
        names = declared.setdefault(stream.strip(), [])
        if group.strip() not in names:
            names.append(group.strip())
    return declared


class CommonSettings(BaseSettings):
    """What every component needs to find the database, Redis and the streams."""

    model_config = SettingsConfigDict(env_prefix="OUTBOX_", extra="ignore", frozen=True)

    database_url: str = Field(
        "sqlite:///./outbox.db",
        description="SQLAlchemy URL of the database holding runs, outbox and inbox.",
    )
    redis_url: str = Field(
        "redis://localhost:6379/0",
        description="redis-py URL of the Redis server (rediss:// for TLS, user:password@ for ACL).",
    )
    key_prefix: str = Field(DEFAULT_PREFIX, description="Prefix of every Redis key we write.")
    partitions: int = Field(
        4, ge=1, le=1024, description="Partitions per stream; an aggregate always maps to one."
    )
    log_level: str = Field(
        "INFO", description="Log level: DEBUG (shows driver messages), INFO, WARNING, ERROR."
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="Log lines as text, or one JSON object per line (json)."
    )
    startup_timeout_s: float = Field(
        60.0, ge=0, description="How long a daemon retries an unavailable database at start-up."
    )

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        return check_name("key prefix", value)

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        level = value.strip().upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"{value!r} is not one of {', '.join(LOG_LEVELS)}")
        return level

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        if sep and not scheme.startswith("sqlite") and rest.count("@") > 1:
            # SQLAlchemy ends the password at the first '@', a person reads it to the last:
            # the driver would be sent a piece of the password as its host (and print it in
            # its error). Refused before any connection, naming no part of the URL.
            raise ValueError(
                "database_url holds more than one '@': percent-encode '@' in the user name "
                "or password as %40 (and '/', '?', '#', ':' as %2F, %3F, %23, %3A)")
        if value.startswith("postgresql://"):
            return "postgresql+psycopg://" + value[len("postgresql://") :]
        if value.startswith("postgres://"):
            return "postgresql+psycopg://" + value[len("postgres://") :]
        return value


class DaemonSettings(CommonSettings):
    """What every long-running daemon (relay, consume, serve) adds: metrics and health."""

    metrics_port: int = Field(
        0, ge=0, le=65535,
        description="Port serving /metrics (OpenMetrics), /healthz and /readyz (0 = off).",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Address the metrics port listens on: loopback unless told (0.0.0.0 in a "
        "Kubernetes pod, so the kubelet and Prometheus reach it).",
    )
    progress_interval_s: Duration = Field(
        60.0,
        description="Relay and consumer: an INFO line this often with the work done since the "
        "last one, its rate, and what still waits (backlog, lag); off (or --quiet): none.",
    )
    signing_key: SecretStr = Field(
        SecretStr(""),
        description="HMAC-SHA256 keys (comma-separated, 16+ characters each; the first signs, "
        "all verify): relays sign every entry, consumers dead-letter unsigned or forged ones "
        "(bad_signature). Empty = off. See docs/security.md.",
    )


class PacedSettings(CommonSettings):
    """What the relay and consumer daemons add: the garbage collector's pace
    (:mod:`shared.gc_pace`)."""

    gc_threshold: int = Field(
        10_000, ge=0,
        description="New objects between two young collections of Python's garbage collector "
        "in the relay and consumer daemons (Python's default: 700; 0 leaves it). Fewer "
        "collections of a claim's live objects: a fifth to a third less consumer CPU "
        "(docs/performance.md).",
    )


class RetentionSettings(CommonSettings):
    """Bounded growth (design invariant 7): how long what we write is kept. Durations accept
    seconds or ``15m``/``2h``/``7d``; ``off`` (or 0) turns a rule off. No rule deletes what is
    still needed: an undelivered row, an entry some group has not acknowledged, a receipt a
    redelivery could still need, a dead receipt whose letter still exists."""

    retention_delivered: Duration = Field(
        7 * 86400.0,
        description="Delivered outbox rows older than this are pruned (by the relay).",
    )
    retention_inbox: Duration = Field(
        14 * 86400.0,
        description="Inbox receipts and aggregate heads older than this are pruned (by the "
        "consumer); must be at least retention_delivered + stream_keep_s.",
    )
    retention_dead_letters: Duration = Field(
        30 * 86400.0,
        description="Dead letters older than this are trimmed from the dead-letter streams.",
    )
    prune_interval_s: float = Field(
        60.0, gt=0, description="How often a daemon runs its retention pass."
    )
    prune_batch: int = Field(
        1_000, ge=1, le=100_000, description="Rows deleted per retention transaction."
    )
    stream_trim: bool = Field(
        True,
        description="Trim each partition stream below what every consumer group acknowledged "
        "(keeping stream_keep entries and stream_keep_s seconds).",
    )
    stream_keep: int = Field(
        1_000, ge=0, description="Newest entries every trim keeps (for new groups, redis-cli)."
    )
    stream_keep_s: Duration = Field(
        3600.0, description="Entries younger than this are never trimmed."
    )
    trim_interval_s: float = Field(
        10.0, gt=0, description="How often the relay trims the streams of its partitions."
    )
    consumer_idle_s: Duration = Field(
        86400.0,
        description="Consumers idle longer than this with nothing pending are removed from "
        "their group (XGROUP DELCONSUMER); off keeps them.",
    )
    group_forget_s: Duration = Field(
        86400.0,
        description="A consumer group the relay has seen on a stream and finds missing (Redis "
        "lost it; its consumers have not recreated it) holds that stream's trimming; after "
        "this long missing it is taken as deleted on purpose and forgotten; off: never.",
    )

    stream_groups: str = Field(
        "",
        description="Groups that must read a stream, as stream:group pairs (comma-separated, "
        "e.g. runs:workers,orders:billing). The relay creates each at 0 on every partition "
        "stream of its stream it trims, so the stream keeps what the group has not read even "
        "before the group's consumers first start; a group created later by its consumers "
        "sees only what a trim has left.",
    )

    @field_validator("stream_groups")
    @classmethod
    def _valid_stream_groups(cls, value: str) -> str:
        declared_groups(value)
        return value

    def declared(self) -> dict[str, list[str]]:
        """``stream_groups`` parsed: ``{stream: [group, ...]}``."""
        return declared_groups(self.stream_groups)

    @model_validator(mode="after")
    def _receipts_outlive_redelivery(self) -> RetentionSettings:
        # A receipt must outlive every way its event can come back: a repair refills delivered
        # rows still in the outbox, and the stream keeps entries for stream_keep_s. Pruning a
        # receipt earlier would let a redelivery apply the event a second time.
        if self.retention_inbox and not self.retention_delivered and not self.stream_trim:
            raise ValueError(
                "retention_inbox needs retention_delivered or stream_trim: with both off, a "
                "repair can refill any delivered row, so no receipt may ever be pruned "
                "(set retention_inbox=off)"
            )
        if self.retention_inbox and self.retention_delivered:
            needed = self.retention_delivered + self.stream_keep_s
            if self.retention_inbox < needed:
                raise ValueError(
                    f"retention_inbox ({self.retention_inbox:g}s) must be at least "
                    f"retention_delivered + stream_keep_s ({needed:g}s): a repair or the "
                    "stream could still redeliver events whose receipts would be gone"
                )
        return self


class RelaySettings(DaemonSettings, RetentionSettings, PacedSettings):
    """The relay daemon (``outbox relay``)."""

    batch_size: int = Field(500, ge=1, le=10_000, description="Rows taken per batch.")
    lease_ttl_ms: int = Field(10_000, ge=500, description="Partition lease lifetime.")
    poll_min_ms: int = Field(
        5, ge=1, description="Poll interval after a poll that found rows (also while LISTENing)."
    )
    poll_max_ms: int = Field(
        500, ge=1, description="Longest poll interval, listening or not: the most a row nobody "
        "notified waits."
    )
    wait_replicas: int = Field(
        0, ge=0, description="Before marking, WAIT until this many replicas acknowledged (0=off)."
    )
    wait_timeout_ms: int = Field(1_000, ge=0, description="Timeout of the WAIT barrier.")
    wait_aof: bool = Field(
        False, description="Before marking, WAITAOF 1 0 (needs Redis >= 7.2 with appendonly)."
    )
    stream_maxlen_unsafe: int = Field(
        0, ge=0,
        description="LOSES DATA: approximate MAXLEN trim on every append, ignoring consumer "
        "groups (a lagging group loses entries it never read). 0 = off; prefer stream_trim.",
    )
    redis_timeout_s: float = Field(5.0, gt=0, description="Socket timeout of Redis calls.")
    node_id: str = Field("", description="Name of this relay in leases (default host:pid).")
    refusal_first_delay_s: float = Field(
        0.5, gt=0, description="A stream whose append Redis refused (OOM, ACL …) waits this "
        "long before its next attempt; each further wait doubles (other streams go on).",
    )
    refusal_max_delay_s: float = Field(
        30.0, gt=0, description="The longest wait between two attempts of a refused stream.",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        import os

        if os.environ.get("OUTBOX_STREAM_MAXLEN"):
            raise ValueError(
                "OUTBOX_STREAM_MAXLEN was removed: it trimmed entries groups had not read. "
                "Trimming is now tied to acknowledgements (OUTBOX_STREAM_TRIM, on by default); "
                "OUTBOX_STREAM_MAXLEN_UNSAFE keeps the old behaviour"
            )
        return data


class ConsumerSettings(DaemonSettings, RetentionSettings, PacedSettings):
    """The consumer daemon (``outbox consume``)."""

    group: str = Field("workers", description="Consumer group name.")
    consumer: str = Field("", description="Consumer name within the group (default host:pid).")
    streams: str = Field(
        "", description="Comma-separated logical streams to read; required (no stream is read "
        "by default).",
    )
    batch_size: int = Field(200, ge=1, le=10_000, description="Entries read per XREADGROUP.")
    block_ms: int = Field(1_000, ge=1, description="XREADGROUP BLOCK time.")
    max_deliveries: int = Field(
        0, ge=0,
        description="Deliveries after which an entry is dead-lettered (0 = off: retries end "
        "at retry_horizon instead). A not-yet-due retry does not count as a delivery.",
    )
    retry_first_delay_s: float = Field(
        1.0, ge=0, description="Default retry policy: wait after a handler's first failure."
    )
    retry_factor: float = Field(
        2.0, ge=1, description="Default retry policy: each further wait is this many times longer."
    )
    retry_max_delay_s: Duration = Field(
        60.0, description="Default retry policy: the longest wait between two attempts (so an "
        "outage is over for a handler at most this long after it ends)."
    )
    retry_jitter: float = Field(
        0.2, ge=0, le=1, description="Default retry policy: each wait is spread by +/- this share."
    )
    retry_horizon: Duration = Field(
        6 * 3600.0,
        description="Default retry policy: a failing event is dead-lettered (retry_horizon) "
        "once its first failure is this old; 0 dead-letters at the first failure.",
    )
    claim_idle_ms: int = Field(
        30_000, ge=100,
        description="Deprecated and ignored: the owner of a partition stream takes over its "
        "pending entries at once (see lease_ttl_ms).",
    )
    claim_interval_ms: int = Field(
        5_000, ge=100,
        description="How often the owner re-reads pending entries (failed or waiting ones), "
        "in id order, while there are any.",
    )
    lease_ttl_ms: int = Field(
        10_000, ge=500,
        description="Lease of a partition stream by one consumer of the group: renewed every "
        "third of it, read only within half of it since the last renewal, taken over by "
        "another consumer once expired. block_ms must be below a quarter of it.",
    )
    max_data_bytes: int = Field(
        1_048_576, ge=1, description="Largest accepted 'data' field; larger is dead-lettered."
    )
    bounded_reads: bool = Field(
        True, description="Refuse entries larger than max_data_bytes + 64 KiB unread (a read "
        "script; an idle consumer polls, woken by the relay's doorbell). false: plain blocking "
        "XREADGROUP, but an entry of any size is read whole.",
    )
    doorbell: bool = Field(
        True, description="With bounded reads on PostgreSQL, wait on the streams' appended "
        "channels (Pub/Sub SUBSCRIBE, published by the relay): a new entry is read at once and "
        "an idle consumer polls every 250 ms. false, SQLite, or SUBSCRIBE failing: poll every "
        "1-20 ms.",
    )
    redis_timeout_s: float = Field(
        10.0, gt=0, description="Socket timeout of Redis calls (must exceed block_ms)."
    )

    @field_validator("group")
    @classmethod
    def _group(cls, value: str) -> str:
        return check_name("group", value)

    @model_validator(mode="after")
    def _retry_delays(self) -> ConsumerSettings:
        if self.retry_max_delay_s < self.retry_first_delay_s:
            raise ValueError("retry_max_delay_s must be at least retry_first_delay_s")
        return self

    @model_validator(mode="after")
    def _lease_outlasts_reads(self) -> ConsumerSettings:
        # A read issued just before the half-ttl cut-off can still hand out entries for
        # block_ms; they must reach us before the lease can expire (and be taken over).
        if self.block_ms * 4 >= self.lease_ttl_ms:
            raise ValueError(
                f"block_ms ({self.block_ms}) must be below a quarter of lease_ttl_ms "
                f"({self.lease_ttl_ms})"
            )
        return self

    def stream_names(self) -> list[str]:
        """The logical streams, validated; none at all is ``invalid_config`` (a consumer that
        guessed a stream would read nothing of its own, or another group's events)."""
        names = [s.strip() for s in self.streams.split(",") if s.strip()]
        if not names:
            raise ConfigError("no streams to read: set OUTBOX_STREAMS or --streams to the "
                              "comma-separated logical streams of this group (e.g. "
                              "--streams orders)")
        return [check_name("stream", name) for name in names]
