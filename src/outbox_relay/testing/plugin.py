"""The pytest plugin: an ``outbox`` fixture giving each test an :class:`testing.Outbox`.

Enable it in a test module or the root ``conftest.py`` with
``pytest_plugins = ["outbox_relay.testing.plugin"]`` (a module of its own that only pytest
imports: a plugin module imported before pytest registers it fails a run with
``filterwarnings = error``), then override ``outbox_handlers`` (the registry under test)
and, if needed, ``outbox_options``. Each test gets a kit of its own, closed after
it: a temporary SQLite file and fakeredis, or, when ``OUTBOX_TEST_DATABASE_URL`` /
``OUTBOX_TEST_REDIS_URL`` are set, a schema of its own on that PostgreSQL and a key prefix of
its own on that Redis (read when the fixture runs, never at import).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from outbox_relay.consumer.handlers import Handlers
from outbox_relay.testing.kit import Options, Outbox


@pytest.fixture
def outbox_handlers() -> Handlers:
    """The handlers the ``outbox`` fixture's consumer runs; override it to return yours
    (an empty registry by default: every event is dead-lettered ``unknown_type``)."""
    return Handlers()


@pytest.fixture
def outbox_options() -> Options:
    """Further keywords of the ``outbox`` fixture's kit (group, streams, partitions, consumer
    settings); override it to change them. Default: group ``tests``, every stream the outbox
    holds, ``OUTBOX_PARTITIONS`` (4 unless set)."""
    return Options()


@pytest.fixture
def outbox(outbox_handlers: Handlers, outbox_options: Options) -> Iterator[Outbox]:
    """A test kit for one test: ``enqueue``, ``drain``, ``receipts``, ``dead_letters`` and its
    ``engine`` for the test's own tables and assertions."""
    database_url = os.environ.get("OUTBOX_TEST_DATABASE_URL") or None
    redis_url = os.environ.get("OUTBOX_TEST_REDIS_URL") or None
    with Outbox(outbox_handlers, database_url=database_url, redis_url=redis_url,
                **outbox_options) as kit:
        yield kit
