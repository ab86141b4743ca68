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
