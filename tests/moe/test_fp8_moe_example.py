"""examples/fp8_moe.py on two gloo ranks: it checks itself against the bf16 block (and raises beyond fp8 rounding)."""

import importlib.util
from pathlib import Path

from flashoverlap.testing import spawn

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fp8_moe.py"


def _run(rank, world):
    spec = importlib.util.spec_from_file_location("example_fp8_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    return True


def test_fp8_moe_example_runs_and_checks_itself(capsys):
    assert spawn(_run, 2, "gloo") == [True, True]
    out = capsys.readouterr().out
    assert out.count(", OK") == 6 and "MISMATCH" not in out, out
