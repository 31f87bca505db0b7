"""The run state machine: the application's pipeline, the forward-only rank, the rules a writer
without the pipeline follows, and the public snapshot."""

from __future__ import annotations

import itertools

import pytest

from outbox_relay.cli.demo_app import PIPELINE as DEMO
from outbox_relay.runs import Pipeline
from outbox_relay.runs import pipeline as rs
from outbox_relay.runs.errors import InvalidTransitionError
from outbox_relay.runs.snapshot import snapshot
from outbox_relay.shared.errors import ConfigError

SMALL = Pipeline(["fetch", "summarize", "publish"], asking=["summarize"])
HAPPY_PATH = [rs.QUEUED, *DEMO.stages, rs.COMPLETED]


@pytest.mark.parametrize("pipeline", [DEMO, SMALL, Pipeline(["only"])])
def test_the_happy_path_is_allowed_step_by_step(pipeline: Pipeline) -> None:
    for current, new in itertools.pairwise([rs.QUEUED, *pipeline.stages, rs.COMPLETED]):
        pipeline.check_transition(current, new)


@pytest.mark.parametrize("pipeline", [DEMO, SMALL])
def test_failed_is_reachable_from_every_active_status(pipeline: Pipeline) -> None:
    for status in pipeline.statuses - rs.TERMINAL:
        asked_by = min(pipeline.asking) if status == rs.NEEDS_INPUT else None
        pipeline.check_transition(status, rs.FAILED, asked_by=asked_by)


@pytest.mark.parametrize("current, new", [
    ("drafting", "analyzing_jd"),
    ("rendering", rs.QUEUED),
    (rs.COMPLETED, "rendering"),
    (rs.FAILED, rs.QUEUED),
    (rs.COMPLETED, rs.COMPLETED),
    (rs.QUEUED, "drafting"),
    ("drafting", rs.NEEDS_INPUT),
    (rs.QUEUED, "paused"),
    ("fetch", "summarize"),  # another pipeline's stage
])
def test_backward_skipping_terminal_and_unknown_moves_are_refused(current: str, new: str) -> None:
    with pytest.raises(InvalidTransitionError) as info:
        DEMO.check_transition(current, new, new_asked_by=current)
    assert info.value.code == "invalid_transition"


def test_needs_input_names_the_asking_stage_and_resumes_right_after_it() -> None:
    DEMO.check_transition("analyzing_jd", rs.NEEDS_INPUT, new_asked_by="analyzing_jd")
    with pytest.raises(InvalidTransitionError):
        DEMO.check_transition("analyzing_jd", rs.NEEDS_INPUT, new_asked_by=None)
    DEMO.check_transition(rs.NEEDS_INPUT, "matching_evidence", asked_by="analyzing_jd")
    for wrong in ("analyzing_jd", "drafting"):
        with pytest.raises(InvalidTransitionError):
            DEMO.check_transition(rs.NEEDS_INPUT, wrong, asked_by="analyzing_jd")
    with pytest.raises(InvalidTransitionError):  # publish is not an asking stage
        SMALL.check_transition("publish", rs.NEEDS_INPUT, new_asked_by="publish")


@pytest.mark.parametrize("pipeline", [DEMO, SMALL])
def test_rank_grows_along_the_path_and_needs_input_sits_after_its_stage(
    pipeline: Pipeline,
) -> None:
    ranks = [pipeline.rank(s) for s in [rs.QUEUED, *pipeline.stages, rs.COMPLETED]]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    for stage in pipeline.asking:
        waiting = pipeline.rank(rs.NEEDS_INPUT, stage)
        assert pipeline.rank(stage) < waiting < pipeline.rank(pipeline.next_stage(stage))


@pytest.mark.parametrize("stages, asking, says", [
    ([], [], "one or more"),
    (["a", "a"], [], "distinct"),
    (["fetch", "Fetch"], [], "[a-z]"),
    (["fetch", "x" * 33], [], "[a-z]"),
    (["fetch", rs.NEEDS_INPUT], [], "none of"),
    (["queued"], [], "none of"),
    (["fetch", "publish"], ["review"], "not stages"),
    (["fetch", "publish"], ["publish"], "last stage"),
])
def test_a_pipeline_that_cannot_work_is_refused_with_the_reason(
    stages: list[str], asking: list[str], says: str,
) -> None:
    with pytest.raises(ConfigError) as info:
        Pipeline(stages, asking=asking)
    assert info.value.code == "invalid_config" and says in info.value.message


BEFORE = {"asked_by": "summarize", "resume_at": "publish"}


