"""Fixtures of the integration tests (on top of tests/conftest.py)."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from tests.helpers import create_effects


@pytest.fixture
def effects_engine(engine: Engine) -> Engine:
    """A migrated engine (both databases) with the test handlers' effects table."""
    create_effects(engine)
    return engine
