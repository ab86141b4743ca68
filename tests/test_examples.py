"""The snippets cannot rot: every Python code block of README.md, docs/usage.md and docs/migration.md is an excerpt
(verbatim, up to its leading indentation) of a script under ``examples/``, named in the paragraph that leads into it
(a block alone fails with NameError: the reader must know where the rest is), and every such script runs here on
two gloo ranks and checks itself against plain PyTorch (it raises on a mismatch and prints what it checked), with
no traceback on its output; started without torchrun, each says so in one line.

The ranks run each script's ``main()`` through ``flashoverlap.testing.spawn`` (forked from a server that imported
torch once: a fresh ``torchrun`` per script would cost seconds of interpreter start each); the README's example also
runs end to end as the README says, under ``torchrun`` (``python -m torch.distributed.run``)."""

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashoverlap.testing import spawn

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DOCS = [ROOT / "README.md", ROOT / "docs" / "usage.md", ROOT / "docs" / "migration.md"]
# Scripts the CPU suite does not run, and why.
NOT_RUN = {"hf_llama_tp.py": "a benchmark on GPUs (NCCL, CUDA timing, an 8B-shaped model)"}
RUN = sorted(p.name for p in EXAMPLES.glob("*.py") if p.name not in NOT_RUN)
# Scripts that need a package outside the test extra (CI installs it: the hf extra).
NEEDS = {"hf_tp_plan.py": "transformers"}


