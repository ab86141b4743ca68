"""Where the host time of a call that runs the sequential plan goes, on one GPU and a one-rank NCCL group (one process:
the sequential plan needs no peer). Each op's public call is timed interleaved
(``bench.timing.host_us_interleaved``: GPU busy ahead, medians) beside the same work issued directly (``torch.mm``
plus the collective, the outputs allocated as the op allocates them), ``torch.mm`` alone, and the parts our call
adds in front of that work, each alone: the runtime's whole body (``runtime.calls.execute``), the sequential
communicator's ``run`` of a prepared call, a ``Call``'s construction, the custom-op test (``library.needed``), the
device check (``guards.on_current_device``), the capture guard (the replay verdict's), ``torch.matmul`` in place of
``torch.mm``, and the op's collective alone, through ``torch.distributed`` and as the sequential communicator issues
it (``collectives.*_now``). A cProfile of 50 calls of ours follows per op.

CUDA_VISIBLE_DEVICES=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \
    torchrun --nproc-per-node 1 -m benchmarks.diagnostics.sequential_host [out.json]
"""

import cProfile
import io
import json
import pstats
import sys

import torch
import torch.distributed as dist

import flashoverlap as fo
from benchmarks.diagnostics.p2p_one_gpu import direct_call
from benchmarks.diagnostics.results_file import require_cuda, results_meta, write_results
from benchmarks.harness.timing import host_us_interleaved
from flashoverlap import guards, settings
from flashoverlap.comm import collectives
from flashoverlap.comm.protocol import Call
from flashoverlap.ops import library
from flashoverlap.runtime import calls

M, N, K = 4096, 8192, 8192
PUBLIC = {"all_reduce": (fo.gemm_all_reduce, "gemm_all_reduce"),
          "reduce_scatter": (fo.gemm_reduce_scatter, "gemm_reduce_scatter"),
          "all_gather": (fo.all_gather_gemm, "all_gather_gemm")}


def op_row(op, public, name, group) -> dict:
    """One op's row, printed, then a cProfile of 50 calls of ours."""
    assert group.size() == 1, "one process, a one-rank group: the shard is the whole input"
    a = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(N, K, dtype=torch.bfloat16, device="cuda").t()
    for _ in range(3):  # plan resolved, kernels loaded, NCCL warm
        public(a, b, group=group)
        direct_call(op, a, b, group, M)
    ours, direct = public(a, b, group=group), direct_call(op, a, b, group, M)  # the same work, the same result
    assert not torch.isnan(ours).any(), f"{op}: NaN in ours"
    # bitwise equal where both run the same cuBLAS kernel (ours replayed from a graph from the third call on)
    apart = ((ours.float() - direct.float()).norm() / direct.float().norm()).item()
    assert apart < 1e-2, f"{op}: ours differs from the direct call ({apart:.2e})"
    torch.cuda.synchronize()
    _, context, plan = calls.resolve(calls.GemmSpec(name, op, a, b, group), settings.current().nccl_p2p_disabled)
    assert plan.sequential, f"{op}: the call at this shape does not run the sequential plan"
    comm = context.communicator("gemm", "sequential")
    call = Call(name, plan, a, b, False, None, None, False)  # an eager call (replay=False)
    c = torch.mm(a, b)
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    gathered = torch.empty(M, K, dtype=a.dtype, device=a.device)
    collective = {  # the op's collective alone: through torch.distributed, and issued straight
        "all_reduce": (lambda: dist.all_reduce(c, group=group), lambda: collectives.all_reduce_now(c, group)),
        "reduce_scatter": (lambda: collectives.reduce_scatter_tensor(out, c, group),
                           lambda: collectives.reduce_scatter_now(out, c, group)),
        "all_gather": (lambda: collectives.all_gather_into_tensor(gathered, a, group),
                       lambda: collectives.all_gather_now(gathered, a, group)),
    }[op]
    parts = {
        "ours": lambda: public(a, b, group=group),
        "direct": lambda: direct_call(op, a, b, group, M),
        "torch.mm": lambda: torch.mm(a, b),
        "torch.matmul": lambda: torch.matmul(a, b),
        "execute": lambda: calls.execute(calls.GEMM, calls.GemmSpec(name, op, a, b, group)),
        "communicator.run": lambda: comm.run(call),
        "collective (torch.distributed)": collective[0],
        "collective (issued straight)": collective[1],
        "Call(...)": lambda: Call(name, plan, a, b, False, None, None, False),
        "library.needed": lambda: library.needed(name, (a, b)),
        "capture guard": lambda: guards.capturing(a),
        "device check": lambda: guards.on_current_device(a),
    }
    us = host_us_interleaved(parts, calls=60, pairs=(("ours", "direct"),))
    paired = us.pop("ours - direct")
    us.pop("ours / direct")
    row = {"op": op, "M": M, "N": N, "K": K, "relative_difference": apart,
           **{key: round(value, 1) for key, value in us.items()}}
    row["ours - direct"] = round(us["ours"] - us["direct"], 1)
    row["ours - direct, paired"] = round(paired, 1)  # the median of each round's difference
    print(json.dumps(row), flush=True)
    profile = cProfile.Profile()
    for _ in range(50):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)
        profile.enable()
        public(a, b, group=group)
        profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
    print(f"== {op}: cProfile of 50 calls\n" + "\n".join(
        line for line in text.getvalue().splitlines() if line.strip()), flush=True)
    return row


def main() -> int:
    require_cuda("benchmarks.diagnostics.sequential_host", path_only=True)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    rows = [op_row(op, public, name, dist.group.WORLD) for op, (public, name) in PUBLIC.items()]
    torch.cuda.synchronize()
    command = "torchrun --nproc-per-node 1 -m benchmarks.diagnostics.sequential_host OUT.json"
    write_results({"meta": results_meta(command), "rows": rows})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
