"""``benchmarks/cpu_install.py`` measures the README's CPU install: its docstring called ``pip install
torch==2.13.0`` "the README's CPU install" while README.md installs torch from the CPU index; the script installs the
pinned name as the machine's pip resolves it (the CPU wheel, locally, on the machines that measure it) and stops
where that is another build."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cpu_install():
    spec = importlib.util.spec_from_file_location("cpu_install_under_test", ROOT / "benchmarks" / "cpu_install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docstring_names_the_readme_cpu_index_and_what_is_installed_instead(cpu_install):
    readme = re.search(r"pip install torch --index-url (\S+)", (ROOT / "README.md").read_text()).group(1)
    assert cpu_install.CPU_INDEX == readme
    doc = " ".join(cpu_install.__doc__.split())
    assert f"--index-url {readme}" in doc and f"pip install {cpu_install.TORCH}" in doc


@pytest.mark.parametrize("cuda", ["None", "12.8"])
def test_a_torch_that_is_not_the_cpu_build_stops_the_run(cuda, cpu_install, monkeypatch, tmp_path):
    ran = []

    def run(cmd, **kw):
        ran.append(cmd)
        return cuda if cmd[-1].startswith("import torch") else ""

    monkeypatch.setattr(cpu_install, "_run", run)
    monkeypatch.setattr(cpu_install, "_site_packages", lambda venv: tmp_path)
    monkeypatch.setattr(cpu_install, "_mib", lambda path: 1)
    monkeypatch.setattr(cpu_install, "_packages", lambda python: ["torch==2.13.0"])
    if cuda == "None":
        record, _ = cpu_install.measure("", tmp_path)
        assert record["packages"] == ["torch==2.13.0"]
    else:
        with pytest.raises(SystemExit, match=r"a CUDA 12\.8 build, not the CPU one: .*PIP_INDEX_URL=https://"):
            cpu_install.measure("", tmp_path)
        assert not any("-e" in cmd for cmd in ran)  # the package was not installed over it
