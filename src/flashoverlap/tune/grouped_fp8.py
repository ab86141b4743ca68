"""The fp8 expert paths' grouped-GEMM policy: which way multiplies an fp8 call's chunks
(``comm/expert/scaled.scaled_multiply``):

- ``"triton"``: ours, ``kernels.grouped_gemm.scaled_grouped_gemm`` per chunk (row-wise and block-wise scales);
- ``"cublas"``: ``torch._scaled_grouped_mm`` per chunk (row-wise only; 16-byte multiples; sm90);
- ``"loop"``: a ``torch._scaled_mm`` per non-empty segment (exact mode only: the sizes must be on the host).

Fitted on one H200 (torch 2.11, Triton 3.6; ``benchmarks/results/h200x1-fp8-grouped.json``, the six configs of issue
44's table, balanced and Zipf(1.2) routing, row- and block-wise) and validated on two configs it was not fitted on
(DeepSeek-V3's down projection, Qwen3-235B-A22B's up): ours was the fastest of the three ways at every config but
Mixtral-8x22B's (4 local experts of 4,096 rows each, N = 32,768), where cuBLAS per expert wins block-wise (5.0 ms
against ours 11.6; row-wise, since ours takes 128x256 tiles, ours wins there too: 4.5 against 4.8, at 792979c751);
``torch._scaled_grouped_mm`` was never the fastest. One term separates them block-wise: the mean rows per local
expert, ``LOOP_MIN_ROWS`` and above (measured: 4,096 and above the loop, 1,024 and below ours). The loop needs the
sizes on the host (exact mode); block-wise, a segment whose rows cuBLAS's block-wise kernel refuses falls back to the
dequantised product (Zipf-routed Qwen2-57B: 40 ms against ours 2.5), so the rule sends only few, large experts to it.
"""

from __future__ import annotations

from flashoverlap.tune.grouped import GroupedCall

WAYS = ("triton", "cublas", "loop")
# Mean rows per local expert from which the per-expert loop beats ours block-wise (between 1,024 and 4,096). Row-wise
# ours wins everywhere since its 128x256 tile (Mixtral-8x22B: 4.5 ms against the loop's 4.8; 792979c751).
LOOP_MIN_ROWS = 2048
FITTED_FROM = "benchmarks/results/h200x1-fp8-grouped.json (one H200, torch 2.11, Triton 3.6; set 'fit')"


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


def expert_gemm_fp8(call: GroupedCall, scaling: str, *, mode: str, device_capability: tuple[int, int] | None,
                    triton: bool = True) -> tuple[str, None]:
    """The plan's ``(gemm, None)`` for an fp8 expert call (``scaling`` ``"row"`` or ``"block"``; ``mode`` ``"exact"``
    or ``"bounded"``): block-wise, the loop for few, large experts (``LOOP_MIN_ROWS``) where the sizes are on the host;
    else ours, else torch's grouped kernel. No hybrid in fp8 (yet)."""
    ways = allowed_fp8_ways(scaling, call.k, call.n, host_counts=mode == "exact",
                            device_capability=device_capability, triton=triton)
    experts = max(len(call.rows_per_expert), 1)
    if "loop" in ways and scaling == "block" and call.rows / experts >= LOOP_MIN_ROWS:
        return "loop", None
    return ("triton" if "triton" in ways else ways[0]), None
