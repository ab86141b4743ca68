"""The fp8 quantise kernel (``kernels/quantise.quantise_rows``) against the torch form it replaces
(``comm/expert/scaled.quantise_with_torch``), byte for byte: scales and fp8 rows, row-wise and 128-block, e4m3 and
e5m2, from bf16, fp16 and fp32, into packed wire rows (a row stride past K) and dense ones, odd K (row-wise), K past
one chunk, rows of zeros, -0.0, values fp8 holds only as subnormals, and quotients whose rounding carries into the
next binade (124.5 -> 128 in e4m3). Under the Triton interpreter (a child process,
``python -m tests.kernels.test_quantise``, sets TRITON_INTERPRET before triton is imported) and on a GPU.

A row holding a NaN: the scale of its row (block-wise: of its block) is NaN; the row's fp8 bytes are checked on the
GPU only (the interpreter's fp32-to-fp8 cast does not keep NaN)."""

import json
import os
import sys

if __name__ == "__main__":  # the child: interpret the kernel (before anything imports triton)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.interpreter import interpreted_json, needs_interpreter  # noqa: E402

# (name, mode, fp8 dtype, input dtype, rows, K, packed)
CASES = [
    ("row-e4-bf16-packed", "row", "float8_e4m3fn", "bfloat16", 7, 2304, True),
    ("row-e4-fp32-odd", "row", "float8_e4m3fn", "float32", 5, 200, False),
    ("row-e5-fp16-packed", "row", "float8_e5m2", "float16", 4, 1100, True),
    ("block-e4-bf16-packed", "block", "float8_e4m3fn", "bfloat16", 6, 1152, True),
    ("block-e5-fp32", "block", "float8_e5m2", "float32", 3, 384, False),
    ("block-e4-fp16-one", "block", "float8_e4m3fn", "float16", 1, 128, True),
]


def _inputs(case, device):
    name, mode, fp8, x_dtype, rows, k, packed = case
    gen = torch.Generator().manual_seed(len(name) * 31 + rows)
    x = torch.randn(rows, k, generator=gen) * 3
    # Row 0: largest magnitude 1.0 (scale 1 / fp8 max), so that its special values' quotients are known: zeros, an
    # e4m3 subnormal (1.2e-5 * 448 = 0.0054, below 2^-6), and carries into the next binade (0.28125 * 448 = 126 ->
    # 128 in e4m3; 0.28125 * 57344 = 16128 -> 16384 in e5m2); all exact in every input dtype but the tiny ones.
    x[0] = x[0].clamp(-0.9, 0.9)
    x[0, :8] = torch.tensor([0.0, -0.0, 1.2e-5, -3e-7, 2.0**-12, 0.28125, -0.28125, 1.0])
    x[-1, 130:140] = -0.0
    if rows > 2:
        x[1] = 0.0  # a row of zeros: the scale's floor
    x = x.to(getattr(torch, x_dtype)).to(device)
    return x


def _run(case, device="cpu", nan_row=False):
    from flashoverlap.comm.expert.scaled import quantise_with_torch, wire_rows
    from flashoverlap.kernels.quantise import quantise_rows

    name, mode, fp8, x_dtype, rows, k, packed = case
    dtype = getattr(torch, fp8)
    x = _inputs(case, device)
    if nan_row:
        x[-1, 3] = float("nan")

    def buffers():
        if packed:
            q, s = wire_rows(rows, k, mode, dtype, x.device)
        else:
            q = torch.empty(rows, k, dtype=dtype, device=device)
            s = torch.empty(rows, k // 128 if mode == "block" else 1, device=device)
        q.view(torch.uint8).fill_(0x55)
        s.fill_(-1.0)  # never a scale
        return q, s

    (q, s), (q_ref, s_ref) = buffers(), buffers()
    quantise_rows(x, q, s, mode == "block")
    quantise_with_torch(x, q_ref, s_ref, mode)
    bytes_, ref = q.view(torch.uint8).cpu(), q_ref.view(torch.uint8).cpu()
    rows_ok = slice(None, -1) if nan_row else slice(None)
    return {"name": name, "scales_equal": bool(torch.equal(s.cpu()[rows_ok], s_ref.cpu()[rows_ok])),
            "nan_scales": bool(torch.isnan(s.cpu()[-1, 0])) if nan_row else None,  # the NaN's row or block
            "bytes_differ": int((bytes_[rows_ok] != ref[rows_ok]).sum()),
            "nan_row_bytes_equal": bool(torch.equal(bytes_[-1], ref[-1])) if nan_row else None}


if __name__ == "__main__":
    print(json.dumps({case[0]: [_run(case), _run(case, nan_row=True)] for case in CASES}))
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted():
    return interpreted_json("tests.kernels.test_quantise")


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreted_quantise_matches_torch(interpreted, case):
    plain, with_nan = interpreted[case[0]]
    assert plain["scales_equal"] and plain["bytes_differ"] == 0, plain
    assert with_nan["scales_equal"] and with_nan["bytes_differ"] == 0 and with_nan["nan_scales"], with_nan


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", CASES + [("row-e4-bf16-wide", "row", "float8_e4m3fn", "bfloat16", 4096, 7168, True),
                                          ("block-e4-bf16-wide", "block", "float8_e4m3fn", "bfloat16", 4096, 7168,
                                           True)], ids=lambda c: c[0])
def test_gpu_quantise_matches_torch(case):
    for nan_row in (False, True):
        row = _run(case, "cuda", nan_row)
        assert row["scales_equal"] and row["bytes_differ"] == 0, row
        if nan_row:
            assert row["nan_scales"] and row["nan_row_bytes_equal"], row
