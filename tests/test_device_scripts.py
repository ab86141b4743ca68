"""The device scripts (``benchmarks/*_run.sh``: a device call's steps, picked with ``STEPS``): a step name that is
not one of the script's is an error naming it, before anything runs (a misspelt step would otherwise run nothing and
exit 0, as a new user found of other documented commands), and every step the script tests for, and every default
step, is one of its ``KNOWN_STEPS`` (``benchmarks/steps.sh``'s ``check_words``, which checks the settings too)."""

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"device_run.sh": [], "head_run.sh": ["nvlink"], "one_gpu_run.sh": [], "tune_run.sh": []}
SETTINGS = ("nvlink", "pcie-like")  # what a ``has name-$setting`` step expands to


def _run(script: str, args: list[str], steps: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "STEPS": steps, "OUT": str(out), "SETTING": "nvlink"}
    return subprocess.run(["bash", f"benchmarks/{script}", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_misspelt_or_empty_step_list_is_an_error_before_anything_runs(script, tmp_path):
    for steps, said in (("tests tsets", "unknown step 'tsets'"), (" ", "STEPS names no step"),
                        ("", "STEPS names no step")):
        out = tmp_path / steps.strip().replace(" ", "-")
        result = _run(script, SCRIPTS[script], steps, out)
        assert result.returncode == 2, (script, result.stdout, result.stderr)
        assert said in result.stderr and "steps: " in result.stderr
        assert not any(out.rglob("*.*")), f"{script} wrote {list(out.rglob('*.*'))} before refusing its steps"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_step_tested_for_and_every_default_step_is_known(script):
    text = (ROOT / "benchmarks" / script).read_text()
    known = set(re.search(r'^KNOWN_STEPS="([^"]*)"', text, re.M).group(1).split())
    used = set()
    for name, setting in re.findall(r"\bhas ([a-z0-9][a-z0-9-]*)(\$\w+)?", text):
        used |= {name + value for value in SETTINGS} if setting else {name}
    defaults = set(re.search(r"^STEPS=\$\{STEPS:?-([^}]*)\}", text, re.M).group(1).split())
    assert used == known, f"{script}: tested for but not known {sorted(used - known)}, known but never tested for " \
                          f"{sorted(known - used)}"
    assert defaults <= known, f"{script}: default steps not known {sorted(defaults - known)}"


@pytest.mark.parametrize("script,env,said", [
    ("device_check.sh test", {}, "the first argument is tests, bench or all, got 'test'"),
    ("final_run.sh", {"SETTINGS": "pcie"}, "unknown setting 'pcie' in SETTINGS (settings: nvlink pcie-like)"),
    ("fp8_two_gpu_run.sh", {"SETTINGS": " "}, "SETTINGS names no setting"),
    ("tune_run.sh", {"SETTING": "pcie", "STEPS": "bw"}, "SETTING is nvlink or pcie-like, got 'pcie'"),
    ("tune_run.sh", {"PATHS": " ", "STEPS": "bw"}, "PATHS names no path (paths: nccl p2p)"),
    ("tune_run.sh", {"PATHS": "nccl p2pp", "STEPS": "bw"}, "unknown path 'p2pp' in PATHS")])
def test_a_misspelt_setting_or_mode_is_an_error_before_anything_runs(script, env, said, tmp_path):
    """These ran nothing (a mode no branch takes, an empty setting or path list) or the wrong thing (a misspelt
    setting ran nvlink under the misspelt name) and exited 0."""
    name, *args = script.split()
    result = subprocess.run(["bash", f"benchmarks/{name}", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "OUT": str(tmp_path / "out"), **env})
    assert result.returncode == 2 and said in result.stderr, (result.stdout, result.stderr)
    assert not any((tmp_path / "out").rglob("*.*"))



GPUS = {"device_run.sh": 2, "head_run.sh": 2, "one_gpu_run.sh": 1, "tune_run.sh": 2, "final_run.sh": 2,
        "fp8_two_gpu_run.sh": 2, "device_check.sh tests": 2}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA GPUs gets")
@pytest.mark.parametrize("script", GPUS)
def test_a_machine_without_the_gpus_a_script_needs_is_told_so_before_anything_runs(script, tmp_path):
    """Every device script counts the GPUs first: on a CPU machine its steps used to fail one by one (or, the fp8
    grid, fall into a dry run written under the GPU results' name) and the script exited 0."""
    name, *args = script.split()
    args = args or SCRIPTS.get(name, [])
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SETTING": "nvlink", "SETTINGS": "nvlink"}
    env.pop("STEPS", None)  # each script's default steps
    result = subprocess.run(["bash", f"benchmarks/{name}", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"{name}: needs {GPUS[script]} or more CUDA GPUs, this machine has 0" in result.stderr
    assert not any((tmp_path / "out").rglob("*.*"))
