"""A daemon waiting at start-up for its SQLite folder (a volume not mounted yet) must never
refuse the database as "no file" when the folder appears with its file in it."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from outbox_relay.shared import db
from outbox_relay.shared.errors import SchemaNotReadyError, UnavailableError


def test_a_folder_moved_into_place_with_its_file_is_never_a_missing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder appears between the check's two looks (here: right after the file was
    looked for). Looking at the folder first, the file is then there, or the folder was not
    and SQLite says so (unavailable, retried); never ``schema_not_ready`` (permanent)."""
    staging, later = tmp_path / "staging", tmp_path / "later"
    staging.mkdir()
    db.upgrade(made := db.make_engine(f"sqlite:///{staging}/outbox.db"))
    made.dispose()
    engine = db.make_engine(f"sqlite:///{later}/outbox.db", create=False)
    real_exists = Path.exists

    def exists_then_mount(self: Path, *args: object, **kwargs: object) -> bool:
        found = real_exists(self)
        if self == later / "outbox.db" and staging.exists():
            staging.rename(later)  # the folder arrives just after the file was looked for
        return found

    monkeypatch.setattr(Path, "exists", exists_then_mount)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("select 1")).scalar_one() == 1
    except UnavailableError:
        pass  # the folder was not there yet when looked at: retried, and there next time
    except SchemaNotReadyError as err:  # the bug: the check looked at the file first
        raise AssertionError(f"a database that is there was refused: {err}") from err
    finally:
        engine.dispose()
