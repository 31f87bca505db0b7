"""Every setting of the runs component, in one place: the execution policy (:class:`RunSettings`,
``OUTBOX_RUN_*``, ``OUTBOX_SWEEP_*``), the retention of terminal runs
(:class:`RunsRetentionSettings`, ``OUTBOX_RETENTION_RUNS``: the CLI adds it to the commands that
prune, ``outbox consume`` and ``outbox prune``), a consumer daemon running the run worker
(:class:`WorkerSettings`, reading the ``runs`` stream unless told) and the HTTP service
(:class:`ServeSettings`, ``outbox serve``).

Kept apart from the HTTP app so the CLI can build its flags without importing FastAPI and
uvicorn (half a second on every ``outbox`` command).
"""

from __future__ import annotations

from pydantic import Field, SecretStr

from outbox_relay.runs.store import RUNS_STREAM
from outbox_relay.shared.settings import CommonSettings, ConsumerSettings, DaemonSettings, Duration


class RunsRetentionSettings(CommonSettings):
    """How long terminal runs are kept (:mod:`runs.prune`); pruned by every consumer daemon and
    ``outbox prune`` of a database with the runs tables."""

    retention_runs: Duration = Field(
        30 * 86400.0,
        description="Terminal runs (completed/failed) unchanged for this long are pruned "
        "(where the runs tables exist); off keeps them.",
    )


class RunSettings(CommonSettings):
    """Run execution policy shared by workers, the sweeper and the HTTP service."""

    run_lease_ttl_ms: int = Field(
        30_000, ge=100, description="How long a worker holds a run it runs; heartbeats extend it."
    )
    run_heartbeat_ms: int = Field(
        10_000, ge=20, description="How often a worker extends the leases of the runs it holds."
    )
    run_max_attempts: int = Field(
        5, ge=1, description="Resumes after expired leases before a run fails (attempts_exhausted)."
    )
    run_concurrency: int = Field(4, ge=1, le=256, description="Runs one worker executes at once.")
    sweep_interval_ms: int = Field(
        5_000, ge=50, description="How often a consumer daemon sweeps for expired leases."
    )
    sweep_batch: int = Field(100, ge=1, le=10_000, description="Expired runs handled per sweep.")


class WorkerSettings(ConsumerSettings, RunSettings, RunsRetentionSettings):
    """A consumer daemon that runs the run worker (``OUTBOX_RUN_*``, ``OUTBOX_SWEEP_*``): what
    ``outbox consume`` loads for an app that is a :class:`runs.Runs`. It reads the run events'
    stream unless told otherwise (a plain consumer has no default stream)."""

    streams: str = Field(
        RUNS_STREAM, description="Comma-separated logical streams to read (the run worker's "
        f"events are on {RUNS_STREAM!r}).",
    )


class ServeSettings(DaemonSettings, RunSettings):
    """The HTTP service (``outbox serve``)."""

    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8080, ge=0, le=65535, description="TCP port to listen on.")
    max_body_bytes: int = Field(
        default=65_536, ge=256, description="Largest accepted request body; larger is 413."
    )
    api_tokens: SecretStr = Field(
        default=SecretStr(""),
        description="Bearer tokens of the API, as name:token entries (comma-separated; several "
        "per name to rotate; tokens 16+ characters). Required unless host is loopback. Prefer "
        "the environment or api_tokens_file to a flag (flags show in ps). See docs/security.md.",
    )
    api_tokens_file: str = Field(
        default="", description="A file of name:token lines (# comments), read at start."
    )
    api_admins: str = Field(
        default="", description="Comma-separated caller names that see and answer every run "
        "(any other caller only the runs it created).",
    )
    api_auth: bool = Field(
        default=False, description="Require a token on a loopback host too (tokens are always "
        "required on any other address, and whenever some are configured).",
    )
    api_create_rate: float = Field(
        default=5.0, ge=0, description="Runs one caller may create per second, on average "
        "(token bucket; over it: 429 with Retry-After); 0 = no limit.",
    )
    api_create_burst: int = Field(
        default=20, ge=1, description="Runs one caller may create at once, before "
        "api_create_rate applies.",
    )
    api_read_timeout_s: float = Field(
        default=10.0, gt=0, le=3600, description="A connection must send a whole request (head "
        "and body) within this long of opening or of its first byte; else it is closed.",
    )
    api_keep_alive_s: int = Field(
        default=5, ge=1, le=3600, description="An idle kept-alive connection is closed after "
        "this many seconds.",
    )
    api_max_head_bytes: int = Field(
        default=16_384, ge=1_024, le=1_048_576, description="Largest request line plus headers; "
        "larger is refused (400) and the connection closed.",
    )
    api_limit_concurrency: int = Field(
        default=100, ge=1, le=100_000, description="Open connections and requests at once; "
        "requests beyond it get 503 at once.",
    )
    api_ssl_certfile: str = Field(
        default="", description="TLS: the server's certificate chain (PEM); empty = plain HTTP."
    )
    api_ssl_keyfile: str = Field(default="", description="TLS: the server's private key (PEM).")
    api_ssl_ca_certs: str = Field(
        default="", description="TLS: CA bundle that client certificates must chain to; with "
        "it, a client certificate is required (mutual TLS), besides the bearer token.",
    )
    console: bool = Field(
        default=False, description="Serve the operator console (dead letters, backlog, groups; "
        "replay and purge, recorded) under /console; off by default. Read-only unless API "
        "tokens are configured. See docs/operations.md#console.",
    )
    console_apps: str = Field(
        default="", description="The handlers the console replays each group's dead letters "
        "with, as group=module:attribute entries, comma-separated (the --app of that group's "
        "consumers); a group without an entry is never replayed from the console.",
    )
