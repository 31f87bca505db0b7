"""docs/configuration.md documents every setting a daemon reads: a field added to a settings
model without its row fails here (the flags and ``--help`` come from the same models,
cli/options.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from outbox_relay.runs.settings import ServeSettings, WorkerSettings
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


@pytest.mark.parametrize("model", [RelaySettings, ConsumerSettings, ServeSettings,
                                   WorkerSettings], ids=lambda m: m.__name__)
def test_every_setting_has_its_row(model: type[BaseSettings]) -> None:
    text = DOC.read_text()
    missing = [f"OUTBOX_{name.upper()}" for name in model.model_fields
               if f"`OUTBOX_{name.upper()}`" not in text]
    assert missing == [], f"docs/configuration.md lacks {missing}"
