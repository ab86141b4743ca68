"""Every GPU diagnostic under ``benchmarks/diagnostics/`` says in one line that it needs CUDA GPUs when run without
them (``results_file.require_cuda`` first in its ``main``), instead of a traceback from deep inside its first CUDA
call: run here in this process with CUDA reported absent, as ``python -m`` would, its output path in a scratch
directory."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent.parent
# The diagnostics a CPU runs (each has its own test), and the helpers that are no command.
CPU_OR_HELPER = {"__init__", "results_file", "kernel_facts", "fp8_bytes", "grouped_gemm_ways"}
# Those whose results path is an option, not an argument.
OUT_OPTION = {"fp8_grouped", "fp8_grouped_tiles", "fp8_moe_host"}
DIAGNOSTICS = sorted(p.stem for p in (ROOT / "benchmarks" / "diagnostics").glob("*.py")
                     if p.stem not in CPU_OR_HELPER and "def main(" in p.read_text())


@pytest.mark.parametrize("name", DIAGNOSTICS)
def test_a_gpu_diagnostic_says_it_needs_cuda_in_one_line(name, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    out = str(tmp_path / "out.json")
    monkeypatch.setattr(sys, "argv", [name, *(["--out", str(tmp_path)] if name in OUT_OPTION else [out])])
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module(f"benchmarks.diagnostics.{name}", run_name="__main__", alter_sys=True)
    message = exit_.value.code
    assert isinstance(message, str) and "\n" not in message, (name, message, capsys.readouterr())
    assert "CUDA GPU" in message and name in message, message


def test_the_sub_band_sweep_asks_for_its_results_path_before_any_gpu_work(monkeypatch, capsys):
    """p2p-path.md's command for the sweep: without the results file's path (which rank 0 writes at the very end)
    it used to measure every shape and then fail on ``sys.argv[1]``; it refuses first, naming the argument."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["p2p_sub_bands"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("benchmarks.diagnostics.p2p_sub_bands", run_name="__main__", alter_sys=True)
    message = exit_.value.code
    assert isinstance(message, str) and "\n" not in message, message
    assert "results file's path" in message and "p2p_sub_bands OUT.json" in message, message
    doc = (ROOT / "docs" / "p2p-path.md").read_text()
    assert "`torchrun --nproc-per-node 2 -m benchmarks.diagnostics.p2p_sub_bands OUT.json`" in doc


@pytest.mark.parametrize("name", DIAGNOSTICS)
def test_a_gpu_diagnostic_answers_help_with_its_docstring_on_any_machine(name, monkeypatch, capsys):
    """``--help`` said "needs 1 CUDA GPU" on a CPU machine, and on a GPU (no option parser) ran the whole diagnostic,
    then exited 0 printing "None" (``results_argument(None)``) without writing a results file."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module(f"benchmarks.diagnostics.{name}", run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert exit_.value.code in (0, None) and "CUDA GPU, found" not in out, (name, out)
    assert len(out.strip().splitlines()) > 1, (name, out)  # the docstring, not one line (nor "None")


PATH_ONLY = [name for name in DIAGNOSTICS if "path_only=True" in (ROOT / "benchmarks" / "diagnostics"
                                                                  / f"{name}.py").read_text()
             or "one_rank_nccl_diagnostic(" in (ROOT / "benchmarks" / "diagnostics" / f"{name}.py").read_text()]


@pytest.mark.parametrize("name", PATH_ONLY)
def test_a_diagnostic_whose_one_argument_is_a_path_refuses_an_option_before_measuring(name, monkeypatch):
    """``--bogus`` passed the GPU check and the whole run, and was refused only when the results were written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # refused before the GPU check: so on a GPU too
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", [name, "--bogus"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module(f"benchmarks.diagnostics.{name}", run_name="__main__", alter_sys=True)
    assert "unknown option --bogus" in str(exit_.value.code), (name, exit_.value.code)


def test_the_path_only_diagnostics_are_found():
    assert len(PATH_ONLY) >= 19, PATH_ONLY
    assert {"host_queue", "moe_one_gpu", "p2p_fp8_one_gpu", "nccl_host_parts"} <= set(PATH_ONLY)
