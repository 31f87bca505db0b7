"""``shared.gc_pace``: ``outbox relay`` and ``outbox consume`` pace Python's collector by
``OUTBOX_GC_THRESHOLD`` (``--gc-threshold``); 0 leaves Python's setting; the library alone
never touches it."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from outbox_relay.cli import main as cli
from outbox_relay.shared import gc_pace
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings
from tests.conftest import REDIS_URL


@pytest.fixture
def kept_threshold() -> Iterator[tuple[int, int, int]]:
    """The process's thresholds, set back after the test."""
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_pace_sets_the_young_generation_only(kept_threshold: tuple[int, int, int]) -> None:
    gc.set_threshold(700, 11, 12)
    gc_pace.pace(4321)
    assert gc.get_threshold() == (4321, 11, 12)
    gc_pace.pace(0)
    assert gc.get_threshold() == (4321, 11, 12)
    assert RelaySettings().gc_threshold == ConsumerSettings().gc_threshold == 10_000


@pytest.mark.parametrize("threshold", [2345, 0])
def test_the_relay_daemon_paces_the_collector_as_told(
    engine: Engine, database_url: str, key_prefix: str, threshold: int,
    kept_threshold: tuple[int, int, int],
) -> None:
    gc.set_threshold(700, 10, 10)
    code = cli.main(["relay", "--until-idle", "--database-url", database_url,
                     "--redis-url", REDIS_URL, "--key-prefix", key_prefix,
                     "--gc-threshold", str(threshold)])
    assert code == 0
    assert gc.get_threshold() == ((threshold or 700), 10, 10)
