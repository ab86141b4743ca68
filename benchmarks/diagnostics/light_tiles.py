"""Which tile the hybrid GEMM's light launch (``Segments.row_map``, ``comm/chunked_gemm.light_multiplier``) should
take: the DeepSeek-like slice's light experts (every expert, balanced; the light ones, Zipf(1.2) with the default
``tune.grouped.HYBRID_CUT``) as the exact mode runs them, under each candidate tile, beside ``torch._grouped_mm`` on the
same rows regrouped by expert. Each candidate is first checked against ``torch._grouped_mm`` (output poisoned).

CUDA_VISIBLE_DEVICES=0 FLASHOVERLAP_COMMIT=<sha> PYTHONPATH=src \\
    python -m benchmarks.diagnostics.light_tiles [out.json]
"""

import dataclasses
import json
import sys

import torch

from benchmarks.diagnostics.results_file import require_cuda, results_meta, write_results
from benchmarks.moe_gemm import Slice
from flashoverlap.comm.expert import chunked_gemm
from flashoverlap.kernels.grouped_gemm import (
    TILE_FLAT,
    TILE_MANY_EXPERTS,
    TILE_MANY_EXPERTS_LONG_K,
    GroupedLaunch,
    GroupedTile,
    Segments,
    grouped_gemm,
    workspace_size,
)
from flashoverlap.tune.grouped import HYBRID_CUT
from flashoverlap.tune.timing import time_side_by_side

TILES = {
    "default": None,
    "flat": TILE_FLAT,
    "many": TILE_MANY_EXPERTS,
    "many-long-k": TILE_MANY_EXPERTS_LONG_K,
    "np-s3": GroupedTile(128, 256, 64, 8, 3, 8, None, half_tail=True),
    "np-s4": GroupedTile(128, 256, 64, 8, 4, 8, None, half_tail=True),
    "p-s4": GroupedTile(128, 256, 64, 8, 4, 8, 0, half_tail=True),
    "flat-s3": dataclasses.replace(TILE_FLAT, num_stages=3),
    "np-s4-g16": GroupedTile(128, 256, 64, 16, 4, 8, None, half_tail=True),
}


def main() -> int:
    require_cuda("benchmarks.diagnostics.light_tiles", path_only=True)
    rows = []
    for routing in ("balanced", "zipf"):
        for proj in ("up", "down"):
            s = Slice("deepseek-v3", routing, proj)
            row_map, ends, experts = chunked_gemm.light_tables(s.exact_layout(), HYBRID_CUT.heavy_rows)
            workspace = torch.empty(workspace_size(experts.numel()), dtype=torch.int32, device="cuda")
            fns, errs = {"grouped_mm": s.grouped_mm()}, {}
            want = torch._grouped_mm(s.x_by_expert, s.w, offs=s.offs).float()
            inv = torch.empty_like(s.perm)
            inv[s.perm] = torch.arange(s.perm.numel(), device="cuda")
            light_rows = row_map.long()
            for name, tile in TILES.items():
                def run(tile=tile, s=s, ends=ends, experts=experts, row_map=row_map, workspace=workspace):
                    grouped_gemm(s.x, s.w, Segments(ends, experts, row_map=row_map), out=s.out, workspace=workspace,
                                 launch=GroupedLaunch(max_rows=row_map.numel(), tile=tile))
                s.out.fill_(float("nan"))
                run()
                got = s.out[light_rows].float()
                ref = want[inv[light_rows]]
                errs[name] = float((got - ref).norm() / ref.norm())
                if torch.isnan(got).any() or errs[name] > 1e-2:
                    raise AssertionError(f"{routing} {proj} {name}: error {errs[name]}")
                fns[name] = run
            t = time_side_by_side(fns, warmup=3, iters=15)
            row = {"routing": routing, "proj": proj, "light_rows": row_map.numel(), "light_experts": experts.numel(),
                   "t_ms": {k: round(v, 4) for k, v in t.items()}, "rel_err": errs}
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_results({"meta": results_meta("PYTHONPATH=src python -m benchmarks.diagnostics.light_tiles OUT.json"),
                  "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
