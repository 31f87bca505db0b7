"""Settings of ``outbox serve``, apart from the app so the CLI can build its flags without
importing FastAPI and uvicorn (half a second on every ``outbox`` command)."""

from __future__ import annotations

from pydantic import Field

from outbox_relay.shared import runstate as rs
from outbox_relay.shared.settings import DaemonSettings


class ServeSettings(DaemonSettings, rs.RunSettings):
    """The HTTP service (``outbox serve``)."""

    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8080, ge=0, le=65535, description="TCP port to listen on.")
    max_body_bytes: int = Field(
        default=65_536, ge=256, description="Largest accepted request body; larger is 413."
    )
