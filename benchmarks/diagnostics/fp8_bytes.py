"""The bytes each op puts on the wire per call and rank, fp8 against bf16, counted from the NCCL path's plan at the
grid's shapes (W = 2): group by group, what its collective moves (all-gather: the band's packed rows, fp8 bytes and
scales, ``comm/scaled.row_bytes``; all-reduce and reduce-scatter: the band's partial products in the output dtype,
bf16). A CPU computation: no GPU, no timing.

FLASHOVERLAP_COMMIT=<sha> PYTHONPATH=src:. python -m benchmarks.diagnostics.fp8_bytes benchmarks/results/fp8-bytes.json
"""

import torch

from benchmarks.diagnostics.fp8_gemm import GRID, WORLD
from benchmarks.diagnostics.results_file import results_argument, results_meta, write_results
from flashoverlap.comm.scaled import BLOCK, Scales, row_bytes
from flashoverlap.tune.fp8 import fp8_plan

E4M3 = torch.float8_e4m3fn


def wire_bytes(plan, row: int) -> int:
    """What one rank sends and receives in total over the plan's collectives: each group's band, ``row`` bytes a row
    (all-gather: every rank's slot of the band; the reductions: the band of the output)."""
    banded = plan.op != "all_reduce"  # a band of every rank block: the all-gather's slots, the reduce-scatter's input
    return sum((grp.rows * plan.world_size if banded else grp.row_end - grp.row_start) * row for grp in plan.groups)


def main() -> None:
    results_argument(__doc__)
    rows = []
    for op, shapes in GRID.items():
        for m, n, k in shapes:
            k_rank = k if op == "all_gather" else k // WORLD
            for scaling in ("tensor", "row", "block"):
                scales = Scales(torch.ones(1), torch.ones(1), scaling)
                plan = fp8_plan(op, m, n, k_rank, WORLD, scaling)
                if op == "all_gather":
                    fp8_row, bf16_row = row_bytes(k, E4M3, scales), row_bytes(k, torch.bfloat16, None)
                else:
                    fp8_row = bf16_row = n * torch.bfloat16.itemsize  # bf16 partials either way
                fp8, bf16 = wire_bytes(plan, fp8_row), wire_bytes(plan, bf16_row)
                rows.append({"op": op, "scaling": scaling, "M": m, "N": n, "K": k, "groups": plan.num_groups,
                             "bytes_fp8": fp8, "bytes_bf16": bf16, "ratio": round(fp8 / bf16, 4),
                             "scale_bytes_per_row": 4 * scales.scale_columns(k) if op == "all_gather" else 0})
                print(rows[-1], flush=True)
    write_results({"meta": results_meta("FLASHOVERLAP_COMMIT=<sha> PYTHONPATH=src:. python -m "
                                        "benchmarks.diagnostics.fp8_bytes benchmarks/results/fp8-bytes.json",
                                        gpus="none (counted on the CPU)", block=BLOCK), "rows": rows})


if __name__ == "__main__":
    main()
