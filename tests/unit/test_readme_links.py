"""Every relative link of the README reaches a committed file (its figures link to their results files)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def broken_links(text: str) -> list[str]:
    """The relative link targets of Markdown ``text`` (anchors and URLs left out) that are not files."""
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t for t in targets if not t.startswith(("http://", "https://", "#", "mailto:"))]
    return [t for t in local if not (ROOT / t.split("#")[0]).is_file()]


def test_the_readme_links_reach_files() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(re.findall(r"\]\(benchmarks/results/", text)) >= 9  # the figures table links its results
    assert not broken_links(text)


def test_a_broken_link_is_caught() -> None:
    # Negative control: a results file that does not exist, beside one that does.
    text = "[a](benchmarks/results/no-such-result.md) [b](benchmarks/README.md) [c](https://x) [d](#measured)"
    assert broken_links(text) == ["benchmarks/results/no-such-result.md"]
