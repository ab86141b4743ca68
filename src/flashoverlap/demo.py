"""``flashoverlap demo [--op OP] [--shape ...]``: one op on every GPU (two or more; else 2 CPU processes, or
``--world-size`` ranks), checked against plain PyTorch; it prints the path that ran and exits non-zero on a
mismatch.

Ops, by their API names: ``gemm_all_reduce`` (the default), ``gemm_reduce_scatter``, ``all_gather_gemm``, each
``[M, K] @ [K, N]`` with ``B`` the transposed view of an ``nn.Linear`` weight; their fp8 forms
``scaled_gemm_all_reduce``, ``scaled_gemm_reduce_scatter``, ``all_gather_scaled_gemm`` (the same inputs cast to
float8_e4m3fn with row-wise scales, bf16 output, against ``torch._scaled_mm`` and the collective); ``moe`` (or
``moe_dispatch_gemm``, ``moe_gemm_combine``): one expert-parallel SwiGLU layer's calls (``moe_layout``,
``moe_dispatch_gemm``, the activation, ``moe_gemm_combine``) on each rank's own tokens, against the same MoE
computed by the rank alone from every expert's weights (``--shape T,H,F``: tokens per rank, hidden, expert FFN; 4
experts per rank, top-2). The short names of earlier versions (``all_reduce``, ``scaled_all_gather``, ...:
``cli.DEMO_ALIASES``) still work, here too.

With two or more GPUs (and no ``--cpu``): NCCL ranks and ``path="auto"``, as a user's call takes it; the path the
library chose is read from its debug log (the ``flashoverlap`` logger names it once per group and op), and each
call is timed beside the plain code. Otherwise 2 CPU processes on gloo, where CPU tensors always take the reference
path (``torch.matmul`` and blocking collectives: nothing is overlapped, and no Triton or NCCL plan applies).

Only public names of the package are used here (``flashoverlap.*``, ``flashoverlap.testing.spawn``).
"""

from __future__ import annotations

import logging
import re
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashoverlap as fo
from flashoverlap.testing import spawn

# op (its API name; moe: the MoE layer's calls) -> (its collective, what it is checked against)
OPS = {"gemm_all_reduce": ("all_reduce", "matmul + all_reduce"),
       "gemm_reduce_scatter": ("reduce_scatter", "matmul + reduce_scatter"),
       "all_gather_gemm": ("all_gather", "all_gather + matmul"),
       "scaled_gemm_all_reduce": ("all_reduce", "torch._scaled_mm + all_reduce"),
       "scaled_gemm_reduce_scatter": ("reduce_scatter", "torch._scaled_mm + reduce_scatter"),
       "all_gather_scaled_gemm": ("all_gather", "all_gather + torch._scaled_mm"),
       "moe": ("all_to_all", "plain PyTorch, every expert on the token's own rank")}
MOE_CALLS = "moe_layout + moe_dispatch_gemm + moe_gemm_combine"
FP8 = torch.float8_e4m3fn

# (on GPUs, on the CPU): M, N, K; for moe tokens per rank, hidden, expert FFN (Mixtral-like on GPUs). The CPU's are
# small: there the demo shows the check and the path, not speed.
SHAPES = {"gemm": ((16384, 8192, 4096), (1024, 1024, 256)), "moe": ((4096, 4096, 14336), (256, 128, 256))}
EXPERTS_PER_RANK, TOP_K = 4, 2
# Sums of world_size products in the input dtype: a few units in the last place.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
QUEUE_AHEAD_CYCLES = 3_000_000  # GPU sleep queued before each timed call (~1.5 ms on an H200): host time hidden
REFERENCE = "reference (CPU, gloo): torch.matmul and blocking collectives, nothing overlapped; no Triton or NCCL plan"


class _PathLog(logging.Handler):
    """The path the library logs for a ``path="auto"`` call (``flashoverlap`` logger, debug level)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.paths: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r"path='auto' uses (\S+) for \S+ on .*?: (.*)", record.getMessage())
        if found:
            self.paths.append(f"{found[1]} (path='auto': {found[2]})")


def _chosen_path(call) -> tuple[object, str]:
    """``call()``'s result and the path the library says it chose (GPU calls; the first call of an op on a group)."""
    logger, handler = logging.getLogger("flashoverlap"), _PathLog()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        result = call()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return result, handler.paths[0] if handler.paths else "auto (the library did not report its choice)"


