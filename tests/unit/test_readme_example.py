"""The README's code is examples/orders.py, verbatim (the example file is what its tests run)."""

from __future__ import annotations

from tests.helpers import ROOT


def test_the_readme_shows_the_example_file_whole() -> None:
    readme = (ROOT / "README.md").read_text()
    marker = "This is `examples/orders.py`"
    start = readme.index("```python\n", readme.index(marker)) + len("```python\n")
    shown = readme[start:readme.index("```\n", start)]
    assert shown == (ROOT / "examples" / "orders.py").read_text()


def test_the_readme_stays_short_and_its_doc_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 25_000  # quickstart to layout; the rest is in docs/
    for name in ("guarantees", "performance", "runs", "configuration", "data", "wire-format",
                 "operations", "security"):
        assert f"(docs/{name}.md" in readme and (ROOT / "docs" / f"{name}.md").exists()
