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
    ("tune_run.sh", {"PATHS": "nccl p2pp", "STEPS": "bw"}, "unknown path 'p2pp' in PATHS"),
    # Without its argument: bash's "head_run.sh: line 19: 1: usage: ...", status 1 (a failure, not a usage error).
    ("head_run.sh", {}, "head_run.sh: the setting is nvlink or pcie-like, got '' (usage: bash benchmarks/head_run.sh"),
    ("head_run.sh pcie", {}, "head_run.sh: the setting is nvlink or pcie-like, got 'pcie'")])
def test_a_misspelt_setting_or_mode_is_an_error_before_anything_runs(script, env, said, tmp_path):
    """These ran nothing (a mode no branch takes, an empty setting or path list) or the wrong thing (a misspelt
    setting ran nvlink under the misspelt name) and exited 0."""
    name, *args = script.split()
    result = subprocess.run(["bash", f"benchmarks/{name}", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "OUT": str(tmp_path / "out"), **env})
    assert result.returncode == 2 and said in result.stderr, (result.stdout, result.stderr)
    assert not any((tmp_path / "out").rglob("*.*"))



GPUS = {"device_run.sh": 2, "head_run.sh": 2, "one_gpu_run.sh": 1, "tune_run.sh": 2, "final_run.sh": 2,
        "fp8_two_gpu_run.sh": 2, "device_check.sh tests": 2, "bench_smoke.sh": 1}


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


# Each script with steps that fail (a stand-in torchrun and python3 exiting with FAKE_RC), and how many steps it runs.
FAILING = {"device_run.sh": ({"STEPS": "bench smoke"}, 4), "head_run.sh nvlink": ({"STEPS": "bench"}, 2),
           "one_gpu_run.sh": ({"STEPS": "spawn fp8parts"}, 2), "tune_run.sh": ({"STEPS": "bw", "PATHS": "nccl"}, 1),
           "final_run.sh": ({"SETTINGS": "nvlink", "TESTS": "tests/gpu", "DEMO": "", "TIMELINE": ""}, 2),
           "device_check.sh all": ({}, 3), "bench_smoke.sh": ({}, 4)}
STAND_INS = {  # python3 answers the scripts' own questions (GPU count, tag, fault scenarios); the rest exit FAKE_RC
    "python3": 'case "$*" in *device_count*) echo 2; exit 0;; *gpu_tag*) echo h100; exit 0;;\n'
               '*SCENARIOS*) echo "a:b"; exit 0;; esac\nexit "$FAKE_RC"',
    "torchrun": 'exit "$FAKE_RC"', "nvidia-smi": "exit 0"}


def _stand_ins(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("script", FAILING)
def test_a_failed_step_makes_the_script_fail_after_the_rest_ran(script, tmp_path):
    """device_run.sh and head_run.sh ended in a bare `true`, the others in their last command's status: every step
    failed (bench_smoke.sh on a CPU machine) and the script exited 0. Now each step's status is counted
    (steps.sh's ``exited``) and the last line exits 1 naming the count; a clean run still exits 0."""
    name, *args = script.split()
    env_extra, steps = FAILING[script]
    bin_dir = _stand_ins(tmp_path)
    for rc in (3, 0):
        out = tmp_path / f"out-{rc}"
        env = {**os.environ, **env_extra, "OUT": str(out), "FAKE_RC": str(rc), "SMOKE_TIMEOUT": "20",
               "FLASHOVERLAP_COMMIT": "abc", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        result = subprocess.run(["bash", f"benchmarks/{name}", *args], cwd=ROOT, capture_output=True, text=True,
                                timeout=60, env=env)
        said = re.findall(r"\bexit (\d+)", result.stdout)
        if rc:
            assert result.returncode == 1, (result.stdout, result.stderr)
            assert f"{name}: {steps} step(s) failed" in result.stderr, result.stderr
            assert said == ["3"] * steps, result.stdout  # every step ran and said its status
        else:
            assert result.returncode == 0 and said == ["0"] * steps, (result.stdout, result.stderr)


@pytest.mark.parametrize("script", [*SCRIPTS, "final_run.sh", "device_check.sh", "bench_smoke.sh"])
def test_every_step_status_is_counted_and_the_last_line_exits_with_the_count(script):
    text = (ROOT / "benchmarks" / script).read_text()
    assert text.rstrip().splitlines()[-1] == "exit_failed", f"{script} does not end with exit_failed"
    uncounted = re.findall(r'echo "[^"]*: exit \$\?"', text)
    assert not uncounted, f"{script} prints a step's status without counting it: {uncounted}"


def test_the_fp8_script_keeps_its_own_failure_count():
    last = (ROOT / "benchmarks" / "fp8_two_gpu_run.sh").read_text().rstrip().splitlines()[-1]
    assert last.startswith("(( failed == 0 )) ||") and "exit 1" in last
