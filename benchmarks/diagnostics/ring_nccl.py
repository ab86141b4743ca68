"""The ring over NCCL send/recv (``path="ring"``) measured beside sequential and the NCCL path, at each grid shape
of each op, in whatever setting NCCL runs (``NCCL_P2P_DISABLE=1`` for pcie-like): E per path and host time.
Evidence for whether ``path="auto"`` should take the ring anywhere.

[NCCL_P2P_DISABLE=1] torchrun --nproc-per-node 2 -m benchmarks.diagnostics.ring_nccl OUT.json"""

import json
import os
import sys

import torch
import torch.distributed as dist

import flashoverlap as fo
from benchmarks.diagnostics.results_file import require_cuda
from benchmarks.harness.op_rows import GRID_ALL_GATHER, GRID_ALL_REDUCE
from flashoverlap.bench import efficiency
from flashoverlap.comm.collectives import all_gather_into_tensor, reduce_scatter_tensor
from flashoverlap.testing import plain
from flashoverlap.tune.timing import inputs, time_side_by_side

OPS = fo.ops.GEMM_OPS


def measure(op, m, n, k, world, rank):
    a, b = inputs(m // world if op == "all_gather" else m, n, k, torch.bfloat16, rank)
    fn = OPS[op]
    full = torch.empty(m, k, dtype=a.dtype, device=a.device)
    c = torch.matmul(full if op == "all_gather" else a, b)
    out = torch.empty(m // world, n, dtype=a.dtype, device=a.device)

    def collective():  # the op's collective alone, on the full result (all-gather: on the input)
        if op == "all_gather":
            all_gather_into_tensor(full, a, None)
        elif op == "reduce_scatter":
            reduce_scatter_tensor(out, c, None)
        else:
            dist.all_reduce(c)

    fns = {"gemm": lambda: torch.matmul(full if op == "all_gather" else a, b), "comm": collective,
           "seq": lambda: plain(op, a, b), "nccl": lambda: fn(a, b, path="nccl")}
    for sub in (2, 4):
        plan = fo.default_plan(op, m, n, k, world, num_groups=sub, path="ring", allow_sequential=False)
        fns[f"ring{sub}"] = lambda plan=plan: fn(a, b, plan=plan)
    host = {}
    t = time_side_by_side(fns, warmup=3, iters=20, host_us=host)
    ideal = max(t["gemm"], t["comm"])
    row = {"op": op, "M": m, "N": n, "K": k, "t": t, "host_us": host, "t_ideal_ms": ideal,
           "E": {name: efficiency(t["seq"], t[name], ideal) for name in t if name not in ("gemm", "comm", "seq")}}
    if rank == 0:
        print(f"{op} {m}x{n}x{k}: seq {t['seq']:.3f} " + " ".join(
            f"{name}={t[name]:.3f}/E{e:+.2f}" for name, e in row["E"].items()), flush=True)
    return row


def main():
    require_cuda("benchmarks.diagnostics.ring_nccl", per_rank=True)
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    rows = [measure(op, m, n, k, world, rank)
            for op, grid in (("reduce_scatter", GRID_ALL_REDUCE), ("all_reduce", GRID_ALL_REDUCE),
                             ("all_gather", GRID_ALL_GATHER)) for m, n, k in grid]
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"commit": os.environ.get("FLASHOVERLAP_COMMIT"),
                       "setting": "pcie-like" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "nvlink",
                       "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
