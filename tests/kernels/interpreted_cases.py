"""Cases for the Triton kernels (the signalling GEMM, the SM copy) under the interpreter, run in a child process
(TRITON_INTERPRET must be set before triton is imported, and the GPU test session imports it without). Prints one
JSON line per case."""

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from benchmarks.harness.copy_kernel import sm_copy  # noqa: E402
from flashoverlap.kernels.gemm import gemm  # noqa: E402
from flashoverlap.plan import TileConfig  # noqa: E402
from flashoverlap.tune.defaults import default_plan  # noqa: E402
from tests.kernels.gemm_cases import ALL_GATHER_CASES, CASES, COPY_CASES  # noqa: E402


def run(case):
    name, m, n, k, dtype_name, bt, tma, tma_store, programs, groups, profile, signal, op, world_size = case
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(hash(name) % 1000)
    tile = TileConfig(16, 16, 16, 2, 1, 4)
    plan = default_plan(op, m, n, k, world_size, tile=tile, num_groups=groups, profile=profile,
                        num_programs=programs, allow_sequential=False)
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(n, k, dtype=dtype).t() if bt else torch.randn(k, n, dtype=dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    counters = torch.zeros(plan.num_groups + 2, dtype=torch.int32) if signal else None
    gemm(a, b, plan, out=out, counters=counters, use_tma=tma, tma_store=tma_store)
    ref = a.double() @ b.double()
    if plan.blocks > 1:  # the workspace holds the product's rows where the plan's row tables put them
        placed = torch.full_like(ref, float("nan"))
        for a_row, out_row, rows in zip(*plan.tile_rows()):
            placed[out_row : out_row + rows] = ref[a_row : a_row + rows]
        ref = placed
    return {
        "name": name,
        "rel_err": float((out.double() - ref).norm() / ref.norm()),
        "nan": bool(torch.isnan(out).any()),
        "counters": counters.tolist() if signal else None,
        "expected_counters": [g.tile_count for g in plan.groups] + [0, 0],
    }


def run_all_gather(case):
    """The GEMM on a gathered buffer laid out as the plan says, with the bands' flags set (or not)."""
    name, rows, n, k, dtype_name, world_size, rank, groups, tma, flags_set, max_spins = case
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(len(name))
    m = rows * world_size
    plan = default_plan("all_gather", m, n, k, world_size, tile=TileConfig(16, 16, 16, 2, 1, 4), num_groups=groups,
                        num_programs=3, allow_sequential=False)
    a_full = torch.randn(m, k, dtype=dtype)
    b = torch.randn(k, n, dtype=dtype)
    gathered = torch.cat([a_full[src * rows + g.row_start : src * rows + g.row_end]
                          for g in plan.groups for src in range(world_size)])
    flags = torch.zeros(plan.num_groups, dtype=torch.int32)
    if flags_set == "all":
        flags.fill_(1)
    else:
        flags[0] = 1
    wait_error = torch.zeros(1, dtype=torch.int32)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    gemm(gathered, b, plan, out=out, flags=flags, rank=rank, wait_error=wait_error, max_spins=max_spins,
         use_tma=tma)
    ref = a_full.double() @ b.double()
    written = ~torch.isnan(out).any(dim=1)
    err = float((out[written].double() - ref[written]).norm() / ref[written].norm()) if written.any() else 0.0
    return {"name": name, "rel_err": err, "all_written": bool(written.all()), "wait_error": int(wait_error[0]),
            "groups": plan.num_groups}


def run_copy(case):
    name, numel, programs = case
    src = torch.randn(numel, dtype=torch.float16)
    dst = torch.full((numel,), float("nan"), dtype=torch.float16)
    sm_copy(dst, src, programs, block=256)
    return {"name": name, "equal": bool(torch.equal(dst, src))}


if __name__ == "__main__":
    for case in CASES:
        print(json.dumps(run(case)), flush=True)
    for case in ALL_GATHER_CASES:
        print(json.dumps(run_all_gather(case)), flush=True)
    for case in COPY_CASES:
        print(json.dumps(run_copy(case)), flush=True)
    sys.exit(0)
