"""Results file names carry the GPU model (``benchmarks/harness/gpu_tag.py``): an H100's files were named
``hbm3x2-...`` (the device name's last word), beside the committed ``h100x1-``/``h200x1-`` files."""

import re
from pathlib import Path

import pytest

from benchmarks.harness.gpu_tag import model_tag

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name,tag", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA B200", "b200"), ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA L40S", "l40s"), ("Tesla V100-SXM2-16GB", "v100"), ("NVIDIA GeForce RTX 4090", "4090")])
def test_the_tag_is_the_model_token_not_the_last_word(name, tag):
    assert model_tag(name) == tag


def test_every_results_name_takes_the_shared_tag():
    """No benchmark names its file from the device name's last word: each calls ``gpu_tag`` (the shell scripts
    through ``steps.sh``'s ``gpu_model``, which runs ``python3 -m benchmarks.harness.gpu_tag`` and stops where it
    fails)."""
    last_word = re.compile(r"get_device_name\([^)]*\)\.split\(\)\[-1\]")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*")
                 if p.suffix in (".py", ".sh") and "results" not in p.parts and last_word.search(p.read_text())]
    assert not offenders, offenders
    steps = (ROOT / "benchmarks" / "steps.sh").read_text()
    helper = re.search(r"^gpu_model\(\) \{[^\n]*\n(.*?)\n\}", steps, re.S | re.M)
    assert helper and "GPU=$(python3 -m benchmarks.harness.gpu_tag) || {" in helper.group(1), "steps.sh: gpu_model"
    for script in ("device_run.sh", "head_run.sh", "fp8_two_gpu_run.sh", "final_run.sh", "tune_run.sh",
                   "one_gpu_run.sh"):
        text = (ROOT / "benchmarks" / script).read_text()
        assert re.search(r"^gpu_model; gpu=\$\{?GPU\}?", text, re.M) and "steps.sh" in text, script
