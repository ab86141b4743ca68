"""``benchmarks/readme_tables.py``'s command line: ``--help`` exited 1, a misspelt document was a
FileNotFoundError traceback, and a file without render markers was "checked" and exited 0 having checked nothing."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables_cli", ROOT / "benchmarks" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_usage_and_exits_0(flag, readme_tables, capsys):
    assert readme_tables.main([flag]) == 0
    assert "--write|--check [DOC ...]" in capsys.readouterr().out


@pytest.mark.parametrize("argv,said", [
    (["--check", "docs/nonexist.md"], "--check docs/nonexist.md: no such file"),
    (["--write", "docs"], "--write docs: no such file"),
    (["--check", "src/flashoverlap/__init__.py"], "src/flashoverlap/__init__.py: holds no rendered piece"),
    (["--write", "README.md", "pyproject.toml"], "pyproject.toml: holds no rendered piece"),  # before any write
    ([], "usage:"), (["--chek"], "usage:")])
def test_a_document_that_is_missing_or_renders_nothing_is_a_usage_error(argv, said, readme_tables, capsys,
                                                                        monkeypatch):
    monkeypatch.setattr(readme_tables, "process", lambda **kw: pytest.fail(f"processed {kw}"))
    assert readme_tables.main(argv) == 2
    assert said in capsys.readouterr().err
