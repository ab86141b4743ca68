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
# The block-wise cases again at two more tile widths: 64 (the weight's scale one scalar per step, and a tile that
# starts mid-block: its block is ``off_n // 128``) and 256 (one scale per column: N = 200 spans two blocks).
WIDTHS = {"64": (16, 64), "256": (16, 256)}


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


def _wide(case, width: str) -> dict:
    from flashoverlap.kernels.grouped_gemm import GroupedTile

    block_m, block_n = WIDTHS[width]
    return _run(case, tile=GroupedTile(block_m, block_n, 128, 2, 1, 4, None))


if __name__ == "__main__":
    rows = {case[0]: _run(case) for case in CASES}
    rows |= {f"{case[0]}-{width}-wide": _wide(case, width) for case in CASES if case[1] == "block"
             for width in WIDTHS}
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
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("case", [c for c in CASES if c[1] == "block"], ids=[c[0] for c in CASES if c[1] == "block"])
def test_interpreted_block_scales_at_other_tile_widths(interpreted, case, width):
    row = interpreted[f"{case[0]}-{width}-wide"]
    tol = 1e-2 if row["dtype"] == "bfloat16" else 1e-5
    assert row["err"] <= tol, row
    assert row["untouched"], f"{case[0]} {width} wide: rows no segment covers were written"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode,block_n", [("row", None), ("block", None), ("block", 256)])
def test_gpu_fp8_grouped_gemm(mode, block_n):
    import dataclasses

    from flashoverlap.kernels.grouped_gemm import SCALED_TILE, SCALED_TILE_ROW

    case = ("gpu-" + mode, mode, 8, 1152, 768, [(None, e) for e in (300, 300, 1100, 1500, 2047, 3000, 3001, 4000)],
            [3, 1, 0, 7, 2, 5, 4, 6], True, True, "bfloat16")  # K = 9 steps of 128
    tile = SCALED_TILE_ROW if mode == "row" else SCALED_TILE
    row = _run(case, "cuda", tile if block_n is None else dataclasses.replace(tile, block_n=block_n))
    assert row["err"] <= 1e-2 and row["untouched"], row


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode,kernel", [("row", "scaled"), ("block", "scaled"), ("block", "block_scaled")])
def test_gpu_new_row_counts_launch_directly_and_right(mode, kernel):
    """An exact-mode expert call's rows change with every routing: row counts of one integer class (here none a
    multiple of 16) share the compiled kernels (``kernels/launch.py``), so after the first call every launch of the
    kernel that runs the call (the Triton one; block-wise with K-major weights on Hopper, the Gluon one) goes direct,
    and each call's values are still right (the fp64 oracle; rows no segment covers untouched)."""
    from flashoverlap.kernels import block_scaled, grouped_gemm

    gluon = kernel == "block_scaled"
    if gluon and (torch.cuda.get_device_capability() != (9, 0) or block_scaled.gluon_missing() is not None):
        pytest.skip("the Gluon kernel is Hopper's (sm_90, Triton with Gluon)")
    launcher = grouped_gemm._BLOCK_LAUNCH if gluon else grouped_gemm._SCALED_LAUNCH
    other = "scaled" if gluon else "block_scaled"
    tile = grouped_gemm.scaled_tile(mode, gluon, 512)
    calls = [(0, 300, 301, 1400, 2997), (9, 9, 650, 1800, 2018), (0, 1, 130, 131, 770)]  # rows 3000, 2021, 773
    direct = []
    for ends in calls:
        before, fast = grouped_gemm.launches(), launcher.fast_launches
        case = (f"new-rows-{ends[-1]}", mode, 4, 512, 200, [(None, e) for e in ends], [3, 1, 0, 2, 1],
                gluon or mode == "row", False, "bfloat16")  # N-major weights keep block-wise on the Triton kernel
        row = _run(case, "cuda", tile)
        assert row["err"] <= 1e-2 and row["untouched"], row
        after = grouped_gemm.launches()
        assert (after[kernel] - before[kernel], after[other] - before[other]) == (1, 0), (before, after)
        direct.append(launcher.fast_launches - fast)
    assert direct[1:] == [1, 1], direct


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed-rows"])
@pytest.mark.parametrize("block_m", [128, 64])
def test_gpu_block_scales_through_the_gluon_kernel(block_m, packed):
    """Block-wise on Hopper with K a multiple of 256 and K-major weights: the Gluon kernel (kernels/block_scaled.py)
    runs the call (its launcher launched, the Triton kernel's not), on segments of every kind (empty, one row, one
    tile, many; N = 200 leaves a part tile whose columns read the next expert's weights), values against the fp64
    oracle, rows no segment covers untouched; twice, so the second launch goes through the compiled launcher."""
    from flashoverlap.kernels import block_scaled, grouped_gemm
    from flashoverlap.kernels.grouped_gemm import GroupedTile

    if torch.cuda.get_device_capability() != (9, 0) or block_scaled.gluon_missing() is not None:
        pytest.skip("the Gluon kernel is Hopper's (sm_90, Triton with Gluon)")
    fp8 = torch.empty(64, 2048, dtype=FP8, device="cuda")
    weights = torch.empty(2, 256, 2048, dtype=FP8, device="cuda").transpose(1, 2)
    assert block_scaled.applies(fp8, weights)
    assert not block_scaled.applies(fp8.bfloat16(), weights.bfloat16())  # not fp8: the Triton kernel's
    assert not block_scaled.applies(fp8[:, :1152], weights[:, :1152])  # 9 steps: the pairs need an even count
    assert not block_scaled.applies(fp8[:1].expand(64, 2048), weights)  # rows that overlap
    assert not block_scaled.applies(fp8, weights.contiguous())  # N-major weights
    ends = (0, 1, 130, 130, 700, 1500, 2047, 3000)
    case = ("gpu-gluon", "block", 8, 2048, 200, [(None, e) for e in ends], [3, 1, 0, 7, 2, 5, 4, 6], True, packed,
            "bfloat16")
    tile = GroupedTile(block_m, 128, 128, 8, 4, 8 if block_m == 128 else 4, None)
    before = grouped_gemm.launches()
    for _ in range(2):
        row = _run(case, "cuda", tile)
        assert row["err"] <= 1e-2 and row["untouched"], row
    after = grouped_gemm.launches()
    assert after["block_scaled"] == before["block_scaled"] + 2 and after["scaled"] == before["scaled"]


