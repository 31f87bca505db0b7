"""The settings a command loads where it wires components together: a core model with the runs
component's retention rule added, for the commands that prune terminal runs (wherever the
database has the runs tables). The core models never name runs; the CLI composes them here.

``outbox consume`` with an app that is a :class:`runs.Runs` loads the runs component's own
:class:`~outbox_relay.runs.settings.WorkerSettings` instead (cli/main.py).
"""

from __future__ import annotations

from outbox_relay.runs.settings import RunsRetentionSettings
from outbox_relay.shared.settings import ConsumerSettings, RetentionSettings


class ConsumeSettings(ConsumerSettings, RunsRetentionSettings):
    """``outbox consume`` with the user's handlers: the consumer daemon's settings, and the
    retention of terminal runs its retention task applies where the runs tables exist."""


class PruneSettings(RetentionSettings, RunsRetentionSettings):
    """``outbox prune``: every retention rule, the runs one included."""
