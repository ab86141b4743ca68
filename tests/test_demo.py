"""The command line on the CPU: ``flashoverlap demo`` (every op, both dtypes), ``version``, and clear errors for bad
values and for commands that need GPUs."""

import subprocess
import sys

import pytest
import torch


def test_demo_on_cpu_checks_and_prints_the_plan():
    proc = subprocess.run(
        [sys.executable, "-m", "flashoverlap", "demo", "--cpu", "--shape", "700,300,96"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "gemm_all_reduce of [700, 96] @ [96, 300] bfloat16" in out
    assert "group   0: tiles [0," in out and "MiB" in out
    assert "verdict: OK" in out


def test_cli_rejects_unknown_commands():
    proc = subprocess.run([sys.executable, "-m", "flashoverlap", "frobnicate"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_demo_runs_every_op_on_cpu():
    for op, name in (("reduce_scatter", "gemm_reduce_scatter"), ("all_gather", "all_gather_gemm")):
        proc = subprocess.run(
            [sys.executable, "-m", "flashoverlap", "demo", "--cpu", "--op", op, "--shape", "640,300,96", "--dtype",
             "float16"], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        assert f"{name} of [640, 96] @ [96, 300] float16" in proc.stdout and "verdict: OK" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "flashoverlap", "demo", "--cpu", "--op", "reduce_scatter",
                           "--shape", "641,8,8"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "divisible" in proc.stderr


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "flashoverlap", *argv], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv,message", [
    (("demo", "--shape", "0,8,8"), "three positive integers"),
    (("demo", "--shape", "8,-5,8"), "three positive integers"),
    (("demo", "--shape", "8,8"), "three positive integers"),
    (("demo", "--world-size", "0"), "positive integer"),
    (("demo", "--dtype", "float32"), "invalid choice"),
    (("bench", "--ops", "all_reduce"), "choose from 'ops', 'block'"),
])
def test_bad_values_are_rejected_with_the_option_named(argv, message):
    proc = _cli(*argv)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
@pytest.mark.parametrize("argv", [("bench", "ops", "--ops", "all_reduce"),
                                  ("tune", "plan", "--op", "all_reduce", "--shape", "8,8,8")])
def test_gpu_commands_say_they_need_gpus(argv):
    proc = _cli(*argv)
    assert proc.returncode == 1 and "needs CUDA GPUs" in proc.stderr and "Traceback" not in proc.stderr


def test_version():
    from flashoverlap import __version__

    assert _cli("version").stdout.strip() == _cli("--version").stdout.strip() == f"flashoverlap {__version__}"
    assert "{demo,bench,tune,version}" in _cli("--help").stdout
