"""The test process's environment stays as the user gave it: the GPU tests run in its children, and a
TRITON_INTERPRET=1 leaked by a CPU test module would make them run interpreted (this happened once)."""

import os

import tests.kernels.test_gemm_interpret  # noqa: F401  (the module that runs interpreted cases)
from tests.conftest import INITIAL_TRITON_INTERPRET


def test_no_test_module_sets_triton_interpret():
    assert os.environ.get("TRITON_INTERPRET") == INITIAL_TRITON_INTERPRET


def test_the_gpu_suites_world_size_variable_is_read_strictly_and_named_when_wrong():
    import pytest

    from tests.gpu.helpers import GPUS, world_size

    assert world_size({}) == GPUS and world_size({"FLASHOVERLAP_TEST_WORLD_SIZE": "4"}) == 4
    for text in ("abc", "-2", "2.0", " 2"):
        with pytest.raises(ValueError, match=f"FLASHOVERLAP_TEST_WORLD_SIZE must be a number of ranks .*{text!r}"):
            world_size({"FLASHOVERLAP_TEST_WORLD_SIZE": text})
