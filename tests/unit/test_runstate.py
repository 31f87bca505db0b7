"""The run state machine: the transition table, the forward-only rank, the public snapshot."""

from __future__ import annotations

import itertools

import pytest

from outbox_relay.shared import runstate as rs
from outbox_relay.shared.errors import InvalidTransitionError

HAPPY_PATH = [rs.QUEUED, *rs.STAGES, rs.COMPLETED]


def test_every_status_has_exactly_one_row_in_the_table() -> None:
    assert set(rs.TRANSITIONS) == rs.STATUSES
    assert all(targets <= rs.STATUSES for targets in rs.TRANSITIONS.values())
    assert rs.TRANSITIONS[rs.COMPLETED] == rs.TRANSITIONS[rs.FAILED] == frozenset()


def test_the_happy_path_is_allowed_step_by_step() -> None:
    for current, new in itertools.pairwise(HAPPY_PATH):
        rs.check_transition(current, new)


def test_failed_is_reachable_from_every_active_status() -> None:
    for status in rs.STATUSES - rs.TERMINAL:
        asked_by = rs.NORMALIZING_CANDIDATE if status == rs.NEEDS_INPUT else None
        rs.check_transition(status, rs.FAILED, asked_by=asked_by)


@pytest.mark.parametrize("current, new", [
    (rs.DRAFTING, rs.ANALYZING_JD),
    (rs.RENDERING, rs.QUEUED),
    (rs.COMPLETED, rs.RENDERING),
    (rs.FAILED, rs.QUEUED),
    (rs.COMPLETED, rs.COMPLETED),
    (rs.QUEUED, rs.DRAFTING),
    (rs.DRAFTING, rs.NEEDS_INPUT),
    (rs.QUEUED, "paused"),
])
def test_backward_skipping_terminal_and_unknown_moves_are_refused(current: str, new: str) -> None:
    with pytest.raises(InvalidTransitionError) as info:
        rs.check_transition(current, new, new_asked_by=current)
    assert info.value.code == "invalid_transition"


def test_needs_input_names_the_asking_stage_and_resumes_right_after_it() -> None:
    rs.check_transition(rs.ANALYZING_JD, rs.NEEDS_INPUT, new_asked_by=rs.ANALYZING_JD)
    with pytest.raises(InvalidTransitionError):
        rs.check_transition(rs.ANALYZING_JD, rs.NEEDS_INPUT, new_asked_by=None)
    rs.check_transition(rs.NEEDS_INPUT, rs.MATCHING_EVIDENCE, asked_by=rs.ANALYZING_JD)
    for wrong in (rs.ANALYZING_JD, rs.DRAFTING):
        with pytest.raises(InvalidTransitionError):
            rs.check_transition(rs.NEEDS_INPUT, wrong, asked_by=rs.ANALYZING_JD)


def test_rank_grows_along_the_path_and_needs_input_sits_after_its_stage() -> None:
    ranks = [rs.position(s) for s in HAPPY_PATH]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    for stage in rs.ASKING_STAGES:
        waiting = rs.position(rs.NEEDS_INPUT, stage)
        assert rs.position(stage) < waiting < rs.position(rs.next_stage(stage))


def test_snapshot_shows_public_fields_only() -> None:
    record = {
        "request": {"secret": "cv text"}, "checkpoint": {"x": 1}, "receipts": {"k": {}},
        "answers": {"q": "a"}, "stage": rs.NORMALIZING_CANDIDATE, "revision": 4,
        "questions": [{"interaction_id": "q2", "prompt": "?", "stage": rs.NORMALIZING_CANDIDATE}],
        "result": {"doc": 1}, "error": "boom",
    }
    snap = rs.snapshot("r1", rs.NEEDS_INPUT, record, 1_000, 2_000).model_dump(mode="json")
    assert set(snap) == {"id", "status", "stage", "created_at", "updated_at", "questions",
                         "result", "error"}
    assert snap["result"] is None and snap["error"] is None  # only when completed / failed
    assert "cv text" not in str(snap) and snap["questions"][0]["interaction_id"] == "q2"
    assert rs.snapshot("r1", rs.COMPLETED, record, 1, 2).result == {"doc": 1}
    assert rs.snapshot("r1", rs.FAILED, record, 1, 2).error == "boom"