def _time_ms(fns: dict, iters: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median GPU time per call of each function (CUDA events), interleaved call by call, each queued behind a GPU
    sleep so that its host time is hidden as inside a model; the slowest rank's."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(iters):
        for name in list(fns)[:: 1 if i % 2 else -1]:  # alternate which goes first
            dist.barrier()
            torch.cuda.synchronize()
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
            start.record()
            fns[name]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    medians = torch.tensor([statistics.median(t) for t in times.values()], device="cuda")
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(fns, medians.tolist()))


def _to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as float8_e4m3fn with one fp32 scale per row (``[rows, 1]``)."""
    scale = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / torch.finfo(FP8).max
    return (x.float() / scale).to(FP8), scale


def _plain(op: str, a: torch.Tensor, b: torch.Tensor, scales: tuple | None = None) -> torch.Tensor:
    """The plain PyTorch code: ``torch.matmul`` (fp8: ``torch._scaled_mm``) and the collective, one after the
    other."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def mm(a, scale_a):
        if scales is None:
            return a @ b
        return torch._scaled_mm(a, b, scale_a, scales[1], out_dtype=torch.bfloat16)

    if op == "all_gather":
        shards = [torch.empty_like(a.view(torch.uint8) if scales else a) for _ in range(world)]
        dist.all_gather(shards, (a.view(torch.uint8) if scales else a).contiguous())
        if scales is None:
            return torch.cat(shards) @ b
        row_scales = [torch.empty_like(scales[0]) for _ in range(world)]
        dist.all_gather(row_scales, scales[0])
        return mm(torch.cat(shards).view(a.dtype), torch.cat(row_scales))
    c = mm(a, None if scales is None else scales[0])
    dist.all_reduce(c)
    return c if op == "all_reduce" else c.chunk(world)[rank].contiguous()


def _api_name(op: str) -> str:
    """``op`` by its API name: the short names of earlier versions (``all_reduce``, ``scaled_all_gather``, ...)
    resolved as ``cli.DEMO_ALIASES`` resolves them (the command line resolves them before calling here)."""
    base = op.removeprefix("scaled_")
    if base not in ("all_reduce", "reduce_scatter", "all_gather"):
        return "moe" if op.startswith("moe") else op
    scaled = "scaled_" if base != op else ""
    return f"all_gather_{scaled}gemm" if base == "all_gather" else f"{scaled}gemm_{base}"


def _run_gemm(rank: int, world_size: int, op: str, m: int, n: int, k: int, dtype: torch.dtype,
              on_gpu: bool) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    op = _api_name(op)
    collective = OPS[op][0]
    rows = m // world_size if collective == "all_gather" else m  # all-gather: each rank holds its shard of the rows
    a = torch.randn(rows, k, dtype=dtype, device=device, generator=gen)
    w = torch.randn(n, k, dtype=dtype, device=device, generator=gen) / k**0.5
    fn, scales = getattr(fo, op), None
    if "scaled" in op:  # fp8 row-wise: each row of a and each row of w (column of b) its own scale
        (a, scale_a), (w, scale_w) = _to_fp8(a), _to_fp8(w)
        scales = (scale_a, scale_w.t())
    b = w.t()  # an nn.Linear weight's transposed view, as a parallel linear layer holds it

    def ours():
        return fn(a, b) if scales is None else fn(a, b, *scales)

    got, path = _chosen_path(ours) if on_gpu else (ours(), REFERENCE)
    want = _plain(collective, a, b, scales)
    out = {"path": path, "rel_err": float((got.double() - want.double()).norm() / want.double().norm()),
           "nan": bool(torch.isnan(got).any())}
    if on_gpu:
        out["times"] = _time_ms({"plain": lambda: _plain(collective, a, b, scales), "flashoverlap": ours})
    return out


