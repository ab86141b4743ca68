"""The snippets cannot rot: every Python code block of README.md, docs/usage.md and docs/migration.md is an excerpt
(verbatim, up to its leading indentation) of a script under ``examples/``, and every such script runs here on two
gloo ranks and checks itself against plain PyTorch (it raises on a mismatch and prints what it checked).

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


def python_blocks(text: str) -> list[tuple[int, str]]:
    """Each ```python block of a Markdown text: (its first line's number, its code)."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1))
            for m in re.finditer(r"^[ \t]*```python[ \t]*\n(.*?)^[ \t]*```", text, re.S | re.M)]


def _normalised(lines: list[str]) -> list[str]:
    """The lines without their common leading indentation, trailing blanks removed from each."""
    return textwrap.dedent("\n".join(line.rstrip() for line in lines)).split("\n")


def excerpt_of(block: str, scripts: dict[str, str]) -> str | None:
    """The name of a script of which ``block`` is a contiguous run of lines (each side's common indentation
    removed), or None."""
    want = _normalised(block.strip("\n").split("\n"))
    for name, text in scripts.items():
        lines = text.split("\n")
        for start in range(len(lines) - len(want) + 1):
            if _normalised(lines[start : start + len(want)]) == want:
                return name
    return None


def _scripts() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(EXAMPLES.glob("*.py"))}


def test_every_python_block_of_the_docs_is_an_excerpt_of_an_example():
    scripts, strays = _scripts(), []
    for doc in DOCS:
        for line, block in python_blocks(doc.read_text()):
            if excerpt_of(block, scripts) is None:
                strays.append(f"{doc.relative_to(ROOT)}:{line}: {block.strip().splitlines()[0]!r}")
    assert not strays, "Python blocks that are no excerpt of a script under examples/ (copy them from one, or " \
                       "write the script): " + "; ".join(strays)
    assert sum(len(python_blocks(doc.read_text())) for doc in DOCS) >= len(RUN), "an example no doc shows"


def test_an_edited_or_stitched_block_is_not_an_excerpt():
    scripts = {"x.py": "def main():\n    a = 1\n    b = 2\n\n    c = 3\n"}
    assert excerpt_of("a = 1\nb = 2\n", scripts) == "x.py"  # indentation aside
    assert excerpt_of("b = 2\n\nc = 3", scripts) == "x.py"
    assert excerpt_of("a = 1\nb = 3\n", scripts) is None  # a value changed
    assert excerpt_of("a = 1\nc = 3\n", scripts) is None  # lines that are not contiguous
    assert excerpt_of("a = 1\n  b = 2\n", scripts) is None  # the indentation within the block changed
    blocks = python_blocks("text\n```python\nx = 1\n```\n\n```bash\nls\n```\n  ```python\n  y = 2\n  ```\n")
    assert blocks == [(3, "x = 1\n"), (10, "  y = 2\n")]


def test_every_example_is_run_or_says_why_not():
    assert set(NOT_RUN) <= {p.name for p in EXAMPLES.glob("*.py")}
    assert RUN, "no example to run"


def _run_example(rank: int, world_size: int, name: str) -> None:
    spec = importlib.util.spec_from_file_location(f"example_{Path(name).stem}", EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()


@pytest.mark.parametrize("name", RUN)
def test_the_example_runs_on_two_gloo_ranks_and_checks_itself(name, capsys):
    spawn(_run_example, 2, "gloo", args=(name,))
    out = capsys.readouterr().out
    assert "OK" in out and "MISMATCH" not in out, out


def test_the_readme_example_runs_under_torchrun():
    # --standalone: a free port for the rendezvous (several runs may share the machine).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(EXAMPLES / "ops.py")], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for op in ("gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm"):
        assert re.search(rf"^{op}: max abs diff vs plain PyTorch \S+, OK$", proc.stdout, re.M), proc.stdout
    readme = (ROOT / "README.md").read_text()
    assert excerpt_of(python_blocks(readme)[0][1], {"ops.py": (EXAMPLES / "ops.py").read_text()}) == "ops.py"
    assert "torchrun --nproc-per-node 2 examples/ops.py" in readme
