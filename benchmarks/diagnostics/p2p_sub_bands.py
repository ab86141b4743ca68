"""The P2P ring's sub-band count, measured: at each grid shape of each op, the ring with 1, 2, 3, 4, 6 and 8
sub-bands per rank block side by side with sequential (matmul then NCCL) and torch async TP; E per plan, and the
host time per call. Evidence for ``plan.py``'s default sub-band counts.

torchrun --nproc-per-node 2 -m benchmarks.diagnostics.p2p_sub_bands OUT.json"""

import json
import os
import sys

import torch
import torch.distributed as dist

import flashoverlap as fo
from benchmarks.diagnostics.results_file import require_cuda, results_argument
from benchmarks.harness.baselines import async_tp_ops
from benchmarks.harness.op_rows import GRID_ALL_GATHER, GRID_ALL_REDUCE
from flashoverlap.bench import efficiency
from flashoverlap.comm.collectives import all_gather_into_tensor, reduce_scatter_tensor
from flashoverlap.tune.timing import inputs, time_side_by_side

SUB_BANDS = (1, 2, 3, 4, 6, 8)


def main():
    results_argument(__doc__)  # --help; an option is refused
    if len(sys.argv) != 2:  # before any GPU work: the results file is written at the end, by rank 0
        sys.exit("benchmarks/diagnostics/p2p_sub_bands.py: takes one argument, the results file's path: "
                 "torchrun --nproc-per-node 2 -m benchmarks.diagnostics.p2p_sub_bands OUT.json")
    require_cuda("benchmarks/diagnostics/p2p_sub_bands.py", per_rank=True)
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    fused_rs, fused_ag, _ = async_tp_ops()
    rows = [measure(op, m, n, k, world, rank, fused_rs, fused_ag)
            for op, grid in (("reduce_scatter", GRID_ALL_REDUCE), ("all_reduce", GRID_ALL_REDUCE),
                             ("all_gather", GRID_ALL_GATHER)) for m, n, k in grid]
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"commit": os.environ.get("FLASHOVERLAP_COMMIT"), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def measure(op, m, n, k, world, rank, fused_rs, fused_ag):
    a, b = inputs(m // world if op == "all_gather" else m, n, k, torch.bfloat16, rank)
    c = torch.matmul(torch.empty(m, k, dtype=a.dtype, device=a.device) if op == "all_gather" else a, b)
    full = torch.empty(m, k, dtype=a.dtype, device=a.device)
    out = torch.empty(m // world, n, dtype=a.dtype, device=a.device)
    fn = fo.ops.GEMM_OPS[op]
    if op == "all_gather":
        def seq():
            all_gather_into_tensor(full, a, None)
            return torch.matmul(full, b)
        comm = lambda: all_gather_into_tensor(full, a, None)  # noqa: E731
        gemm = lambda: torch.matmul(full, b)  # noqa: E731
    elif op == "reduce_scatter":
        seq = lambda: reduce_scatter_tensor(out, torch.matmul(a, b), None)  # noqa: E731
        comm = lambda: reduce_scatter_tensor(out, c, None)  # noqa: E731
        gemm = lambda: torch.matmul(a, b)  # noqa: E731
    else:
        def seq():
            x = torch.matmul(a, b)
            dist.all_reduce(x)
        comm = lambda: dist.all_reduce(c)  # noqa: E731
        gemm = lambda: torch.matmul(a, b)  # noqa: E731
    fns = {"gemm": gemm, "comm": comm, "seq": seq}
    fused = {"reduce_scatter": fused_rs, "all_gather": fused_ag}.get(op)
    if fused is not None:
        fns["async_tp"] = lambda fused=fused: fused(a, b)
    plans = {}
    for sub in SUB_BANDS:
        plan = fo.default_plan(op, m, n, k, world, num_groups=sub, path="p2p", allow_sequential=False)
        if plan.sub_bands == sub and not plan.sequential:
            plans[sub] = plan
            fns[f"s{sub}"] = lambda plan=plan: fn(a, b, plan=plan)
    host = {}
    t = time_side_by_side(fns, warmup=3, iters=20, host_us=host)
    ideal = max(t["gemm"], t["comm"])
    row = {"op": op, "M": m, "N": n, "K": k, "t": t, "host_us": host, "t_ideal_ms": ideal,
           "E": {sub: efficiency(t["seq"], t[f"s{sub}"], ideal) for sub in plans},
           "E_async_tp": efficiency(t["seq"], t["async_tp"], ideal) if "async_tp" in t else None}
    if rank == 0:
        best = max(row["E"], key=row["E"].get)
        cells = " ".join(f"S{s}={t[f's{s}']:.3f}/E{row['E'][s]:+.2f}/{host[f's{s}']:.0f}us" for s in plans)
        print(f"{op} {m}x{n}x{k}: seq {t['seq']:.3f} asyncTP {t.get('async_tp', float('nan')):.3f} "
              f"{cells}  best S{best}  host seq {host['seq']:.0f}us", flush=True)
    return row


if __name__ == "__main__":
    main()
