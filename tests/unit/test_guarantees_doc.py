"""docs/guarantees.md names the tests that back each guarantee (`tests/…/test_x.py::test_y`, and
`::test_z` for another test of the same file): each named file and test must exist, so a renamed
or deleted test cannot leave a guarantee backed by nothing. The reference doc carries no commit
hashes: the history of runs is in CHANGELOG.md."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import ROOT

DOC = ROOT / "docs" / "guarantees.md"


def test_every_test_the_guarantees_name_exists() -> None:
    text = DOC.read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)?(?:::(test_\w+))?`", text)
    assert sum(1 for file, test in named if test) >= 40  # the backing is there
    missing = []
    current: Path | None = None
    for file, test in named:
        if file:
            current = ROOT / file
            if not current.exists():
                missing.append(file)
                current = None
                continue
        if test and current is not None and not re.search(
            rf"def {test}\(", current.read_text()
        ):
            missing.append(f"{current.relative_to(ROOT)}::{test}")
    assert missing == []


def test_each_guarantee_section_names_its_tests() -> None:
    sections = re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]
    guarantees = [s for s in sections if not s.startswith(("Fault points", "The torture", "Soak",
                                                            "Figures", "Open"))]
    assert len(guarantees) >= 9
    for section in guarantees:
        assert "Tested by:" in section, section.splitlines()[0]


def test_the_reference_doc_carries_no_commit_hashes() -> None:
    text = DOC.read_text()
    assert re.findall(r"\bcommit [0-9a-f]{7,40}\b", text) == []
    assert [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if not h.isdigit()] == []
