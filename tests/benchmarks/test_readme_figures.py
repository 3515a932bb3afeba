"""benchmarks/README.md quotes only figures its committed files hold, names only scripts that exist, and
the folder stays lean (issue 44): at most 25 scripts, a README of at most 300 lines."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCHMARKS / "results"
README = BENCHMARKS / "README.md"

# A results file as the README names it: a dated name, optionally under results/ (traces/ for a trace),
# or a GPU check's results/gpu/<date>/README.md;
# "...-<tail>" abbreviates a name whose prefix the same line spells out.
FILE = re.compile(
    r"(?:results/)?(?:gpu/\d{4}-\d\d-\d\d/README\.md|(?:traces/)?[\w.-]*\d{4}-\d\d-\d\d[\w.-]*\.(?:md|json))"
)
ABBREVIATED = re.compile(r"\.\.\.(-[\w.-]+\.md)")
# A figure: a number with a decimal point or a percent sign, or one of 3+ digits (counts like "5 of 5"
# and sizes like "8 ranks" are the setup, not figures; nor are names like "SmolLM2-135M"; "1.29x" is).
FIGURE = re.compile(r"(?<![\w.,])[+-]?(\d{1,3}(?:,\d{3})+|\d+\.\d+|\d+(?=%)|\d{3,})(?![A-Za-wyz\d])")


def scripts() -> list[Path]:
    """The runnable scripts: ``benchmarks/**/*.py`` but ``_lib/`` and ``__init__.py``."""
    return sorted(
        p
        for p in BENCHMARKS.rglob("*.py")
        if "_lib" not in p.relative_to(BENCHMARKS).parts and p.name != "__init__.py"
    )


def resolve(name: str) -> list[Path]:
    """The committed files a README reference names (several for an abbreviated one)."""
    name = name.removeprefix("results/")
    if name.startswith("-"):  # the tail of an abbreviated name
        return sorted(p for p in RESULTS.rglob("*.md") if p.name.endswith(name))
    return [RESULTS / name] if (RESULTS / name).is_file() else []


def sections(text: str) -> list[tuple[str, str]]:
    """(title, body) of every ``## `` section."""
    parts = re.split(r"^## ", text, flags=re.M)
    return [(p.split("\n", 1)[0], p) for p in parts[1:]]


def figures(body: str) -> set[str]:
    """The figures quoted in a section's prose and tables (commands, file names and flags left out)."""
    prose = re.sub(r"`[^`]*`", " ", body)  # code spans: commands, placements, paths
    prose = FILE.sub(" ", prose)
    return {m.group(1).replace(",", "") for m in FIGURE.finditer(prose)}


def unfound(body: str) -> tuple[list[str], list[str]]:
    """A section's references that name no committed file, and its figures none of its files holds."""
    names = [m.group(0) for m in FILE.finditer(body)] + [m.group(1) for m in ABBREVIATED.finditer(body)]
    missing = [n for n in names if not resolve(n)]
    files = {p for n in names for p in resolve(n)}
    text = " ".join(p.read_text().replace(",", "") for p in files)
    return missing, sorted(f for f in figures(body) if f not in text)


def test_the_folder_keeps_at_most_25_scripts_and_a_readme_of_at_most_300_lines() -> None:
    found = scripts()
    assert 0 < len(found) <= 25, [str(p.relative_to(BENCHMARKS)) for p in found]
    assert len(README.read_text().splitlines()) <= 300


def test_every_script_the_readme_runs_exists() -> None:
    named = set(re.findall(r"python -m (benchmarks(?:\.\w+)+)", README.read_text()))
    assert named, "the README names no script"
    missing = [m for m in sorted(named) if importlib.util.find_spec(m) is None]
    assert not missing, f"the README runs scripts that do not exist: {missing}"


@pytest.mark.parametrize("title", [t for t, _ in sections(README.read_text())])
def test_every_figure_a_section_quotes_is_in_a_committed_file_it_names(title: str) -> None:
    body = dict(sections(README.read_text()))[title]
    missing, figures_not_found = unfound(body)
    assert not missing, f"{title!r} names results files that are not committed: {missing}"
    assert not figures_not_found, f"{title!r} quotes figures none of its files holds: {figures_not_found}"


def test_the_check_finds_a_figure_no_file_holds_and_a_file_not_committed() -> None:
    # Negative controls: the same check on sections that quote what their file does not hold.
    held = "Per `results/machine_noise-2026-11-28.md`: segments span 28% of the median, processes 20%."
    assert unfound(held) == ([], [])
    file_text = (RESULTS / "machine_noise-2026-11-28.md").read_text()
    assert "61" not in file_text and "27.5" not in file_text  # so the two below are figures it lacks
    assert unfound(held.replace("28%", "61%")) == ([], ["61"])
    assert unfound(held + " Ring: 27.5 ms, 1.29x.") == ([], ["1.29", "27.5"])
    assert unfound("See results/e2e-2026-11-99.md: 1.50x.") == (["results/e2e-2026-11-99.md"], ["1.50"])
