"""``--log-level`` / ``--log-format`` as a user meets them: a bad value is a clear
``invalid_config`` (exit 2, no traceback) on every command; a daemon started with
``--log-format json`` writes one JSON object per line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from outbox_relay.cli.main import build_parser
from tests.conftest import REDIS_URL
from tests.helpers import PARTITIONS, outbox

pytestmark = pytest.mark.acceptance


def leaf_commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[str, ...]]:
    """Every runnable command of the parser (``db upgrade``, ``relay``, ``dlq list`` …)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [path]
    return [leaf for name, child in subs[0].choices.items()
            for leaf in leaf_commands(child, (*path, name))]


COMMANDS = leaf_commands(build_parser())
REQUIRED = {("dlq", "show"): ["1-0"], ("dlq", "replay"): ["--all"],  # their own required args
            ("groups", "forget"): ["g"]}


def test_every_command_is_listed() -> None:
    names = {" ".join(c) for c in COMMANDS}
    assert {"db upgrade", "db check", "relay", "consume", "serve", "status", "demo"} <= names


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_bad_log_level_is_invalid_config(command: tuple[str, ...], tmp_path: Path) -> None:
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path}/x.db"}
    args = [*command, *REQUIRED.get(command, []), "--log-level", "verbose"]
    result = outbox(*args, env=env, cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("error invalid_config: "), result.stderr
    assert "log_level" in result.stderr and "'verbose'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.db").exists()  # refused before anything was opened


@pytest.mark.parametrize(("name", "value"), [("OUTBOX_LOG_LEVEL", "loud"),
                                             ("OUTBOX_LOG_FORMAT", "xml")])
def test_a_bad_log_setting_in_the_environment_is_invalid_config(
    name: str, value: str, tmp_path: Path
) -> None:
    result = outbox("relay", env={name: value, "OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path}/x"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error invalid_config: "), result.stderr
    assert name.removeprefix("OUTBOX_").lower() in result.stderr
    assert "Traceback" not in result.stderr


def test_a_daemon_logs_json_lines(tmp_path: Path, key_prefix: str) -> None:
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path}/x.db", "OUTBOX_REDIS_URL": REDIS_URL,
           "OUTBOX_KEY_PREFIX": key_prefix, "OUTBOX_PARTITIONS": str(PARTITIONS),
           "OUTBOX_LOG_FORMAT": "json"}
    assert outbox("db", "upgrade", env=env).returncode == 0
    result = outbox("relay", "--until-idle", "--node-id", "relay-json", "--log-level", "info",
                    env=env)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    started = [r for r in lines if r["message"] == "relay relay-json started"]
    assert started and started[0]["node"] == "relay-json"
    assert started[0]["level"] == "INFO" and started[0]["logger"] == "outbox_relay.relay.daemon"
