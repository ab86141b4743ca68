"""The fp8 grouped GEMM (``kernels.grouped_gemm.scaled_grouped_gemm``) under the Triton interpreter (a child process,
``python -m tests.kernels.test_grouped_fp8``, sets TRITON_INTERPRET before triton is imported; Triton 3.9's
interpreter runs fp8 ``tl.dot``) and, on a GPU, at MoE-sized shapes: against the dequantised fp64 product per
segment, row-wise and 128-block scales, contiguous and ``transpose(1, 2)`` weights, packed wire rows read in place
(row stride past K), segments with starts and gaps, empty segments, bf16 and fp32 outputs; rows no segment covers
stay NaN."""

import json
import os
import sys

if __name__ == "__main__":  # the child: interpret the kernels (before anything imports triton)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.interpreter import interpreted_json, needs_interpreter  # noqa: E402

FP8 = torch.float8_e4m3fn
# (name, mode, experts, K, N, segment (start, end) or ends only, segment experts, w transposed, packed rows, out dtype)
CASES = [
    ("row-ends", "row", 3, 96, 40, [(None, 7), (None, 7), (None, 20), (None, 33)], [2, 0, 1, 2], True, False,
     "float32"),
    ("row-packed-gaps", "row", 2, 64, 48, [(0, 5), (8, 8), (8, 19), (24, 30)], [1, 0, 0, 1], False, True,
     "bfloat16"),
    ("block-ends", "block", 3, 256, 160, [(None, 10), (None, 10), (None, 25), (None, 37)], [2, 0, 1, 0], True,
     False, "float32"),
    ("block-packed-gaps", "block", 2, 128, 200, [(3, 9), (12, 30), (30, 31)], [1, 0, 1], True, True, "bfloat16"),
    ("block-odd-steps", "block", 2, 384, 72, [(None, 9), (None, 21)], [1, 0], False, False, "float32"),
]
# The block-wise cases again with ``pair_k`` (two K steps per iteration; a pair, a pair and a step, one step): a
# tile 32 wide (the weight's scale one scalar per step) and 256 wide (one per column: N = 200 spans two blocks).
PAIRED = {"32": (16, 32), "256": (16, 256)}


def _run(case, device="cpu", tile=None):
    from flashoverlap.comm.expert.scaled import pack, quantise, unpack
    from flashoverlap.kernels.grouped_gemm import GroupedTile, Segments, scaled_grouped_gemm

    name, mode, experts, k, n, segs, seg_expert, w_t, packed, out_dtype = case
    gen = torch.Generator().manual_seed(len(name))
    rows = max(end for _, end in segs) + 3  # rows past the last segment
    x = torch.randn(rows, k, generator=gen)
    xq, xs = quantise(x, mode)
    if packed:  # the wire rows: the kernel reads fp8 and scales out of the uint8 rows in place
        xq, xs = unpack(pack(xq, xs), k, FP8, xs.shape[1])
    w = torch.randn(experts, n, k, generator=gen).to(FP8)
    wq = w.transpose(1, 2) if w_t else w.transpose(1, 2).contiguous()
    ws = torch.rand(experts, n, generator=gen) + 0.5 if mode == "row" else \
        torch.rand(experts, k // 128, -(-n // 128), generator=gen) + 0.5
    ends = torch.tensor([e for _, e in segs], dtype=torch.int32)
    starts = None if segs[0][0] is None else torch.tensor([s for s, _ in segs], dtype=torch.int32)
    dtype = getattr(torch, out_dtype)
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=device)

    def to(t):
        return t.to(device)

    tile = tile or GroupedTile(16, 32, 128 if mode == "block" else 32, 2, 1, 4, None)
    scaled_grouped_gemm(to(xq), to(xs), to(wq), to(ws), Segments(to(ends), to(torch.tensor(seg_expert,
                        dtype=torch.int32)), starts=None if starts is None else to(starts)), out=out, mode=mode,
                        tile=tile)
    want = torch.full((rows, n), float("nan"), dtype=torch.float64)
    previous = 0
    for (start, end), e in zip(segs, seg_expert):
        start = previous if start is None else start
        previous = max(previous, end)
        if end > start:
            sa = xs[start:end].double()
            sa = sa.repeat_interleave(128, 1) if mode == "block" else sa
            sb = ws[e].double().reshape(1, -1) if mode == "row" else \
                ws[e].double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:k, :n]
            want[start:end] = (xq[start:end].double() * sa) @ (wq[e].double() * sb)
    got = out.double().cpu()
    untouched = bool(torch.isnan(got[torch.isnan(want)]).all())
    covered = ~torch.isnan(want)
    err = float((got[covered] - want[covered]).abs().max()) / (1 + float(want[covered].abs().max()))
    return {"name": name, "err": err, "untouched": untouched, "dtype": out_dtype}


