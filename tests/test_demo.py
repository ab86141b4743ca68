"""The main command: ``python -m flashoverlap demo`` on the CPU."""

import subprocess
import sys


def test_demo_on_cpu_checks_and_prints_the_plan():
    proc = subprocess.run(
        [sys.executable, "-m", "flashoverlap", "demo", "--cpu", "--m", "700", "--n", "300", "--k", "96"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "gemm_all_reduce of [700, 96] @ [96, 300]" in out
    assert "group   0: tiles [0," in out and "MiB" in out
    assert "verdict: OK" in out


def test_cli_rejects_unknown_commands():
    proc = subprocess.run([sys.executable, "-m", "flashoverlap", "frobnicate"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_demo_runs_every_op_on_cpu():
    for op, name in (("reduce_scatter", "gemm_reduce_scatter"), ("all_gather", "all_gather_gemm")):
        proc = subprocess.run(
            [sys.executable, "-m", "flashoverlap", "demo", "--cpu", "--op", op, "--m", "640", "--n", "300",
             "--k", "96"], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        assert f"{name} of [640, 96] @ [96, 300]" in proc.stdout and "verdict: OK" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "flashoverlap", "demo", "--cpu", "--op", "reduce_scatter", "--m",
                           "641"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "divisible" in proc.stderr
