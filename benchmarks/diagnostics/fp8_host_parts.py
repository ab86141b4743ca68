"""Where an fp8 sequential call's host time goes (issue 35's host target): on one GPU and a one-rank NCCL group (one
process), the host time of each piece such a call issues, beside torch's own calls, then the functions with the most
own time (cProfile) in the fp8 calls that trail their bf16 twins most (all-gather, block-wise). A diagnostic to
choose what to cut, not a library figure. Host times are ``host_us_interleaved`` medians (GPU busy ahead).

CUDA_VISIBLE_DEVICES=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src:. \
    torchrun --nproc-per-node 1 -m benchmarks.diagnostics.fp8_host_parts [out.json]
"""

import cProfile
import io
import pstats

import torch
import torch.distributed as dist

import flashoverlap as fo
from benchmarks.diagnostics.results_file import require_cuda, results_meta, write_results
from benchmarks.harness.timing import host_us_interleaved
from flashoverlap.comm import scaled
from flashoverlap.comm.collectives import all_gather_now, all_reduce_now
from flashoverlap.tune.timing import QUEUE_AHEAD_CYCLES

M, N, K = 4096, 8192, 8192
E4M3 = torch.float8_e4m3fn


def main() -> None:
    require_cuda("benchmarks.diagnostics.fp8_host_parts", path_only=True)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    group = dist.group.WORLD
    a16 = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    w16 = torch.randn(N, K, dtype=torch.bfloat16, device="cuda")
    a8, w8 = (a16 * 16).to(E4M3), (w16 * 16).to(E4M3)
    one = torch.rand((), device="cuda") / 64 + 1e-3
    s = {"tensor": (one, one.clone()),
         "row": (torch.rand(M, 1, device="cuda") / 64 + 1e-3, torch.rand(1, N, device="cuda") / 64 + 1e-3),
         "block": (torch.rand(M, K // 128, device="cuda") / 64 + 1e-3,
                   torch.rand(N // 128, K // 128, device="cuda").t() / 64 + 1e-3)}  # B: a weight's, transposed
    block_a_torch = s["block"][0].t().contiguous().t()
    c16 = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
    full16 = torch.empty(M, K, dtype=torch.bfloat16, device="cuda")
    tensor_scales = scaled.Scales.of(*s["tensor"])
    packed = scaled.pack_rows(a8, tensor_scales.rows_of_a(slice(0, M), M))
    gathered = torch.empty_like(packed)
    a_view, scale_view = scaled.unpack_rows(gathered, K, E4M3, 1)
    gathered.copy_(packed)
    parts = {
        "torch.mm": lambda: torch.mm(a16, w16.t()),
        "_scaled_mm tensor": lambda: torch._scaled_mm(a8, w8.t(), *s["tensor"], out_dtype=torch.bfloat16),
        "_scaled_mm row": lambda: torch._scaled_mm(a8, w8.t(), *s["row"], out_dtype=torch.bfloat16),
        "_scaled_mm block (torch's layout)": lambda: torch._scaled_mm(a8, w8.t(), block_a_torch, s["block"][1],
                                                                      out_dtype=torch.bfloat16),
        "block A scales to torch's layout": lambda: s["block"][0].t().contiguous().t(),
        "get_device_capability": lambda: torch.cuda.get_device_capability(a8.device),
        "all_reduce_now": lambda: all_reduce_now(c16, group),
        "all_gather_now bf16": lambda: all_gather_now(full16, a16, group),
        "pack_rows tensor": lambda: scaled.pack_rows(a8, tensor_scales.rows_of_a(slice(0, M), M)),
        "all_gather_now packed": lambda: all_gather_now(gathered, packed, group),
        "unpack_rows": lambda: scaled.unpack_rows(gathered, K, E4M3, 1),
        "scaled_mm of the gathered views": lambda: scaled.scaled_mm(a_view, w8.t(), tensor_scales, scale_view),
        "gemm_all_reduce bf16": lambda: fo.gemm_all_reduce(a16, w16.t(), group=group),
        "all_gather_gemm bf16": lambda: fo.all_gather_gemm(a16, w16.t(), group=group),
    }
    for mode, (sa, sb) in s.items():
        parts[f"scaled_gemm_all_reduce {mode}"] = lambda sa=sa, sb=sb: fo.scaled_gemm_all_reduce(a8, w8.t(), sa, sb,
                                                                                                group=group)
        parts[f"all_gather_scaled_gemm {mode}"] = lambda sa=sa, sb=sb: fo.all_gather_scaled_gemm(a8, w8.t(), sa, sb,
                                                                                                group=group)
    for fn in parts.values():  # plans resolved, kernels loaded, NCCL warm
        fn()
        fn()
    torch.cuda.synchronize()
    us = host_us_interleaved(parts, calls=40)
    for name, value in us.items():
        print(f"{value:8.1f} us  {name}", flush=True)
    profiles = {}
    for name in ("all_gather_scaled_gemm tensor", "scaled_gemm_all_reduce block", "all_gather_gemm bf16"):
        profiler = cProfile.Profile()
        for _ in range(30):
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
            profiler.enable()
            parts[name]()
            profiler.disable()
            torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
        profiles[name] = text.getvalue()
        print(f"== {name} (30 calls)\n{profiles[name]}", flush=True)
    write_results({"meta": results_meta("torchrun --nproc-per-node 1 -m benchmarks.diagnostics.fp8_host_parts",
                                        world_size=1, shape=[M, N, K]),
                   "host_us": {k: round(v, 1) for k, v in us.items()}, "profiles": profiles})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
