"""The tuner's command line parses, and says how to run it where torchrun did not start it."""

import subprocess
import sys

import pytest

from flashoverlap.cli import main


def test_tune_commands_parse_and_need_gpus_and_torchrun(monkeypatch):
    import torch

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for argv in (["tune", "bandwidth", "--ops", "all_reduce"],
                 ["tune", "plan", "--op", "all_gather", "--shape", "8,8,8", "--exhaustive"]):
        with pytest.raises(SystemExit, match="torchrun"):
            main(argv)


def test_tune_plan_needs_a_shape():
    proc = subprocess.run([sys.executable, "-m", "flashoverlap", "tune", "plan", "--op", "all_reduce"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--shape" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "flashoverlap", "tune", "plan", "--op", "all_reduce", "--shape",
                           "8,8"], capture_output=True, text=True)
    assert proc.returncode == 2 and "three positive integers" in proc.stderr
