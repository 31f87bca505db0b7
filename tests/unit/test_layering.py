"""The layering rules, read from the import statements of every module.

``shared`` imports nothing of ours; ``producer`` only ``shared``; ``relay`` and ``consumer``
never import each other; ``runs`` (durable runs, used by some applications) builds on
``producer`` and ``consumer`` and nothing below it knows it; only ``cli`` wires everything
together. The test kit (``testing``) is a second wiring module, narrower: it drives the relay
and a consumer for a user's tests, so it may import ``shared``, ``producer``, ``relay`` and
``consumer`` (not ``runs``, not ``cli``). Nothing in the package imports either of the two
wiring modules. The operator console (``console``) reads both the relay's and the consumers'
state, so it may import ``relay`` and ``consumer`` (and ``runs``, for the API's callers); only
``cli`` imports it. And every import of our code
goes through ``outbox_relay``: a module imported once as ``shared.x`` and once as
``outbox_relay.shared.x`` would exist twice (two caches, two error classes).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGE = ROOT / "src" / "outbox_relay"
COMPONENTS = ("shared", "producer", "relay", "consumer", "runs", "console", "cli")
ALLOWED = {
    "shared": set(),
    "producer": {"shared"},
    "relay": {"shared"},
    "consumer": {"shared"},
    "runs": {"shared", "producer", "consumer"},  # its events; its worker is a Handlers
    # The operator console shows the relay's backlog and the consumers' dead letters, so it
    # sits above both (as a wiring unit would) and uses runs only for the API's callers and
    # error shape; unlike the wiring units it is imported, by cli alone (which mounts it on
    # `outbox serve`), and nothing else may import it since no other rule lists it.
    "console": {"shared", "relay", "consumer", "runs"},
    "cli": set(COMPONENTS),
}
# Wiring modules besides the CLI, with what each may import; nothing imports them.
WIRING = {"testing": {"shared", "producer", "relay", "consumer"}}
UNITS = COMPONENTS + tuple(WIRING)


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


@pytest.mark.parametrize("component", UNITS)
def test_components_import_only_what_the_layering_allows(component: str) -> None:
    allowed = ALLOWED[component] if component in ALLOWED else WIRING[component]
    wrong = set()
    for path in (PACKAGE / component).rglob("*.py"):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "outbox_relay" and len(parts) > 1 and parts[1] in UNITS:
                if parts[1] != component and parts[1] not in allowed:
                    wrong.add(f"{path.relative_to(ROOT)} imports {name}")
            elif parts[0] == "outbox_relay" and len(parts) == 1 and component != "cli":
                wrong.add(f"{path.relative_to(ROOT)} imports the facade")
    assert not wrong, sorted(wrong)


def test_nothing_in_the_package_imports_a_wiring_module() -> None:
    wiring = {"cli", *WIRING}
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "__main__.py":  # `python -m outbox_relay`: the CLI's own entry
            continue
        unit = path.relative_to(PACKAGE).parts[0]
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "outbox_relay" and len(parts) > 1 and parts[1] in wiring - {unit}:
                found.add(f"{path.relative_to(ROOT)} imports {name}")
    assert not found, sorted(found)


def test_nothing_imports_our_code_by_its_folder_name() -> None:
    bare = set()
    folders = [PACKAGE / c for c in UNITS] + [ROOT / f for f in
                                                   ("tests", "torture", "bench", "examples")]
    for folder in folders:
        for path in folder.rglob("*.py"):
            bare |= {f"{path.relative_to(ROOT)}: {n}" for n in _imports(path)
                     if n.split(".")[0] in UNITS}
    assert not bare, sorted(bare)


def test_the_tree_has_no_symlinks_and_the_image_copies_the_package() -> None:
    """The src layout holds real folders (a clone with ``core.symlinks=false`` turned links into
    9-byte text files), every component is a package, and the image copies the one ``src``."""
    links = [p for p in ROOT.rglob("*") if p.is_symlink()
             and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    assert links == []
    assert {c for c in UNITS if not (PACKAGE / c / "__init__.py").is_file()} == set()
    assert "COPY src ./src" in (ROOT / "Dockerfile").read_text()