@pytest.mark.parametrize("current, new, before", [
    ("summarize", "summarize", {}),          # a lease or an attempt counter changes
    ("fetch", rs.FAILED, {}),
    (rs.QUEUED, rs.FAILED, {}),
    (rs.NEEDS_INPUT, rs.NEEDS_INPUT, BEFORE),
    (rs.NEEDS_INPUT, "publish", BEFORE),     # answered: where the worker said it resumes
])
def test_without_the_pipeline_staying_failing_and_the_recorded_resume_are_allowed(
    current: str, new: str, before: dict[str, str],
) -> None:
    rs.check_transition(None, current, new, before, before)


@pytest.mark.parametrize("current, new, before", [
    (rs.QUEUED, "fetch", {}),                # leasing a queued run needs the first stage
    ("fetch", "summarize", {}),              # a checkpoint needs the next stage
    ("fetch", rs.COMPLETED, {}),
    (rs.NEEDS_INPUT, "summarize", BEFORE),   # not where it resumes
    (rs.NEEDS_INPUT, "publish", {"asked_by": "summarize"}),  # no resume_at recorded
    (rs.NEEDS_INPUT, rs.COMPLETED, {"asked_by": "summarize", "resume_at": rs.COMPLETED}),
    (rs.COMPLETED, rs.FAILED, {}),
    (rs.FAILED, rs.FAILED, {}),
    ("Not A Status", rs.FAILED, {}),
])
def test_without_the_pipeline_every_move_along_the_stages_is_refused(
    current: str, new: str, before: dict[str, str],
) -> None:
    with pytest.raises(InvalidTransitionError):
        rs.check_transition(None, current, new, before, before)


@pytest.mark.parametrize("pipeline", [None, SMALL])
def test_a_waiting_run_keeps_where_it_resumes_and_goes_on_only_when_all_is_answered(
    pipeline: Pipeline | None,
) -> None:
    waiting = {**BEFORE, "questions": [{"interaction_id": "a"}, {"interaction_id": "b"}]}
    with pytest.raises(InvalidTransitionError):  # rewriting resume_at while waiting
        rs.check_transition(pipeline, rs.NEEDS_INPUT, rs.NEEDS_INPUT, waiting,
                            {**waiting, "resume_at": "fetch"})
    one_left = {**waiting, "questions": [{"interaction_id": "b"}]}
    rs.check_transition(pipeline, rs.NEEDS_INPUT, rs.NEEDS_INPUT, waiting, one_left)
    with pytest.raises(InvalidTransitionError):  # a question is still pending
        rs.check_transition(pipeline, rs.NEEDS_INPUT, "publish", waiting, one_left)
    rs.check_transition(pipeline, rs.NEEDS_INPUT, "publish", waiting, {**waiting, "questions": []})
    rs.check_transition(pipeline, rs.NEEDS_INPUT, rs.FAILED, waiting, one_left)


def test_asking_through_the_pipeline_records_the_stage_after_the_asking_one() -> None:
    asked = {"asked_by": "summarize", "questions": [{"interaction_id": "a"}]}
    rs.check_transition(SMALL, "summarize", rs.NEEDS_INPUT, {}, {**asked, "resume_at": "publish"})
    for wrong in ("fetch", "summarize", rs.COMPLETED, None):
        with pytest.raises(InvalidTransitionError):
            rs.check_transition(SMALL, "summarize", rs.NEEDS_INPUT, {},
                                {**asked, "resume_at": wrong})


def test_a_pipeline_is_a_list_of_names_not_one_string() -> None:
    with pytest.raises(ConfigError):
        Pipeline("fetch")
    with pytest.raises(ConfigError):
        Pipeline(["fetch", "publish"], asking="fetch")


def test_snapshot_shows_public_fields_only() -> None:
    record = {
        "request": {"secret": "cv text"}, "checkpoint": {"x": 1}, "receipts": {"k": {}},
        "answers": {"q": "a"}, "stage": "summarize", "revision": 4, "resume_at": "publish",
        "questions": [{"interaction_id": "q2", "prompt": "?", "stage": "summarize"}],
        "result": {"doc": 1}, "error": "boom",
    }
    snap = snapshot("r1", rs.NEEDS_INPUT, record, 1_000, 2_000).model_dump(mode="json")
    assert set(snap) == {"id", "status", "stage", "created_at", "updated_at", "questions",
                         "result", "error"}
    assert snap["result"] is None and snap["error"] is None  # only when completed / failed
    assert "cv text" not in str(snap) and snap["questions"][0]["interaction_id"] == "q2"
    assert snapshot("r1", rs.COMPLETED, record, 1, 2).result == {"doc": 1}
    assert snapshot("r1", rs.FAILED, record, 1, 2).error == "boom"
