"""A typo in an OUTBOX_* variable is warned about, with the name it probably meant."""

from __future__ import annotations

from outbox_relay.cli import options
from outbox_relay.cli.main import build_parser


def test_unknown_outbox_variables_are_found_with_a_suggestion() -> None:
    build_parser()  # imports every settings model, as every command does
    env = {"OUTBOX_PARTITONS": "8", "OUTBOX_PARTITIONS": "4", "OUTBOX_GROUP": "billing",
           "OUTBOX_RUN_CONCURRENCY": "4", "OUTBOX_METRICS_PORT": "9100",
           "OUTBOX_GROUP_FORGET_S": "1d", "OUTBOX_FAULTS": "", "OUTBOX_TEST_PG_URL": "x",
           "OUTBOX_DEMO_STAGE_MS": "5", "OUTBOX_ZZZ": "1", "PATH": "/bin"}
    assert options.unknown_environment(env) == [("OUTBOX_PARTITONS", "OUTBOX_PARTITIONS"),
                                                ("OUTBOX_ZZZ", None)]


def test_status_columns_fit_long_stream_keys() -> None:
    from outbox_relay.cli import status

    def stream(key: str) -> dict[str, object]:
        return {"key": key, "length": 7, "trimmed": 0, "dead_letters": 0, "groups": []}

    long_key = "payments-eu-west-production:{invoice-settlements:12}"
    report = {"outbox": {"undelivered": 0, "delivered": 0, "oldest_undelivered_age_s": None,
                         "errors": {}},
              "streams": [stream(long_key), stream("o:{a:0}")]}
    lines = status.render(report).splitlines()
    header, first, second = lines[1], lines[2], lines[3]
    end = header.index("length") + len("length")  # right-aligned numbers end under it
    assert first[end - 1] == second[end - 1] == "7"
    assert first.startswith(long_key + " ")
