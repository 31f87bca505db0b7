"""Configuration: one pydantic-settings object per daemon, read once in the entry point.

Every field is an ``OUTBOX_<NAME>`` environment variable and a CLI flag; its description is
also its ``--help`` text. URLs follow SQLAlchemy (``postgresql+psycopg://``, ``sqlite:///``)
and redis-py (``redis://user:password@host:6379/0``, ``rediss://`` for TLS) forms.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.keys import DEFAULT_PREFIX, check_name


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
    log_level: str = Field("INFO", description="Log level (DEBUG shows driver messages).")
    startup_timeout_s: float = Field(
        60.0, ge=0, description="How long a daemon retries an unavailable database at start-up."
    )

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        return check_name("key prefix", value)

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        if value.startswith("postgresql://"):
            return "postgresql+psycopg://" + value[len("postgresql://") :]
        if value.startswith("postgres://"):
            return "postgresql+psycopg://" + value[len("postgres://") :]
        return value


class RelaySettings(CommonSettings):
    """The relay daemon (``outbox relay``)."""

    batch_size: int = Field(500, ge=1, le=10_000, description="Rows claimed per batch.")
    lease_ttl_ms: int = Field(10_000, ge=500, description="Partition lease lifetime.")
    poll_min_ms: int = Field(5, ge=1, description="Shortest idle poll interval.")
    poll_max_ms: int = Field(
        500, ge=1, description="Longest idle poll interval (also the LISTEN fallback)."
    )
    wait_replicas: int = Field(
        0, ge=0, description="Before marking, WAIT until this many replicas acknowledged (0=off)."
    )
    wait_timeout_ms: int = Field(1_000, ge=0, description="Timeout of the WAIT barrier.")
    wait_aof: bool = Field(
        False, description="Before marking, WAITAOF 1 0 (needs Redis >= 7.2 with appendonly)."
    )
    stream_maxlen: int = Field(
        0, ge=0, description="Approximate MAXLEN trim of each stream on append (0 = never trim)."
    )
    redis_timeout_s: float = Field(5.0, gt=0, description="Socket timeout of Redis calls.")
    node_id: str = Field("", description="Name of this relay in leases (default host:pid).")


class ConsumerSettings(CommonSettings):
    """The consumer daemon (``outbox consume``)."""

    group: str = Field("workers", description="Consumer group name.")
    consumer: str = Field("", description="Consumer name within the group (default host:pid).")
    streams: str = Field("runs", description="Comma-separated logical streams to read.")
    batch_size: int = Field(200, ge=1, le=10_000, description="Entries read per XREADGROUP.")
    block_ms: int = Field(1_000, ge=1, description="XREADGROUP BLOCK time.")
    max_deliveries: int = Field(
        5, ge=1, description="Deliveries after which an entry is dead-lettered."
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
    redis_timeout_s: float = Field(
        10.0, gt=0, description="Socket timeout of Redis calls (must exceed block_ms)."
    )

    @field_validator("group")
    @classmethod
    def _group(cls, value: str) -> str:
        return check_name("group", value)

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
        """The logical streams, validated."""
        names = [s.strip() for s in self.streams.split(",") if s.strip()]
        return [check_name("stream", name) for name in names]