def python_blocks(text: str) -> list[tuple[int, str]]:
    """Each ```python block of a Markdown text: (its first line's number, its code)."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1))
            for m in re.finditer(r"^[ \t]*```python[ \t]*\n(.*?)^[ \t]*```", text, re.S | re.M)]


def _normalised(lines: list[str]) -> list[str]:
    """The lines without their common leading indentation, trailing blanks removed from each."""
    return textwrap.dedent("\n".join(line.rstrip() for line in lines)).split("\n")


def excerpts_of(block: str, scripts: dict[str, str]) -> list[str]:
    """The names of the scripts of which ``block`` is a contiguous run of lines (each side's common indentation
    removed)."""
    want = _normalised(block.strip("\n").split("\n"))
    found = []
    for name, text in scripts.items():
        lines = text.split("\n")
        if any(_normalised(lines[start : start + len(want)]) == want for start in range(len(lines) - len(want) + 1)):
            found.append(name)
    return found


def _scripts() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(EXAMPLES.glob("*.py"))}


def test_every_python_block_of_the_docs_is_an_excerpt_of_an_example():
    scripts, strays, shown = _scripts(), [], set()
    for doc in DOCS:
        for line, block in python_blocks(doc.read_text()):
            found = excerpts_of(block, scripts)
            shown.update(found)
            if not found:
                strays.append(f"{doc.relative_to(ROOT)}:{line}: {block.strip().splitlines()[0]!r}")
    assert not strays, "Python blocks that are no excerpt of a script under examples/ (copy them from one, or " \
                       "write the script): " + "; ".join(strays)
    assert not set(RUN) - shown, f"examples no doc shows an excerpt of: {sorted(set(RUN) - shown)}"


def _lead_in(text: str, start: int) -> str:
    """The paragraph just before offset ``start`` of a Markdown text (a block's lead-in)."""
    return text[:start].rstrip("\n").split("\n\n")[-1]


def test_every_python_block_says_which_example_it_comes_from():
    scripts, unmarked = _scripts(), []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^[ \t]*```python[ \t]*\n(.*?)^[ \t]*```", text, re.S | re.M):
            found = excerpts_of(m.group(1), scripts)
            if not any(f"examples/{name}" in _lead_in(text, m.start()) for name in found):
                line = text.count("\n", 0, m.start()) + 1
                unmarked.append(f"{doc.relative_to(ROOT)}:{line} (from {found})")
    assert not unmarked, "Python blocks whose lead-in paragraph does not name the examples/ script they come " \
                         "from: " + "; ".join(unmarked)


def test_an_edited_or_stitched_block_is_not_an_excerpt():
    scripts = {"x.py": "def main():\n    a = 1\n    b = 2\n\n    c = 3\n", "y.py": "b = 2\n"}
    assert excerpts_of("a = 1\nb = 2\n", scripts) == ["x.py"]  # indentation aside
    assert excerpts_of("b = 2\n\nc = 3", scripts) == ["x.py"]
    assert excerpts_of("b = 2", scripts) == ["x.py", "y.py"]
    assert excerpts_of("a = 1\nb = 3\n", scripts) == []  # a value changed
    assert excerpts_of("a = 1\nc = 3\n", scripts) == []  # lines that are not contiguous
    assert excerpts_of("a = 1\n  b = 2\n", scripts) == []  # the indentation within the block changed
    blocks = python_blocks("text\n```python\nx = 1\n```\n\n```bash\nls\n```\n  ```python\n  y = 2\n  ```\n")
    assert blocks == [(3, "x = 1\n"), (10, "  y = 2\n")]


def test_every_example_is_run_or_says_why_not():
    assert set(NOT_RUN) <= {p.name for p in EXAMPLES.glob("*.py")}
    assert RUN, "no example to run"


def _run_examples(rank: int, world_size: int, names: list[str]) -> None:
    """Each example's ``main()`` in turn, on ranks that already form a group (the examples join it as they find
    it); an example's failure names it."""
    for name in names:
        if rank == 0:
            print(f"== examples/{name}", flush=True)
        spec = importlib.util.spec_from_file_location(f"example_{Path(name).stem}", EXAMPLES / name)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            module.main()
        except Exception as exc:
            raise RuntimeError(f"examples/{name} failed on rank {rank}: {exc}") from exc


def test_every_example_runs_on_two_gloo_ranks_and_checks_itself(capsys):
    # One pair of ranks runs them all: each fresh pair would import torch._dynamo (every autograd call of a custom
    # op does) and transformers again, seconds each on a CPU machine.
    missing = [name for name in RUN if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None]
    names = [name for name in RUN if name not in missing]
    spawn(_run_examples, 2, "gloo", args=(names,))
    out, err = capsys.readouterr()
    assert "MISMATCH" not in out, out
    assert "Traceback" not in err, f"an example that succeeded printed a traceback:\n{err[-4000:]}"
    parts = re.split(r"^== examples/(\S+)\n", out, flags=re.M)
    printed = dict(zip(parts[1::2], parts[2::2]))  # rank 0 prints each marker, then that example's checks
    quiet = [name for name in names if not re.search(r", OK$", printed.get(name, ""), re.M)]
    assert not quiet, f"examples that printed no check: {quiet}\n{out}"
    if missing:
        pytest.skip(f"ran {names}; not {missing}, which need {sorted({NEEDS[name] for name in missing})}")


def test_the_readme_example_runs_under_torchrun():
    # --standalone: a free port for the rendezvous. Several runs may share the machine, so a port taken between
    # torchrun's choice and its use is tried once more (that failure names itself; any other fails the test).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(EXAMPLES / "ops.py")], capture_output=True, text=True, timeout=300, env=env)
        if proc.returncode == 0 or not re.search(r"EADDRINUSE|[Aa]ddress already in use", proc.stderr):
            break
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"^path: reference \(CPU tensors", proc.stdout, re.M), proc.stdout  # the path it ran
    for op in ("gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm"):
        assert re.search(rf"^{op}: max abs diff vs plain PyTorch \S+, OK$", proc.stdout, re.M), proc.stdout
    readme = (ROOT / "README.md").read_text()
    whole = [block for _, block in python_blocks(readme) if "def main()" in block]
    assert whole and excerpts_of(whole[0], {"ops.py": (EXAMPLES / "ops.py").read_text()}) == ["ops.py"]
    assert "torchrun --nproc-per-node 2 examples/ops.py" in readme


# Scripts written beside this test that do not yet stop in one line where torchrun or a GPU is missing: their
# authors add the two-line `__main__` guard the others have, and remove them here.
UNGUARDED: set[str] = set()


def test_every_example_started_without_torchrun_says_so_in_one_line(monkeypatch):
    # In this process (runpy, as `python examples/x.py` runs it): each stops at its `__main__` guard (hf_llama_tp.py
    # at its check for GPUs, which comes first) before it touches torch.distributed.
    import runpy

    import torch

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in sorted(p.name for p in EXAMPLES.glob("*.py")):
        if name in UNGUARDED:
            continue
        monkeypatch.setattr(sys, "argv", [f"examples/{name}"])
        with pytest.raises(SystemExit) as stop:
            runpy.run_path(str(EXAMPLES / name), run_name="__main__")
        message = stop.value.code
        assert isinstance(message, str) and "\n" not in message, (name, message)  # printed, exit status 1
        assert re.search(r"torchrun|CUDA GPU|needs transformers", message), (name, message)
