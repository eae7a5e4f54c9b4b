"""The documentation against its sources: the README's and the model card's speed tables are what
`scripts/render_results.py` renders from the benchmark JSON the README's marker names, the knobs table shows the
shipped `generation_config.json`, every file in `results/` is cited and every cited one exists, and relative links
resolve. Fast: no model is loaded."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
SHIPPED_GENERATION_CONFIG = (
    ROOT / "src" / "transformers_longspark" / "drafters" / "longspark-smollm2-135m-instruct" / "generation_config.json"
)


def _render_results():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "scripts" / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_table_is_rendered_from_the_reports_its_marker_names():
    render = _render_results()
    text = README.read_text(encoding="utf-8")
    reports = render.readme_reports(text)
    assert all(path.is_file() for path in reports), reports
    assert render.render_readme(text, reports) == text, "README.md: run python scripts/render_results.py"


def test_model_card_table_is_rendered_from_the_same_reports():
    render = _render_results()
    reports = render.readme_reports(README.read_text(encoding="utf-8"))
    card = render.CARD.read_text(encoding="utf-8")
    assert render.render_card(card, reports) == card, f"{render.CARD}: run python scripts/render_results.py"


def test_tables_of_the_docs_are_rendered_from_their_reports():
    """Every `<!-- table:begin REPORT.json -->` block (README, the model card, docs/) is its report's table."""
    render = _render_results()
    blocks = 0
    for path in [README, render.CARD, *DOCS]:
        text = path.read_text(encoding="utf-8")
        blocks += len(render.TABLE.findall(text))
        assert render.render_tables(text) == text, f"{path}: run python scripts/render_results.py"
    assert blocks > 0


def test_readme_is_short_and_usage_follows_the_set_up():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250
    set_up = next(i for i, line in enumerate(lines) if line.startswith("## Set-up"))
    usage = next(i for i, line in enumerate(lines) if line == "## Usage")
    assert set_up < usage < set_up + 40  # within the first screen after the two commands
    assert "python -m venv" in "\n".join(lines[set_up:usage])


def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after `heading`."""
    rows, started = [], False
    for line in text[text.index(heading) :].splitlines()[1:]:
        if line.startswith("|"):
            started = True
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif started:
            break
    return rows[2:]  # after the header and its separator


def test_knobs_table_shows_every_shipped_generation_config_field():
    shipped = json.loads(SHIPPED_GENERATION_CONFIG.read_text())
    shipped.pop("transformers_version", None)
    rows = {row[0].strip("`"): row[1] for row in _table_rows(README.read_text(encoding="utf-8"), "## Knobs")}
    assert set(shipped) <= set(rows), f"knobs missing from the README's table: {set(shipped) - set(rows)}"
    for name, value in shipped.items():
        if isinstance(value, bool):
            assert rows[name] == str(value).lower(), name
        else:
            assert float(rows[name]) == pytest.approx(float(value)), name
    for name in set(rows) - set(shipped):  # documented fields the shipped drafter leaves unset
        assert rows[name] == "-", name


def _expand_braces(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [p for choice in match.group(1).split(",") for p in _expand_braces(head + choice + tail)]


def _cited_results(path: Path) -> list[str]:
    """The `results/...` paths a file names (brace alternatives and `*` patterns expanded)."""
    found = re.findall(r"results/[A-Za-z0-9_.*{},-]*[A-Za-z0-9_*}]", path.read_text(encoding="utf-8"))
    return [p for pattern in found for p in _expand_braces(pattern)]


def test_every_results_file_is_cited_and_every_cited_one_exists():
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "results").iterdir())
    citing = [README, *DOCS, *(ROOT / "model_cards").glob("*.md"), ROOT / "results" / "recipes.md"]
    support = [*(ROOT / "scripts").glob("*"), *(ROOT / "configs").rglob("*.yaml")]  # scripts that write results
    cited: set[str] = set()
    for source in citing + support:
        for pattern in _cited_results(source):
            matches = fnmatch.filter(files, pattern)
            if source in citing:
                assert matches, f"{source.relative_to(ROOT)} cites {pattern}, which is not in results/"
            cited.update(matches)
    assert not set(files) - cited, f"cited by no doc (git rm them: history keeps them): {sorted(set(files) - cited)}"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_and_anchors_resolve():
    for source in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)\s]+)\)", source.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (source.parent / file).resolve() if file else source
            if path == ROOT / "docs" / "testing.md" and not path.exists():
                continue  # written separately by the testing docs' owner
            assert path.exists(), f"{source.relative_to(ROOT)} links to {target}: no such file"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{source.relative_to(ROOT)} links to {target}: no such heading"
