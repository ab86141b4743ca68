"""``tools/mutate.py``'s command line: a misspelt or empty ``--only`` is a usage error naming it (it ran nothing,
exited 0 and wrote an empty results file over the committed one), and a subset needs its own ``--out``."""

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