def _facts(tile, mode):
    """``kernel_facts.fp8_kernel_facts``: the kernel compiled for Hopper on this machine (no GPU needed)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from benchmarks.diagnostics.kernel_facts import fp8_kernel_facts
    from flashoverlap.kernels import grouped_gemm

    if not hasattr(grouped_gemm.scaled_grouped_gemm_kernel, "arg_names"):
        pytest.skip("Triton interprets kernels in this process")
    return fp8_kernel_facts(tile, mode)


@pytest.mark.parametrize("block_n", [64, 128, 256])
@pytest.mark.parametrize("mode", ["row", "block"])
def test_every_fp8_kernel_variant_compiles_for_hopper(mode, block_n):
    """The kernel compiled for sm_90 on the CPU, down to the cubin: the interpreter runs a kernel's Python, where a
    constexpr branch's ``return`` ends the function, while the compiler goes on past it, so a kernel can pass every
    interpreted test and still not compile (the scales helper once did, 128 wide). And what its speed rests on: the
    loads multi-buffered; row-wise, the MMA kept in flight across K steps (a wait that leaves one pending) and the
    scales applied once, after the loop (two tile-sized multiplies); block-wise, one tile-sized multiply per K step
    where the tile lies in one 128-wide weight-scale block, two where its columns span several."""
    from flashoverlap.kernels.grouped_gemm import GroupedTile

    facts = _facts(GroupedTile(128, block_n, 128, 8, 3, 8, 0), mode)
    assert facts["async_loads"] > 0, facts
    if mode == "row":
        assert 1 in facts["mma_waits"] and facts["scale_multiplies"] == 2, facts
    else:
        assert facts["scale_multiplies"] == (1 if block_n <= 128 else 2), facts


@pytest.mark.parametrize("block_m", [128, 64])
def test_the_gluon_block_kernel_keeps_each_mma_in_flight_on_hopper(block_m):
    """The Gluon block-wise kernel compiled for sm_90 on the CPU, down to the cubin, and assembled again by ptxas
    with ``-v``: each step's MMA left outstanding while the step before it is scaled (waits that leave one
    pending), ptxas not serialising the MMAs (its warning C7514, which a product read across the loop's back edge
    after such a wait drew), no spills, and the default tile's registers and shared memory fitting a program per SM
    (two of the 64-row one)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from benchmarks.diagnostics.kernel_facts import block_scaled_facts
    from flashoverlap.kernels import block_scaled
    from flashoverlap.kernels.grouped_gemm import SCALED_TILE_HOPPER, SCALED_TILE_HOPPER_SHORT_K

    if block_scaled.gluon_missing() is not None:
        pytest.skip(f"no Gluon here: {block_scaled.gluon_missing()}")
    tile = SCALED_TILE_HOPPER if block_m == 128 else SCALED_TILE_HOPPER_SHORT_K
    facts = block_scaled_facts(tile)
    assert facts["mma_waits"].count(1) >= 2 and not facts["serialised"], facts
    assert facts["spill_bytes"] == 0 and facts["programs_per_sm_fit"] >= (1 if block_m == 128 else 2), facts


