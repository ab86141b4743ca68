"""``benchmarks/host_python.py``'s command line, checked before anything runs: ``--worlds 0``, ``--worlds 3`` (the
default M not divisible) and ``--shape 1,2`` ended in tracebacks from the measurement."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def host_python(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts its checkout and folder first: undone after
    spec = importlib.util.spec_from_file_location("host_python_under_test", ROOT / "benchmarks" / "host_python.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv,said", [
    (["--worlds", "0"], "--worlds: each W is a rank count of at least 2"),
    (["--worlds", "2,1"], "--worlds: each W is a rank count of at least 2"),
    (["--worlds", "two"], "--worlds: expected comma-separated integers"),
    (["--worlds", "3"], "--shape: M = 4096 is not divisible by W = [3] of --worlds"),
    (["--shape", "1,2"], "--shape: three positive integers M,N,K, got 1,2"),
    (["--shape", "64,0,8"], "--shape: three positive integers"),
    (["--shape", "6,8,8", "--worlds", "2,3,4"], "not divisible by W = [4]")])
def test_a_bad_world_or_shape_is_a_usage_error_naming_the_option(argv, said, host_python, capsys):
    with pytest.raises(SystemExit) as exit_info:
        host_python.parse_args(["--label", "x", *argv])
    assert exit_info.value.code == 2 and said in capsys.readouterr().err


def test_the_defaults_and_a_good_shape_parse(host_python):
    args = host_python.parse_args(["--label", "x"])
    assert args.worlds == [2] and args.shape == host_python.SHAPE
    args = host_python.parse_args(["--label", "x", "--shape", "2048,4096,4096", "--worlds", "2,4,8"])
    assert args.worlds == [2, 4, 8] and args.shape == (2048, 4096, 4096)
