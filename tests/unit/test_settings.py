"""Settings: defaults, environment, validation, and the flags generated from them."""

from __future__ import annotations

import argparse
import os

import pytest
from pydantic import ValidationError

from outbox_relay.cli import apps, options
from outbox_relay.cli import main as cli
from outbox_relay.cli.settings import ConsumeSettings, PruneSettings
from outbox_relay.runs.settings import RunsRetentionSettings, WorkerSettings
from outbox_relay.shared.errors import ConfigError
from outbox_relay.shared.settings import (
    CommonSettings,
    ConsumerSettings,
    RelaySettings,
    RetentionSettings,
)

MODELS = [CommonSettings, RelaySettings, ConsumerSettings]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)


def test_defaults() -> None:
    s = ConsumerSettings()
    assert s.database_url == "sqlite:///./outbox.db"
    assert s.redis_url == "redis://localhost:6379/0"
    assert (s.key_prefix, s.partitions, s.group, s.streams) == ("outbox", 4, "workers", "")
    assert RelaySettings().batch_size == 500


def test_a_consumer_has_no_default_stream_the_run_worker_reads_runs() -> None:
    for given in ("", " , "):
        with pytest.raises(ConfigError) as info:
            ConsumerSettings(streams=given).stream_names()
        assert info.value.code == "invalid_config"
        assert "OUTBOX_STREAMS" in info.value.message and "--streams" in info.value.message
    assert WorkerSettings().stream_names() == ["runs"]
    assert WorkerSettings(streams="runs,orders").stream_names() == ["runs", "orders"]


def test_outbox_consume_loads_the_run_workers_settings_only_for_a_run_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = cli.build_parser()

    def loaded(*flags: str) -> ConsumeSettings:
        return options.load_settings(ConsumeSettings, parser.parse_args(["consume", *flags]))

    monkeypatch.setenv("OUTBOX_RUN_CONCURRENCY", "9")
    runs = apps.resolve(apps.DEFAULT_APP)  # a Runs
    worker = cli.consume_settings(loaded("--group", "w", "--retention-runs", "1d"), runs)
    assert type(worker) is WorkerSettings and worker.stream_names() == ["runs"]
    assert (worker.group, worker.retention_runs, worker.run_concurrency) == ("w", 86400, 9)
    assert "retention_runs" in worker.model_fields_set  # set: warned about without runs tables
    given = cli.consume_settings(loaded("--streams", "runs,orders"), runs)
    assert given.stream_names() == ["runs", "orders"]
    billing = apps.resolve("outbox_relay.cli.demo_app:billing")  # a plain Handlers
    with pytest.raises(ConfigError, match="no streams to read"):
        cli.consume_settings(loaded(), billing)
    plain = cli.consume_settings(loaded("--streams", "invoices", "--retention-runs", "off"),
                                 billing)
    assert type(plain) is ConsumeSettings and plain.stream_names() == ["invoices"]
    assert plain.retention_runs == 0 and not hasattr(plain, "run_concurrency")
    monkeypatch.setenv("OUTBOX_RUN_CONCURRENCY", "0")
    with pytest.raises(ConfigError, match="run_concurrency"):
        cli.consume_settings(loaded(), runs)
    # The relay still accepts the flag it always ignored.
    assert parser.parse_args(["relay", "--retention-runs", "7d"]).command == "relay"


def test_the_runs_retention_rule_is_the_runs_components() -> None:
    assert "retention_runs" not in RetentionSettings.model_fields
    assert "retention_runs" not in ConsumerSettings.model_fields
    assert RunsRetentionSettings().retention_runs == 30 * 86400
    for model in (ConsumeSettings, PruneSettings, WorkerSettings):
        assert model(retention_runs="7d").retention_runs == 7 * 86400


def test_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_PARTITIONS", "8")
    monkeypatch.setenv("OUTBOX_KEY_PREFIX", "app-1")
    monkeypatch.setenv("OUTBOX_WAIT_AOF", "true")
    monkeypatch.setenv("OUTBOX_GROUP", "billing")
    assert RelaySettings().partitions == 8
    assert RelaySettings().wait_aof is True
    assert ConsumerSettings().key_prefix == "app-1"
    assert ConsumerSettings().group == "billing"


def test_arguments_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_PARTITIONS", "8")
    assert CommonSettings(partitions=2).partitions == 2


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://u@h/db", "postgresql+psycopg://u@h/db"),
        ("postgres://u@h/db", "postgresql+psycopg://u@h/db"),
        ("postgresql+psycopg://u@h/db", "postgresql+psycopg://u@h/db"),
        ("sqlite:///x.db", "sqlite:///x.db"),
    ],
)
def test_postgres_urls_use_psycopg3(given: str, expected: str) -> None:
    assert CommonSettings(database_url=given).database_url == expected


@pytest.mark.parametrize("field", ["key_prefix", "group"])
@pytest.mark.parametrize("bad", ["", "a b", "a:b", "{x}"])
def test_unsafe_names_are_config_errors(field: str, bad: str) -> None:
    with pytest.raises(ConfigError):
        ConsumerSettings(**{field: bad})


