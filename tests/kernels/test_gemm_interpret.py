"""The signalling GEMM under the Triton interpreter (CPU): values and counters at small, odd shapes.

The interpreter computes bf16 dots wrongly, so fp16 and fp32 are tested here; bf16 is covered by the GPU tests.
The cases run in a child process: TRITON_INTERPRET must be set before triton is imported, and never in this
process, whose children run the GPU tests.
"""


import pytest

from tests.interpreter import interpreted_rows, needs_interpreter
from tests.kernels.gemm_cases import ALL_GATHER_CASES, CASES, COPY_CASES

pytestmark = needs_interpreter


@pytest.fixture(scope="module")
def results():
    return interpreted_rows("tests.kernels.interpreted_cases", timeout=600)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreted_gemm(results, case):
    row = results[case[0]]
    assert not row["nan"], "an output element was never written"
    limit = 1e-5 if case[4] == "float32" else 2e-3
    assert row["rel_err"] < limit
    if row["counters"] is not None:
        # Every group's counter reached exactly its tile count; counters past the plan's groups untouched.
        assert row["counters"] == row["expected_counters"]


@pytest.mark.parametrize("case", ALL_GATHER_CASES, ids=[c[0] for c in ALL_GATHER_CASES])
def test_interpreted_all_gather_waits(results, case):
    row = results[case[0]]
    if case[9] == "all":
        # Every band had arrived: the whole product, in row-major C, from the plan's gathered layout.
        assert row["all_written"] and row["wait_error"] == 0
        assert row["rel_err"] < (1e-5 if case[4] == "float32" else 2e-3)
    else:
        # Only group 0 arrived: with a spin bound, a wait gives up and names a group that never came (1 + g).
        assert 2 <= row["wait_error"] <= row["groups"]


@pytest.mark.parametrize("case", COPY_CASES, ids=[c[0] for c in COPY_CASES])
def test_interpreted_sm_copy(results, case):
    assert results[case[0]]["equal"], "the copy kernel missed or changed elements"
