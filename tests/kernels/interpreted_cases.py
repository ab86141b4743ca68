"""Cases for the signalling GEMM under the Triton interpreter, run in a child process (TRITON_INTERPRET must be set
before triton is imported, and the GPU test session imports it without). Prints one JSON line per case."""

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from flashoverlap.kernels.gemm import gemm  # noqa: E402
from flashoverlap.plan import TileConfig, default_plan  # noqa: E402

# (name, m, n, k, dtype, b transposed, TMA loads, TMA store, programs, groups, profile, signal)
CASES = [
    ("odd-pointer-fp16", 37, 45, 29, "float16", False, False, False, 5, 3, "even", True),
    ("odd-pointer-bt-fp16", 70, 33, 50, "float16", True, False, False, 100, 4, "small-first", True),
    ("tma-fp32", 64, 48, 40, "float32", False, True, False, 3, 3, "small-last", True),
    ("tma-bt-store-fp16", 96, 64, 72, "float16", True, True, True, 4, 2, "even", True),
    ("tma-ragged-fp16", 53, 40, 24, "float16", False, True, False, 2, 4, "even", True),
    ("one-tile-fp32", 1, 1, 1, "float32", False, False, False, 1, 1, "even", True),
    ("no-signal-fp16", 45, 31, 17, "float16", True, False, False, 3, 2, "even", False),
]


def run(case):
    name, m, n, k, dtype_name, bt, tma, tma_store, programs, groups, profile, signal = case
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(hash(name) % 1000)
    tile = TileConfig(16, 16, 16, 2, 1, 4)
    plan = default_plan("all_reduce", m, n, k, 2, tile=tile, num_groups=groups, profile=profile,
                        num_programs=programs, allow_sequential=False)
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(n, k, dtype=dtype).t() if bt else torch.randn(k, n, dtype=dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    counters = torch.zeros(plan.num_groups + 2, dtype=torch.int32) if signal else None
    gemm(a, b, plan, out=out, counters=counters, use_tma=tma, tma_store=tma_store)
    ref = a.double() @ b.double()
    return {
        "name": name,
        "rel_err": float((out.double() - ref).norm() / ref.norm()),
        "nan": bool(torch.isnan(out).any()),
        "counters": counters.tolist() if signal else None,
        "expected_counters": [g.tile_count for g in plan.groups] + [0, 0],
    }


if __name__ == "__main__":
    for case in CASES:
        print(json.dumps(run(case)), flush=True)
    sys.exit(0)
