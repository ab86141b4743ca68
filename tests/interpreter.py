"""Whether this machine's Triton interpreter can run the kernels' CPU cases: Triton 3.6's fails with numpy >= 2.4
(the GPU machines' pair); the Triton that installs on CPU machines today (3.9) does not."""

import json
import os
import subprocess
import sys
from importlib.metadata import version

import numpy as np
import pytest


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:2])


INTERPRETER_OK = _release(np.__version__) < (2, 4) or _release(version("triton")) >= (3, 9)
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER_OK, reason=f"Triton {version('triton')}'s interpreter needs numpy < 2.4: {np.__version__}")


def interpreted_json(module: str, timeout: float = 600) -> object:
    """Run ``python -m module`` with ``TRITON_INTERPRET=1`` (the child sets it before triton is imported) and return
    the JSON its last line of output holds; the child must exit 0."""
    proc = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
