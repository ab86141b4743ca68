"""README.md and docs/: every figure is rendered from a committed results file (a fresh rendering must equal the
text), no number is typed by hand outside rendered pieces and code, every link resolves, nothing refers to files
outside the repository, and the README stays short enough for a first read."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _renderer():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_rendered_piece_matches_its_results_file():
    stale = _renderer().process(write=False)
    assert not stale, f"re-render with `python benchmarks/readme_tables.py --write`: {stale}"


def _prose(text: str) -> str:
    """The text with rendered pieces, code blocks, inline code and link targets removed."""
    text = re.sub(r"<!-- render: .*?<!-- end render -->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


# A measured figure: a decimal, a percentage, a speedup, a time. Version requirements (">= 3.10") are not figures.
FIGURE = re.compile(r"(?<![>=\w.])(\d+\.\d+|\d+(\.\d+)?\s?(%|x\b|ms\b|us\b|µs\b|GB/s|TFLOP))")


def test_no_figure_is_typed_by_hand():
    typed = {doc.name: FIGURE.findall(_prose(doc.read_text())) for doc in DOCS}
    typed = {name: [m[0] for m in found] for name, found in typed.items() if found}
    assert not typed, f"figures outside rendered pieces (render them from a results file): {typed}"


def test_links_resolve_and_nothing_points_outside_the_repository():
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"
        assert not re.search(r"\b(DESIGN|BENCHMARK|STYLE)\.md|\.\./shared", text), doc.name
        assert not re.search(r"\bissue \d+", text, re.I), doc.name


def test_readme_is_a_first_screen():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024
    for heading in ("## Requirements", "## Install", "## Try it", "## Use", "## Results", "## Tests"):
        assert heading in text