def test_the_gluon_kernel_is_not_taken_with_a_triton_older_than_it_was_checked_on():
    """Gluon's API moved between releases: below Triton 3.6 the module reports Gluon missing (``applies`` is then
    False everywhere and the Triton kernel runs)."""
    import subprocess

    pytest.importorskip("triton")
    code = ("import triton; triton.__version__ = '3.5.1'; from flashoverlap.kernels import block_scaled as b; "
            "print(b.gluon_missing())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "needs triton >= 3.6, found 3.5.1" in out, out


def test_the_launchers_own_fp8_tile_by_mode_kernel_and_k():
    """``scaled_tile``: row-wise one tile; block-wise the Triton kernel's where the Gluon kernel does not apply, and
    the Gluon kernel's two (short K: 64 rows, two programs an SM), each one the Gluon kernel runs."""
    from flashoverlap.kernels import block_scaled
    from flashoverlap.kernels.grouped_gemm import (
        SCALED_TILE,
        SCALED_TILE_HOPPER,
        SCALED_TILE_HOPPER_SHORT_K,
        SCALED_TILE_ROW,
        scaled_tile,
    )

    assert scaled_tile("row", False, 768) is SCALED_TILE_ROW and scaled_tile("block", False, 768) is SCALED_TILE
    assert scaled_tile("block", True, 768) is SCALED_TILE_HOPPER_SHORT_K  # Qwen3-30B-A3B's down projection
    assert scaled_tile("block", True, 2048) is SCALED_TILE_HOPPER
    assert block_scaled.fits(SCALED_TILE_HOPPER) and block_scaled.fits(SCALED_TILE_HOPPER_SHORT_K)


@pytest.mark.parametrize("mode", ["row", "block"])
def test_the_default_fp8_tiles_launch_without_spilling(mode):
    from flashoverlap.kernels.grouped_gemm import SCALED_TILE, SCALED_TILE_ROW

    facts = _facts(SCALED_TILE_ROW if mode == "row" else SCALED_TILE, mode)
    assert facts["programs_per_sm_fit"] >= 1 and facts["spill_bytes"] == 0, facts
    if mode == "block":  # chosen so that two programs share an SM: one's MMA beside the other's scaling
        assert facts["programs_per_sm_fit"] >= 2, facts
