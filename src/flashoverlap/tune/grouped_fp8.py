"""The fp8 expert paths' grouped-GEMM policy (``tune/grouped.py``'s model, extended to fp8): which way multiplies an
fp8 call's chunks (``comm/expert/scaled.scaled_multiply``):

- ``"triton"``: ours, ``kernels.grouped_gemm.scaled_grouped_gemm`` per chunk (row-wise and block-wise scales);
- ``"cublas"``: ``torch._scaled_grouped_mm`` per chunk (row-wise only; 16-byte multiples; sm90);
- ``"loop"``: a ``torch._scaled_mm`` per non-empty segment (exact mode only: the sizes must be on the host).

The cost model is ``tune/grouped.py``'s (a roofline per kernel, launch and tile terms, host time per call) with fp8's
coefficients (``FP8_COSTS``, 1 byte per element), plus one term the issue's measurements ask for: torch's fp8 grouped
kernel runs at about half its rate, below bf16 ``torch._grouped_mm``, where the experts are small (Qwen3-30B-A3B at
W = 2, 64 local experts, H 2048 / F 768: 254 and 212 TFLOP/s up / down, against 906-1,073 at H >= 2880 and F >=
1536; one H200, torch 2.11). Until the fit (``benchmarks/diagnostics/fp8_grouped.py`` measures the three ways and the
bf16 one), ``"cublas"`` takes ``small_tflops`` where ``min(K, N) < FAST_MIN_DIM``. These starting coefficients are
a guess from that table, not a fit: refit from ``benchmarks/results/h200x1-fp8-grouped.json``.
"""

from __future__ import annotations

import dataclasses

from flashoverlap.tune.grouped import GroupedCall, WayCosts, cost_ms

WAYS = ("triton", "cublas", "loop")
FAST_MIN_DIM = 2048  # torch's fp8 grouped kernel's small-expert regime: min(K, N) below this
FITTED_FROM = "not fitted: starting values from issue 44's table (one H200, torch 2.11)"
FP8_COSTS: dict[str, WayCosts] = {
    "triton": WayCosts(tflops=900.0, tbps=4.2, pad_rows=128, kernel_us=15.0, tile_us=0.015, host_us=190.0),
    "cublas": WayCosts(tflops=960.0, tbps=4.0, pad_rows=128, kernel_us=8.0, tile_us=0.06, host_us=60.0),
    "loop": WayCosts(tflops=1000.0, tbps=4.0, pad_rows=64, kernel_us=5.0, tile_us=0.001, host_us=25.0),
}
SMALL_TFLOPS = {"cublas": 230.0}  # the rate of a way in the small-expert regime (FAST_MIN_DIM)


def fp8_call(call: GroupedCall) -> GroupedCall:
    """``call`` with fp8's 1 byte per element (the model's bytes)."""
    return dataclasses.replace(call, itemsize=1)


def way_costs(way: str, call: GroupedCall, costs: dict[str, WayCosts] | None = None) -> WayCosts:
    """``way``'s coefficients for ``call``'s shape: ``SMALL_TFLOPS`` where ``min(K, N) < FAST_MIN_DIM``."""
    base = (FP8_COSTS if costs is None else costs)[way]
    if way in SMALL_TFLOPS and min(call.k, call.n) < FAST_MIN_DIM:
        return dataclasses.replace(base, tflops=SMALL_TFLOPS[way])
    return base


def allowed_fp8_ways(scaling: str, k: int, n: int, *, host_counts: bool,
                     device_capability: tuple[int, int] | None = None, triton: bool = True) -> tuple[str, ...]:
    """The ways that can run: ``"cublas"`` row-wise with 16-byte multiples on sm90 (or unknown); ``"loop"`` where the
    sizes are on the host (exact mode); ``"triton"`` where Triton is installed (bounded mode without it: the loop
    cannot run, so ``"cublas"`` where allowed, else ``"triton"`` all the same and the path falls back)."""
    ways = ["triton"] if triton else []
    if scaling == "row" and k % 16 == 0 and n % 16 == 0 and device_capability in (None, (9, 0)):
        ways.append("cublas")
    if host_counts:
        ways.append("loop")
    return tuple(ways) or ("triton",)


def cost_fp8_ms(way: str, call: GroupedCall, costs: dict[str, WayCosts] | None = None) -> float:
    """The model's cost of ``way`` for an fp8 ``call`` (ms): ``tune.grouped.cost_ms`` with ``way_costs``."""
    call = fp8_call(call)
    return cost_ms(way, call, way_costs(way, call, costs))


def expert_gemm_fp8(call: GroupedCall, scaling: str, *, mode: str, device_capability: tuple[int, int] | None,
                    triton: bool = True, costs: dict[str, WayCosts] | None = None) -> tuple[str, None]:
    """The plan's ``(gemm, None)`` for an fp8 expert call (``scaling`` ``"row"`` or ``"block"``; ``mode`` ``"exact"``
    or ``"bounded"``): the cheapest allowed way by ``cost_fp8_ms``. No hybrid in fp8 (yet)."""
    ways = allowed_fp8_ways(scaling, call.k, call.n, host_counts=mode == "exact",
                            device_capability=device_capability, triton=triton)
    return min(ways, key=lambda way: cost_fp8_ms(way, call, costs)), None