def _paired(case, width: str) -> dict:
    """``_run`` with a paired tile, and whether the launcher asked the kernel for paired steps (``PAIR_K``)."""
    from flashoverlap.kernels import grouped_gemm
    from flashoverlap.kernels.grouped_gemm import GroupedTile

    real, launched = grouped_gemm.scaled_grouped_gemm_kernel, []

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs.get("PAIR_K"))
                return real[grid](*args, **kwargs)
            return launch

    grouped_gemm.scaled_grouped_gemm_kernel = Recording()
    try:
        block_m, block_n = PAIRED[width]
        row = _run(case, tile=GroupedTile(block_m, block_n, 128, 2, 1, 4, None, pair_k=True))
    finally:
        grouped_gemm.scaled_grouped_gemm_kernel = real
    return row | {"pair_k": launched}


if __name__ == "__main__":
    rows = {case[0]: _run(case) for case in CASES}
    rows |= {f"{case[0]}-paired-{width}": _paired(case, width) for case in CASES if case[1] == "block"
             for width in PAIRED}
    print(json.dumps(rows))
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted():
    return interpreted_json("tests.kernels.test_grouped_fp8")


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreted_fp8_grouped_gemm(interpreted, case):
    row = interpreted[case[0]]
    tol = 1e-2 if row["dtype"] == "bfloat16" else 1e-5
    assert row["err"] <= tol, row
    assert row["untouched"], f"{case[0]}: rows no segment covers were written"


@needs_interpreter
@pytest.mark.parametrize("width", PAIRED)
@pytest.mark.parametrize("case", [c for c in CASES if c[1] == "block"], ids=[c[0] for c in CASES if c[1] == "block"])
def test_interpreted_paired_k_steps_give_the_same_products(interpreted, case, width):
    row = interpreted[f"{case[0]}-paired-{width}"]
    assert row["pair_k"] == [True], row  # the paired steps ran (not the unpaired loop under a paired tile)
    tol = 1e-2 if row["dtype"] == "bfloat16" else 1e-5
    assert row["err"] <= tol, row
    assert row["untouched"], f"{case[0]} paired: rows no segment covers were written"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode,paired", [("row", False), ("block", False), ("block", True)])
def test_gpu_fp8_grouped_gemm(mode, paired):
    import dataclasses

    from flashoverlap.kernels.grouped_gemm import SCALED_TILE

    case = ("gpu-" + mode, mode, 8, 1152, 768, [(None, e) for e in (300, 300, 1100, 1500, 2047, 3000, 3001, 4000)],
            [3, 1, 0, 7, 2, 5, 4, 6], True, True, "bfloat16")  # K = 9 steps of 128: four pairs and one alone
    row = _run(case, "cuda", dataclasses.replace(SCALED_TILE, pair_k=paired))
    assert row["err"] <= 1e-2 and row["untouched"], row


@pytest.mark.parametrize("block_n", [64, 128, 256])
@pytest.mark.parametrize("mode,paired", [("row", False), ("block", False), ("block", True)])
def test_every_fp8_kernel_variant_compiles_to_triton_ir(mode, paired, block_n):
    """The kernel's Triton IR for Hopper, built on the CPU (no GPU, no interpreter): the interpreter runs a kernel's
    Python, where a constexpr branch's ``return`` ends the function, while the compiler goes on past it, so a
    kernel can pass every interpreted test and still not compile (the paired steps' scales did, 128 wide)."""
    pytest.importorskip("triton")
    compiler = pytest.importorskip("triton.compiler")
    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget

    from flashoverlap.kernels import grouped_gemm

    kernel = grouped_gemm.scaled_grouped_gemm_kernel
    if not hasattr(kernel, "arg_names"):
        pytest.skip("Triton interprets kernels in this process")
    names = kernel.arg_names
    pointers = {"x": "*fp8e4nv", "x_scale": "*fp32", "w": "*fp8e4nv", "w_scale": "*fp32", "out": "*bf16",
                "table_ptr": "*i32"}
    constants = dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=128, BLOCK_S=16, GROUP_M=8, BLOCKWISE=mode == "block",
                     PAIR_K=paired)
    signature = {n: pointers.get(n, "constexpr" if n in constants else "i32") for n in names}
    source = compiler.ASTSource(kernel, signature, {(names.index(n),): v for n, v in constants.items()})
    target = GPUTarget("cuda", 90, 32)
    backend = nvidia.CUDABackend(target)
    options = backend.parse_options({"num_warps": 8, "num_stages": 3})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                            context)
    assert str(module).count("tt.dot") == (3 if paired else 1)  # paired: two per pair, one for an odd last step
