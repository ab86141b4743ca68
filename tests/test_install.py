"""A CPU install without the GPU extra: with triton and cuda-bindings unimportable (a meta-path blocker installed by a
``sitecustomize`` on ``PYTHONPATH``, in a subprocess), ``import flashoverlap`` and the CPU reference path work
(an op and a layer on a one-rank gloo group), and the GPU kernels, when reached, say how to install what they
need. The dependency lists of pyproject.toml: triton and cuda-bindings only in the ``gpu`` (and ``test``) extras."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BLOCKER = textwrap.dedent('''
    import sys

    class _Missing:
        """Behave as if triton and cuda-bindings were not installed."""

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("triton", "cuda"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _Missing())
''')

REFERENCE_PATH = textwrap.dedent('''
    import os, sys, tempfile
    import torch, torch.distributed as dist
    import flashoverlap as fo
    from flashoverlap.nn import ColumnParallelLinear, RowParallelLinear

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            a, w = torch.randn(5, 7), torch.randn(3, 7)
            torch.testing.assert_close(fo.gemm_all_reduce(a, w.t()), a @ w.t())
            up, down = ColumnParallelLinear(7, 6), RowParallelLinear(6, 7)
            down(up(torch.randn(4, 7, requires_grad=True))).sum().backward()
            assert up.weight.grad is not None
        finally:
            dist.destroy_process_group()
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "cuda"))
    assert not loaded, loaded
    print("reference path OK")
''')


def _without_gpu_packages(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)


def test_the_blocker_blocks(tmp_path):
    proc = _without_gpu_packages(tmp_path, "import triton")
    assert proc.returncode != 0 and "No module named 'triton'" in proc.stderr


def test_import_and_the_reference_path_need_no_triton(tmp_path):
    proc = _without_gpu_packages(tmp_path, REFERENCE_PATH)
    assert proc.returncode == 0 and "reference path OK" in proc.stdout, proc.stderr[-3000:]


def test_the_gpu_kernels_say_how_to_install_triton(tmp_path):
    proc = _without_gpu_packages(tmp_path, "import flashoverlap.kernels.gemm")
    assert proc.returncode != 0 and "flashoverlap[gpu]" in proc.stderr, proc.stderr[-3000:]


def test_only_torch_and_numpy_are_core_dependencies():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip() for dep in project["dependencies"]}
    assert names == {"torch", "numpy"}
    extras = project["optional-dependencies"]
    assert any(dep.startswith("triton") for dep in extras["gpu"])
    assert any(dep.startswith("cuda-bindings") for dep in extras["gpu"])
    assert {"pytest-randomly", "triton"} <= {dep.split(">")[0].split("=")[0] for dep in extras["test"]}
    assert any(dep.startswith("transformers") for dep in extras["hf"])