def _run_moe(rank: int, world_size: int, tokens: int, hidden: int, ffn: int, dtype: torch.dtype,
             on_gpu: bool) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    experts, local = EXPERTS_PER_RANK * world_size, EXPERTS_PER_RANK
    shared = torch.Generator(device=device).manual_seed(7)  # every expert's weights, the same on every rank
    w_up = torch.randn(experts, hidden, 2 * ffn, dtype=dtype, device=device, generator=shared) / hidden**0.5
    w_down = torch.randn(experts, ffn, hidden, dtype=dtype, device=device, generator=shared) / ffn**0.5
    gen = torch.Generator(device=device).manual_seed(100 + rank)  # this rank's tokens and routing
    x = torch.randn(tokens, hidden, dtype=dtype, device=device, generator=gen)
    logits = torch.randn(tokens, experts, device=device, generator=gen)
    weights, topk_idx = logits.softmax(-1).topk(TOP_K, dim=-1)
    topk_weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    mine = slice(rank * local, (rank + 1) * local)  # this rank's experts

    def layer() -> torch.Tensor:
        routing = fo.moe_layout(topk_idx, experts)
        h = fo.moe_dispatch_gemm(x, w_up[mine], routing)
        return fo.moe_gemm_combine(F.silu(h[:, :ffn]) * h[:, ffn:], w_down[mine], topk_weights, routing)

    got = layer()
    want = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)  # the plain MoE, on this rank alone
    for e in range(experts):
        token, choice = torch.nonzero(topk_idx == e, as_tuple=True)
        h = x[token] @ w_up[e]
        y = (F.silu(h[:, :ffn]) * h[:, ffn:]) @ w_down[e]
        want.index_add_(0, token, y.float() * topk_weights[token, choice, None].float())
    path = "auto (the library does not report an expert call's path)" if on_gpu else REFERENCE
    return {"path": path, "rel_err": float((got.double() - want.double()).norm() / want.double().norm()),
            "nan": bool(torch.isnan(got).any())}


def main(shape: tuple[int, int, int] | None, dtype_name: str, world_size: int | None, cpu: bool,
         op: str = "gemm_all_reduce") -> int:
    op = _api_name(op)
    fp8 = "scaled" in op
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    on_gpu = gpus >= 2 and not cpu
    m, n, k = shape or SHAPES["moe" if op == "moe" else "gemm"][0 if on_gpu else 1]
    if world_size is None:
        world_size = gpus if on_gpu else 2
    if on_gpu and world_size > gpus:
        raise SystemExit(f"flashoverlap demo: --world-size {world_size} needs that many GPUs, found {gpus}")
    plural = "" if world_size == 1 else "s"
    where = f"{world_size} GPU{plural} (NCCL)" if on_gpu else \
        f"{world_size} CPU process{'' if world_size == 1 else 'es'} (gloo)"
    if OPS[op][0] in ("reduce_scatter", "all_gather") and m % world_size:
        which = f"--shape {m},{n},{k}" if shape else f"the default shape {m},{n},{k}"
        raise SystemExit(f"flashoverlap demo: {which}: {op} needs M divisible by the {world_size} ranks"
                         f"{'' if shape else '; pass --shape'}")
    dtype = getattr(torch, dtype_name)
    if op == "moe":
        print(f"flashoverlap demo: {MOE_CALLS}, {m} tokens per rank, hidden {n}, expert FFN {k}, "
              f"{EXPERTS_PER_RANK * world_size} experts, top-{TOP_K}, {dtype_name}, on {where}")
        fn, args = _run_moe, (m, n, k, dtype, on_gpu)
    else:
        cast = ", cast to float8_e4m3fn with row-wise scales," if fp8 else ""
        print(f"flashoverlap demo: {op} of [{m}, {k}] @ [{k}, {n}] {dtype_name}{cast} on {where}")
        fn, args = _run_gemm, (op, m, n, k, dtype, on_gpu)
    # No multicast on GPUs (docs/benchmarks.md); on the CPU the same environment as the caller's (the ranks then
    # fork from a server that imported torch, not fresh interpreters).
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"} if on_gpu \
        else None
    results = spawn(fn, world_size, "nccl" if on_gpu else "gloo", args=args, env=env)
    print(f"path: {results[0]['path']}")
    if "times" in results[0]:
        t = results[0]["times"]
        print(f"time: {OPS[op][1]} {t['plain']:.3f} ms, flashoverlap {t['flashoverlap']:.3f} ms "
              f"({t['plain'] / t['flashoverlap']:.2f}x; CUDA events, medians of 20 interleaved calls queued behind "
              "GPU work, the slowest rank)")
    worst = max(r["rel_err"] for r in results)
    tolerance = TOLERANCE[torch.bfloat16 if fp8 else dtype]  # fp8 ops: bf16 output
    ok = worst < tolerance and not any(r["nan"] for r in results)
    print(f"verdict: {'OK' if ok else 'MISMATCH'}: result vs {OPS[op][1]}, worst relative error over ranks "
          f"{worst:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":  # `python -m flashoverlap.demo ...` is `flashoverlap demo ...`
    import os
    import sys

    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "flashoverlap", "demo", *sys.argv[1:]])
