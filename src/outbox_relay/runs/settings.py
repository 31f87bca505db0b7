"""Every setting of the runs component, in one place: the execution policy (:class:`RunSettings`,
``OUTBOX_RUN_*``, ``OUTBOX_SWEEP_*``), a consumer daemon running the run worker
(:class:`WorkerSettings`) and the HTTP service (:class:`ServeSettings`, ``outbox serve``).

Kept apart from the HTTP app so the CLI can build its flags without importing FastAPI and
uvicorn (half a second on every ``outbox`` command).
"""

from __future__ import annotations

from pydantic import Field

from outbox_relay.shared.settings import CommonSettings, ConsumerSettings, DaemonSettings


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


class WorkerSettings(ConsumerSettings, RunSettings):
    """A consumer daemon that runs the run worker (``OUTBOX_RUN_*``, ``OUTBOX_SWEEP_*``)."""


class ServeSettings(DaemonSettings, RunSettings):
    """The HTTP service (``outbox serve``)."""

    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8080, ge=0, le=65535, description="TCP port to listen on.")
    max_body_bytes: int = Field(
        default=65_536, ge=256, description="Largest accepted request body; larger is 413."
    )
