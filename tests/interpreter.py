"""Whether this machine's Triton interpreter can run the kernels' CPU cases: Triton 3.6's fails with numpy >= 2.4
(the GPU machines' pair); the Triton that installs on CPU machines today (3.9) does not."""

from importlib.metadata import version

import numpy as np
import pytest


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:2])


INTERPRETER_OK = _release(np.__version__) < (2, 4) or _release(version("triton")) >= (3, 9)
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER_OK, reason=f"Triton {version('triton')}'s interpreter needs numpy < 2.4: {np.__version__}")
