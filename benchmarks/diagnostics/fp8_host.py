"""Host time of an fp8 call beside the bf16 call of the same op and path, on one GPU and a one-rank NCCL group (one
process), on two paths: ``sequential`` (the default plan on one rank: the scaled matmul, or the matmul, then the
collective) and ``nccl`` (overlapped plans given to both: the signalling GEMM, fp8 or bf16, and a collective per
group; block-wise fp8 as its default plan runs it, cuBLAS bands of torch's block-wise scaled matmul). Neither path
replays calls from a CUDA graph, so the eager figure is the only one. Each fp8 call is first checked against
``torch._scaled_mm`` (the dequantised product block-wise). Timed interleaved (``host_us_interleaved``: GPU busy ahead,
medians), with the paired ratio ``fp8 / bf16`` per round.

CUDA_VISIBLE_DEVICES=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \
    torchrun --nproc-per-node 1 -m benchmarks.diagnostics.fp8_host [out.json]
"""

import torch
import torch.distributed as dist

import flashoverlap as fo
from benchmarks.diagnostics.results_file import require_cuda, results_meta, write_results
from benchmarks.harness.timing import host_us_interleaved
from flashoverlap.comm.scaled import BLOCK
from flashoverlap.tune.fp8 import fp8_tiles

M, N, K = 4096, 8192, 8192
E4M3 = torch.float8_e4m3fn
OPS = {"all_reduce": (fo.gemm_all_reduce, fo.scaled_gemm_all_reduce),
       "reduce_scatter": (fo.gemm_reduce_scatter, fo.scaled_gemm_reduce_scatter),
       "all_gather": (fo.all_gather_gemm, fo.all_gather_scaled_gemm)}


def scales(mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random positive scales of ``mode``'s shapes (fresh values: never all ones). Block-wise, B's are the transpose
    of an ``[N/128, K/128]`` weight scale, as a weight ``w [N, K]`` carries them (DeepSeek-V3's checkpoints, torchao)
    and as ``b = w.t()`` then has them; A's are row-major ``[M, K/128]``, as an activation's quantisation gives."""
    if mode == "block":
        return (torch.rand(M, K // BLOCK, device="cuda") / 64 + 1e-3,
                (torch.rand(N // BLOCK, K // BLOCK, device="cuda") / 64 + 1e-3).t())
    sa, sb = {"tensor": ((), ()), "row": ((M, 1), (1, N))}[mode]
    return torch.rand(sa, device="cuda") / 64 + 1e-3, torch.rand(sb, device="cuda") / 64 + 1e-3


def main() -> None:
    require_cuda("benchmarks.diagnostics.fp8_host", path_only=True)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    group = dist.group.WORLD
    assert group.size() == 1, "one process, a one-rank group"
    a = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(N, K, dtype=torch.bfloat16, device="cuda")
    a8, w8 = (a * 16).to(E4M3), (w * 16).to(E4M3)
    rows = []
    for (op, (bf16_op, fp8_op)), path in ((item, path) for path in ("sequential", "nccl") for item in OPS.items()):
        for mode in ("tensor", "row", "block"):
            sa, sb = scales(mode)
            if path == "sequential":
                bf16, fp8 = bf16_op, fp8_op
            else:
                plan16 = fo.default_plan(op, M, N, K, 1, allow_sequential=False)
                plan8 = fo.default_plan(op, M, N, K, 1, tile=fp8_tiles(M, N, K, mode, op).tile_config(),
                                        allow_sequential=False, gemm="cublas" if mode == "block" else "triton")

                def bf16(*args, f=bf16_op, plan=plan16, **kw):
                    return f(*args, plan=plan, path="nccl", **kw)

                def fp8(*args, f=fp8_op, plan=plan8, **kw):
                    return f(*args, plan=plan, path="nccl", **kw)
            for _ in range(3):  # plans resolved, kernels loaded, NCCL warm
                bf16(a, w.t(), group=group)
                fp8(a8, w8.t(), sa, sb, group=group)
            got = fp8(a8, w8.t(), sa, sb, group=group)
            if mode == "block":
                deq_a = a8.float() * sa.repeat_interleave(BLOCK, 1)
                deq_b = w8.t().float() * sb.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
                want = (deq_a @ deq_b).to(torch.bfloat16)
            else:
                want = torch._scaled_mm(a8, w8.t(), sa, sb, out_dtype=torch.bfloat16)
            error = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert not got.isnan().any() and error < 1e-2, f"{op} {mode}: relative error {error}"
            us = host_us_interleaved({"bf16": lambda bf16=bf16: bf16(a, w.t(), group=group),
                                      "fp8": lambda fp8=fp8, sa=sa, sb=sb: fp8(a8, w8.t(), sa, sb, group=group)},
                                     calls=60, pairs=(("fp8", "bf16"),))
            row = {"op": op, "path": path, "scaling": mode, "M": M, "N": N, "K": K, "mode": "eager",
                   "host_us_bf16": round(us["bf16"], 1), "host_us_fp8": round(us["fp8"], 1),
                   "fp8_over_bf16": round(us["fp8 / bf16"], 3), "relative_error": error}
            print(row, flush=True)
            rows.append(row)
    write_results({"meta": results_meta("torchrun --nproc-per-node 1 -m benchmarks.diagnostics.fp8_host",
                                        world_size=1), "rows": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
