"""The test process's environment stays as the user gave it: the GPU tests run in its children, and a
TRITON_INTERPRET=1 leaked by a CPU test module would make them run interpreted (this happened once)."""

import os

import tests.kernels.test_gemm_interpret  # noqa: F401  (the module that runs interpreted cases)
from tests.conftest import INITIAL_TRITON_INTERPRET


def test_no_test_module_sets_triton_interpret():
    assert os.environ.get("TRITON_INTERPRET") == INITIAL_TRITON_INTERPRET
