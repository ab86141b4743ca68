"""The expert paths' grouped-GEMM policy: which way multiplies a call's chunks, and where exact mode runs the
hybrid GEMM and how it cuts (``HybridCut``). Plain values in, the ``ExpertPlan``'s ``gemm`` and ``hybrid`` out;
``kernels/`` and ``comm/`` hold the mechanisms.

The ways: ``"triton"`` (``kernels.grouped_gemm`` per chunk), ``"cublas"`` (``torch._grouped_mm`` per chunk: bf16
rows of 16-byte multiples, sm90) and ``"loop"`` (``torch.mm`` per non-empty segment: the segment sizes must be on
the host, exact mode only). A call multiplies ``chunks`` chunks (one per source or destination rank), each holding
a segment per local expert; the model splits each expert's rows evenly over the chunks.

The cost model, per way, with the coefficients of ``WayCosts`` (fitted: ``grouped_costs.py``):

- GPU time: a roofline per kernel (Triton and cuBLAS: one per chunk; the loop: one per non-empty segment),
  ``max(padded FLOPs / tflops, bytes / tbps)``, where each segment's rows are rounded up to ``pad_rows`` (the tile
  height the way wastes on a segment's last tile) and the bytes are each multiplied expert's weights once per kernel
  plus the rows read and written; plus ``kernel_us`` per kernel and ``tile_us`` per ``pad_rows`` x 256 output tile.
  Skewed routing costs through its segments: many small ones (padding, launches) and few large ones.
- host time: ``host_us`` per call the way issues (a chunk; the loop: a segment).
- cost: the larger of the two. Behind a busy GPU a call's host time hides; a call whose GPU time is shorter than its
  host time leaves the GPU waiting on the host.

``choose_grouped_gemm`` takes the cheapest allowed way. The runtime chooses once per call signature, before any
routing is known: it passes the balanced rows of ``GroupedCall.balanced`` (a per-layout choice would need the
layout's counts on the host, which exact mode reads in its one synchronisation but does not keep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashoverlap.comm.expert.contract import HybridCut
from flashoverlap.tune import grouped_costs

WAYS = ("triton", "cublas", "loop")
TILE_COLUMNS = 256  # the output tile's width the tile term counts in (the Triton kernel's; cuBLAS's is similar)


@dataclass(frozen=True)
class WayCosts:
    """One way's fitted coefficients (see the module docstring): ``tflops`` and ``tbps`` the roofline's rates,
    ``pad_rows`` the rows a segment is rounded up to, ``kernel_us`` per kernel and ``tile_us`` per output tile of GPU
    time, ``host_us`` per call of host time."""

    tflops: float
    tbps: float
    pad_rows: int
    kernel_us: float
    tile_us: float
    host_us: float


COSTS: dict[str, WayCosts] = {way: WayCosts(**grouped_costs.COSTS[way]) for way in WAYS}


@dataclass(frozen=True)
class GroupedCall:
    """One grouped GEMM as the cost model reads it: ``rows_per_expert`` (each local expert's rows, summed over the
    chunks: a balanced or a skewed routing's counts), ``[rows, k] x [k, n]`` per expert, ``itemsize`` bytes per
    element, issued in ``chunks`` calls (one per source or destination rank)."""

    rows_per_expert: tuple[int, ...]
    k: int
    n: int
    itemsize: int = 2
    chunks: int = 1

    @classmethod
    def balanced(cls, experts: int, rows: int, k: int, n: int, itemsize: int = 2, chunks: int = 1) -> GroupedCall:
        """``rows`` shared as evenly as they go among ``experts`` experts."""
        experts = max(experts, 1)
        base, extra = divmod(max(rows, 0), experts)
        return cls(tuple(base + (e < extra) for e in range(experts)), k, n, itemsize, chunks)

    @property
    def rows(self) -> int:
        return sum(self.rows_per_expert)

    def segments(self) -> list[list[int]]:
        """Rows per (chunk, expert): each expert's rows split evenly over the chunks (the first take the rest)."""
        chunks = max(self.chunks, 1)
        return [[rows // chunks + (c < rows % chunks) for rows in self.rows_per_expert] for c in range(chunks)]


def kernels(way: str, call: GroupedCall, pad_rows: int) -> list[tuple[float, float, int]]:
    """The kernels ``way`` runs for ``call``: per kernel (padded FLOPs, bytes, output tiles)."""
    k, n, size = call.k, call.n, call.itemsize
    per_chunk = call.segments()
    groups = [[rows] for chunk in per_chunk for rows in chunk if rows] if way == "loop" else per_chunk
    tiles_n = -(-n // TILE_COLUMNS)
    out = []
    for group in groups:
        padded = sum(-(-rows // pad_rows) * pad_rows for rows in group)
        rows = sum(group)
        weights = sum(1 for r in group if r) * k * n
        out.append((2.0 * k * n * padded, float(size * (weights + rows * (k + n))), padded // pad_rows * tiles_n))
    return out


def host_calls(way: str, call: GroupedCall) -> int:
    """The calls ``way`` issues from the host: one per chunk, or one per non-empty segment (the loop)."""
    if way == "loop":
        return sum(1 for chunk in call.segments() for rows in chunk if rows)
    return max(call.chunks, 1)


def gpu_ms(way: str, call: GroupedCall, costs: WayCosts) -> float:
    """The model's GPU time of ``way`` for ``call`` (ms)."""
    total = 0.0
    for flops, nbytes, tiles in kernels(way, call, costs.pad_rows):
        total += max(flops / (costs.tflops * 1e9), nbytes / (costs.tbps * 1e9))  # ms
        total += (costs.kernel_us + costs.tile_us * tiles) / 1e3
    return total


def cost_ms(way: str, call: GroupedCall, costs: WayCosts) -> float:
    """The model's cost of ``way`` for ``call``: the larger of its GPU time and its host time (ms)."""
    return max(gpu_ms(way, call, costs), host_calls(way, call) * costs.host_us / 1e3)


def allowed_ways(dtype: torch.dtype, k: int, n: int, *, host_counts: bool,
                 device_capability: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The ways that can run: ``"cublas"`` only for bf16 with 16-byte aligned rows (``k % 8 == n % 8 == 0``) on sm90
    (where ``device_capability`` is given), ``"loop"`` only where the segment sizes are on the host
    (``host_counts``: exact mode)."""
    ways = ["triton"]
    if dtype == torch.bfloat16 and k % 8 == 0 and n % 8 == 0 and device_capability in (None, (9, 0)):
        ways.append("cublas")
    if host_counts:
        ways.append("loop")
    return tuple(ways)


def choose_grouped_gemm(call: GroupedCall, dtype: torch.dtype, *, host_counts: bool = False,
                        device_capability: tuple[int, int] | None = None,
                        costs: dict[str, WayCosts] | None = None) -> str:
    """The cheapest allowed way (``allowed_ways``) for ``call`` by ``cost_ms`` with ``costs`` (default: the fitted
    ``COSTS``). fp32, which the model was not fitted on: ``"triton"`` (as tf32)."""
    if dtype == torch.float32:
        return "triton"
    costs = COSTS if costs is None else costs
    ways = allowed_ways(dtype, call.k, call.n, host_counts=host_counts, device_capability=device_capability)
    return min(ways, key=lambda way: cost_ms(way, call, costs[way]))


# -- the hybrid GEMM ---------------------------------------------------------------------------------------------
# Where the expert paths run the hybrid GEMM in exact mode (``comm/expert/chunked_gemm.py``: heavy experts a mm per
# segment as chunks land, light ones once over every source's rows through a row map): many local experts with few
# rows each, where a grouped GEMM per source chunk streams every expert's weights once per source and is bound by
# that (DeepSeek-like slice at W = 2, 128 experts, 256 rows each: 0.74x torch._grouped_mm per chunk, 0.97x / 0.96x
# hybrid balanced and 1.23x / 1.21x with Zipf(1.2) routing, up / down:
# benchmarks/results/logs/issue20/moe-skew-streams-347ba74380.json). Qwen3-like (64 experts, 1024 rows each) and
# Mixtral-like (4 experts) slices stay per chunk, where they already run at 0.96-1.08x torch._grouped_mm.
HYBRID_MIN_EXPERTS = 32
HYBRID_MAX_ROWS_PER_EXPERT = 512
# The cut: an expert of at least 1024 rows over every source is heavy (the same measurements); the light launch
# takes the flattened persistent tile where the light experts average at least 256 rows (two full tile rows each:
# balanced DeepSeek-like, 0.996x / 0.987x torch._grouped_mm up / down against 0.954x / 0.945x with the default
# tile), the default tile below it (Zipf(1.2): 2-10% faster than the flattened loop there):
# benchmarks/results/logs/issue20/light-tiles-34c87d6c18.json.
HYBRID_CUT = HybridCut(heavy_rows=1024, light_flat_rows=256)


def hybrid_pays(*, experts: int, rows: int) -> bool:
    """Whether the expert paths' exact mode runs the hybrid GEMM for ``rows`` rows (``T * k``, about what a rank
    receives) over ``experts`` local experts (``HYBRID_MIN_EXPERTS``, ``HYBRID_MAX_ROWS_PER_EXPERT``)."""
    return experts >= HYBRID_MIN_EXPERTS and rows <= HYBRID_MAX_ROWS_PER_EXPERT * experts


def expert_gemm(call: GroupedCall, dtype: torch.dtype, *, mode: str, device_capability: tuple[int, int] | None,
                triton: bool = True) -> tuple[str, HybridCut | None]:
    """The plan's ``(gemm, hybrid)`` for an expert call of ``mode`` (``"exact"`` or ``"bounded"``): the hybrid (with
    ``HYBRID_CUT``) in exact mode where ``hybrid_pays``; otherwise ``choose_grouped_gemm`` (the loop in exact mode
    only). ``triton``: whether Triton is installed; where it is not, exact mode loops instead of Triton, and bounded
    mode takes ``torch._grouped_mm`` where this torch has it."""
    exact = mode == "exact"
    if exact and triton and hybrid_pays(experts=len(call.rows_per_expert), rows=call.rows):
        return "hybrid", HYBRID_CUT
    gemm = choose_grouped_gemm(call, dtype, host_counts=exact, device_capability=device_capability)
    if gemm == "triton" and not triton:
        if exact:
            return "loop", None
        if hasattr(torch, "_grouped_mm"):
            return "cublas", None
    return gemm, None