def test_stream_names_are_split_and_checked() -> None:
    assert ConsumerSettings(streams=" runs, audit ,,").stream_names() == ["runs", "audit"]
    with pytest.raises(ConfigError):
        ConsumerSettings(streams="runs,bad name").stream_names()


@pytest.mark.parametrize(
    ("model", "field", "value"),
    [
        (CommonSettings, "partitions", 0),
        (CommonSettings, "partitions", 1025),
        (RelaySettings, "batch_size", 0),
        (RelaySettings, "lease_ttl_ms", 10),
        (RelaySettings, "redis_timeout_s", 0),
        (ConsumerSettings, "max_deliveries", -1),
        (ConsumerSettings, "claim_idle_ms", 1),
    ],
)
def test_out_of_range_values_are_refused(
    model: type[CommonSettings], field: str, value: object
) -> None:
    with pytest.raises(ValidationError):
        model(**{field: value})


def test_settings_are_frozen() -> None:
    s = CommonSettings()
    with pytest.raises(ValidationError):
        s.partitions = 3


@pytest.mark.parametrize("model", MODELS)
def test_every_field_documents_itself(model: type[CommonSettings]) -> None:
    for name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{name} has no description"


@pytest.mark.parametrize("model", MODELS)
def test_flags_cover_every_field_and_override_the_environment(
    model: type[CommonSettings], monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = argparse.ArgumentParser()
    options.add_settings_flags(parser, model)
    help_text = parser.format_help()
    for name in model.model_fields:
        assert "--" + name.replace("_", "-") in help_text
        assert f"OUTBOX_{name.upper()}" in help_text
    monkeypatch.setenv("OUTBOX_PARTITIONS", "8")
    monkeypatch.setenv("OUTBOX_KEY_PREFIX", "from-env")
    loaded = options.load_settings(model, parser.parse_args(["--partitions", "3"]))
    assert (loaded.partitions, loaded.key_prefix) == (3, "from-env")


def test_invalid_flags_become_one_config_error() -> None:
    parser = argparse.ArgumentParser()
    options.add_settings_flags(parser, RelaySettings)
    with pytest.raises(ConfigError) as info:
        options.load_settings(RelaySettings, parser.parse_args(["--partitions", "0"]))
    assert info.value.code == "invalid_config"
    assert "partitions" in info.value.message


def test_durations_accept_units_and_off() -> None:
    s = PruneSettings(retention_delivered="15m", retention_inbox="2h", stream_keep_s="90s",
                      retention_runs="off")
    assert (s.retention_delivered, s.retention_inbox, s.stream_keep_s, s.retention_runs) == (
        900.0, 7200.0, 90.0, 0.0)
    with pytest.raises(ValidationError, match="not a duration"):
        RelaySettings(retention_delivered="a week")
    with pytest.raises(ValidationError, match="not a duration"):
        RunsRetentionSettings(retention_runs="a week")


def test_receipts_must_outlive_every_redelivery() -> None:
    with pytest.raises(ValidationError, match="retention_delivered \\+ stream_keep_s"):
        ConsumerSettings(retention_delivered="1h", retention_inbox="1h", stream_keep_s="1m")
    with pytest.raises(ValidationError, match="needs retention_delivered or stream_trim"):
        ConsumerSettings(retention_delivered="off", stream_trim=False)
    # trimming on: receipts are pruned only below the trim floor, whatever the outbox keeps
    assert ConsumerSettings(retention_delivered="off").retention_inbox == 14 * 86400
    assert ConsumerSettings(retention_inbox="off", retention_delivered="off",
                            stream_trim=False).retention_inbox == 0


def test_the_removed_maxlen_setting_is_refused_with_its_new_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_STREAM_MAXLEN", "1000")
    with pytest.raises(ValidationError, match="OUTBOX_STREAM_MAXLEN_UNSAFE"):
        RelaySettings()


def test_log_level_is_validated() -> None:
    assert RelaySettings(log_level="debug").log_level == "DEBUG"
    with pytest.raises(ValidationError, match="not one of"):
        RelaySettings(log_level="verbose")


def test_a_database_url_with_an_unencoded_at_in_its_password_is_refused_without_echoing_it(
) -> None:
    """SQLAlchemy ends a password at its first '@': the rest would reach the driver as the
    host (and its error message). Found by the redaction property test."""
    from outbox_relay.shared.settings import CommonSettings

    with pytest.raises(ValueError, match="percent-encode '@'") as caught:
        CommonSettings(database_url="postgresql://u:Sekr1t?@Zw9Vyx/@127.0.0.1:1/x")
    assert "Sekr1t" not in str(caught.value.errors()[0]["msg"])  # type: ignore[attr-defined]
    assert "Zw9Vyx" not in str(caught.value.errors()[0]["msg"])  # type: ignore[attr-defined]
    encoded = CommonSettings(database_url="postgresql://u:Sekr1t%3F%40Zw9Vyx%2F@127.0.0.1:1/x")
    assert encoded.database_url.startswith("postgresql+psycopg://")
    assert CommonSettings(database_url="sqlite:///./a@b.db").database_url == "sqlite:///./a@b.db"
