"""``tools/mutate.py``'s command line: a misspelt or empty ``--only`` is a usage error naming it (it ran nothing,
exited 0 and wrote an empty results file over the committed one), and a subset needs its own ``--out``."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv,said", [(["--only", "p2p-eager-waits-spin", "p2p-eager-wait-spin"],
                                        "unknown mutation(s) ['p2p-eager-wait-spin']"),
                                       (["--only"], "--only names no mutation"),
                                       (["--only", "p2p-eager-waits-spin"], "give --out")])
def test_a_subset_that_names_nothing_or_no_file_of_its_own_is_refused(argv, said, tmp_path):
    committed = ROOT / "benchmarks" / "results" / "mutations.json"
    before = committed.read_bytes()
    result = subprocess.run([sys.executable, "tools/mutate.py", *argv], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and said in result.stderr, result.stderr
    assert committed.read_bytes() == before


def _mutate(monkeypatch, tmp_path):
    """``tools/mutate.py`` in this process, its repository a scratch folder holding a "committed" results file and
    each mutation's run a stand-in (no test suite runs)."""
    spec = importlib.util.spec_from_file_location("mutate_under_test", ROOT / "tools" / "mutate.py")
    mutate = importlib.util.module_from_spec(spec)  # not in sys.modules: nothing outlives the test
    spec.loader.exec_module(mutate)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    committed = tmp_path / "benchmarks" / "results" / "mutations.json"
    committed.write_text("the whole list's run\n")
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    monkeypatch.setattr(mutate, "run", lambda name, *rest: {"name": name, "caught": True, "pytest": "stand-in"})
    return mutate, committed


@pytest.mark.parametrize("out", ["benchmarks/results/mutations.json", "benchmarks/../benchmarks/results/mutations.json",
                                 "ABSOLUTE"])
def test_a_subset_is_refused_the_committed_file_however_it_is_named(out, monkeypatch, tmp_path, capsys):
    """``--only X --out benchmarks/results/mutations.json`` replaced the committed 212-row file with one row."""
    mutate, committed = _mutate(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)
    out = str(committed) if out == "ABSOLUTE" else out
    with pytest.raises(SystemExit) as exit_info:
        mutate.main(["--only", mutate.MUTATIONS[0][0], "--out", out])
    assert exit_info.value.code == 2 and "give --out another file" in capsys.readouterr().err
    assert committed.read_text() == "the whole list's run\n"


def test_the_results_file_records_the_exact_command_line(monkeypatch, tmp_path):
    """``meta.command`` left ``--out`` out: the recorded command did not say where its rows went."""
    mutate, committed = _mutate(monkeypatch, tmp_path)
    out = tmp_path / "subset file.json"
    assert mutate.main(["--only", mutate.MUTATIONS[0][0], "--out", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["command"] == f"python tools/mutate.py --only {mutate.MUTATIONS[0][0]} --out '{out}'"
    assert committed.read_text() == "the whole list's run\n"


def test_the_docstring_and_the_documented_commands_test_agree_on_the_run_time():
    """The docstring said "a few minutes on 2 cores", the documented-commands test "(hours)": the whole list takes
    about 30 minutes on 2 cores."""
    from tests.test_documented_commands import HELP_ONLY

    docstring = (ROOT / "tools" / "mutate.py").read_text().split('"""')[1]
    assert "about 30 minutes on 2 cores" in " ".join(docstring.split())
    assert "about 30 minutes on 2 cores" in HELP_ONLY["tools/mutate.py"]


@pytest.mark.parametrize("where,said", [("folder", "is a folder; name the results file"),
                                        ("missing/rows.json", "is not a writable folder or file")])
def test_an_out_it_could_not_write_is_refused_before_any_mutation_runs(where, said, monkeypatch, tmp_path, capsys):
    """``--out`` naming a folder, or a file in a missing folder, failed in the write after every mutation had run
    (half an hour for the whole list), the rows lost."""
    mutate, _ = _mutate(monkeypatch, tmp_path)
    ran = []
    monkeypatch.setattr(mutate, "run", lambda name, *rest: ran.append(name) or {"name": name, "caught": True})
    (tmp_path / "folder").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        mutate.main(["--only", mutate.MUTATIONS[0][0], "--out", str(tmp_path / where)])
    assert exit_info.value.code == 2 and said in capsys.readouterr().err and ran == []


def test_every_mutation_finds_its_text_once_in_its_file():
    # A rewrite that drops a mutation's text leaves it unrunnable (the whole list's run records it as not applied):
    # caught here, in the suite, instead of at the next run of the list.
    spec = importlib.util.spec_from_file_location("mutate_anchors", ROOT / "tools" / "mutate.py")
    mutate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutate)
    stale = {name: (ROOT / path).read_text().count(old) for name, _, path, old, *_ in mutate.MUTATIONS
             if (ROOT / path).read_text().count(old) != 1}
    assert not stale, f"mutations whose text is not in their file exactly once (name: times found): {stale}"
