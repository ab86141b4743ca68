"""Which tile the fp8 grouped GEMM (``kernels.grouped_gemm.scaled_grouped_gemm``) should take per scaling mode
(``SCALED_TILE`` block-wise, ``SCALED_TILE_ROW`` row-wise; issue 44's block-wise target: >= 1.3x bf16
``torch._grouped_mm`` at >= 8192 rows).

    FLASHOVERLAP_COMMIT=<sha> PYTHONPATH=src:. python -m benchmarks.diagnostics.fp8_grouped_tiles \\
        --out benchmarks/results/h200x1-fp8-grouped-tiles.json [--only NAME,...] [--scalings block,row] [--iters 10]

For each config of ``fp8_grouped.CONFIGS`` (one rank's slice at W = 2, balanced routing, in ``fp8_grouped.CHUNKS``
chunks as the paths run them), block-wise and row-wise: every tile of ``TILES`` through the kernel's launcher,
beside bf16 ``torch._grouped_mm`` on the same rows (and ``torch._scaled_grouped_mm`` row-wise). Each: the median of
CUDA-event times over ``--iters`` calls after a warm-up, each queued behind a GPU sleep; fresh random operands and
scales, never zeros; every tile's output checked against the loop way's (one scaled matmul per segment: ``err``, the
max relative difference; a tile off by more than 5e-2 is marked wrong and never taken as best). Rows {config,
scaling, experts, rows, K, N, t_bf16_grouped_mm_ms, t_scaled_grouped_mm_ms, tiles: {name: {tile, t_ms, err, ok}},
err_scaled_grouped_mm, best, t_best_ms, bf16_over_best, bf16_over_current (bf16's time over the tile's: above 1, the
fp8 tile is faster)}; ``meta.facts``: each tile's registers, shared memory, programs per SM and MMA waits as Triton
compiles it for this GPU (``kernel_facts``). A diagnostic to choose the kernel's tile, not a library figure; the file
is rewritten after every config. Run it alone in a device call (about 8 configs, 15 tiles per scaling, each compiled
once).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.diagnostics.fp8_grouped import CHUNKS, CONFIGS, FP8, config_names, timed
from benchmarks.diagnostics.grouped_gemm_ways import rows_per_expert
from benchmarks.diagnostics.results_file import require_cuda, results_meta
from flashoverlap.cli import names_of
from flashoverlap.comm.expert.scaled import ExpertScales, scaled_multiply
from flashoverlap.tune.grouped import GroupedCall

# (block_m, block_n, group_m, num_stages, num_warps, num_programs[, programs_per_sm]): block_k is 128 (one block-wise
# scale per K step). num_programs 0: persistent, programs_per_sm (default 1) per SM; None: one program per tile.
# Several programs per SM let one program's MMA run while another scales its product (``kernel_facts``: Triton waits
# for each block-wise step's MMA); tiles of 4 warps at most 128x128 are the ones whose registers and shared memory
# fit two or more (``meta.facts``).
TILES = {
    "current": None,  # the launcher's own tile for the scaling (``grouped_gemm.scaled_tile``)
    "128x128-s4": (128, 128, 8, 4, 8, 0),
    "128x128-s4-w4": (128, 128, 8, 4, 4, 0),
    "128x256-s3": (128, 256, 8, 3, 8, 0),
    "128x256-s4": (128, 256, 8, 4, 8, 0),
    "256x128-s3": (256, 128, 8, 3, 8, 0),
    "64x128-s4-w4": (64, 128, 8, 4, 4, 0),
    "64x256-s4": (64, 256, 8, 4, 8, 0),
    "128x128-s3-tiles": (128, 128, 8, 3, 8, None),
    "128x256-s3-tiles": (128, 256, 8, 3, 8, None),
    "64x128-s4-w4-2sm": (64, 128, 8, 4, 4, 0, 2),
    "64x128-s3-w4-2sm": (64, 128, 8, 3, 4, 0, 2),
    "64x128-s3-w4-tiles": (64, 128, 8, 3, 4, None),
    "128x64-s4-w4-2sm": (128, 64, 8, 4, 4, 0, 2),
    "64x64-s4-w4-3sm": (64, 64, 8, 4, 4, 0, 3),
    # One program per tile, 128 wide: on Hopper these block-wise tiles run the Gluon kernel (kernels/block_scaled.py,
    # ``fits``), the persistent ones above the Triton kernel.
    "128x128-s4-tiles": (128, 128, 8, 4, 8, None),
    "64x128-s4-w4-tiles": (64, 128, 8, 4, 4, None),
}


def tile_of(spec: tuple | None, scaling: str = "block", gluon: bool = False, k: int = 2048):
    """The ``GroupedTile`` of a ``TILES`` entry (None: the launcher's own for ``scaling`` at K = ``k``,
    ``grouped_gemm.scaled_tile``; ``gluon``: whether the Gluon kernel applies to the operands)."""
    from flashoverlap.kernels.grouped_gemm import GroupedTile, scaled_tile

    if spec is None:
        return scaled_tile(scaling, gluon, k)
    block_m, block_n, group_m, stages, warps, programs, *per_sm = spec
    return GroupedTile(block_m, block_n, 128, group_m, stages, warps, programs, programs_per_sm=per_sm[0] if per_sm
                       else 1)


def config_row(name: str, local: int, k: int, n: int, rows: int, scaling: str, iters: int, seed: int = 0,
               device: str = "cuda", timer=timed, tiles: dict = TILES) -> dict:
    """One config's row (module docstring). ``device``, ``timer`` and ``tiles``: the test's interpreted run on the
    CPU, timed by a stand-in."""
    from flashoverlap.kernels.grouped_gemm import Segments, scaled_grouped_gemm

    dev = torch.device(device)
    call = GroupedCall(rows_per_expert(rows, local, "balanced", seed), k, n, 1, CHUNKS)
    chunks = call.segments()  # rows per (chunk, expert)
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    x = torch.randn(rows, k, device=dev, generator=gen)
    amax = x.abs().amax(1, keepdim=True) if scaling == "row" else x.view(rows, k // 128, 128).abs().amax(2)
    x_scale = (amax / 448).clamp_min(1e-12).float()
    xq = (x.view(rows, -1, 128 if scaling == "block" else k) / x_scale.view(rows, -1, 1)).view(rows, k).to(FP8)
    del x
    w = torch.randn(local, n, k, device=dev, generator=gen).div_(k ** 0.5)
    wq = w.to(FP8).transpose(1, 2)  # [L, K, N] view of nn.Linear-shaped storage, as the layers hold them
    w_bf16 = w.to(torch.bfloat16).transpose(1, 2)
    del w
    w_scale = (torch.rand(local, n, device=dev, generator=gen) + 0.5) if scaling == "row" else \
        (torch.rand(local, k // 128, -(-n // 128), device=dev, generator=gen) + 0.5)
    x_bf16 = xq.to(torch.bfloat16)
    sizes = [sum(c) for c in chunks]
    starts = [sum(sizes[:c]) for c in range(CHUNKS)]
    ends = [torch.tensor(c, device=dev).cumsum(0).to(torch.int32) for c in chunks]
    experts = torch.arange(local, dtype=torch.int32, device=dev)
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
    row = {"config": name, "scaling": scaling, "experts": local, "rows": rows, "K": k, "N": n, "chunks": CHUNKS,
           "tiles": {}}

    def ours(tile):
        def fn():
            for c in range(CHUNKS):
                s, e = starts[c], starts[c] + sizes[c]
                scaled_grouped_gemm(xq[s:e], x_scale[s:e], wq, w_scale, Segments(ends[c], experts), out=out[s:e],
                                    mode=scaling, tile=tile)
        return fn

    def bf16():
        for c in range(CHUNKS):
            s, e = starts[c], starts[c] + sizes[c]
            out[s:e].copy_(torch._grouped_mm(x_bf16[s:e], w_bf16, offs=ends[c]))

    def scaled_grouped():  # into out, as bf16 above: both baselines pay the copy
        for c in range(CHUNKS):
            s, e = starts[c], starts[c] + sizes[c]
            out[s:e].copy_(torch._scaled_grouped_mm(xq[s:e], wq, x_scale[s:e].reshape(-1), w_scale, offs=ends[c],
                                                    out_dtype=torch.bfloat16))

    # The reference: the loop way (one scaled matmul per segment, ``comm/expert/scaled.scaled_multiply``).
    scales = ExpertScales(scaling, w_scale, x_scale)
    out.fill_(float("nan"))
    for c in range(CHUNKS):
        s, e = starts[c], starts[c] + sizes[c]
        scaled_multiply("loop", xq[s:e], x_scale[s:e], wq, scales, ends[c], out[s:e], ends[c].tolist())
    reference = out.float().clone()

    def error() -> float:  # out against the reference: the max difference over the largest magnitude
        return float((out.float() - reference).abs().max()) / (1 + float(reference.abs().max()))

    row["t_bf16_grouped_mm_ms"] = timer(bf16, iters)
    row["t_scaled_grouped_mm_ms"] = None
    if scaling == "row":
        try:
            out.fill_(float("nan"))
            scaled_grouped()
            row["err_scaled_grouped_mm"] = error()
            row["t_scaled_grouped_mm_ms"] = timer(scaled_grouped, iters)
        except Exception as exc:  # noqa: BLE001  (recorded, the run goes on)
            row["error_scaled_grouped_mm"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    from flashoverlap.kernels import block_scaled

    applies = scaling == "block" and block_scaled.applies(xq, wq)  # the launcher's own test, asked once
    for tile_name, spec in tiles.items():
        tile = tile_of(spec, scaling, applies, k)
        gluon = applies and block_scaled.fits(tile)
        entry = row["tiles"][tile_name] = {"tile": [tile.block_m, tile.block_n, tile.group_m, tile.num_stages,
                                                    tile.num_warps, tile.num_programs, tile.programs_per_sm],
                                           "kernel": "gluon" if gluon else "triton"}
        try:
            fn = ours(tile)
            out.fill_(float("nan"))
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            err = error()
            entry.update(err=err, ok=err <= 5e-2, t_ms=timer(fn, iters))
        except Exception as exc:  # noqa: BLE001
            entry.update(ok=False, t_ms=None, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc()
    good = {t: e["t_ms"] for t, e in row["tiles"].items() if e.get("ok") and e.get("t_ms")}
    if good:
        best = min(good, key=good.get)
        row.update(best=best, t_best_ms=good[best], bf16_over_best=row["t_bf16_grouped_mm_ms"] / good[best])
        if "current" in good:
            row["bf16_over_current"] = row["t_bf16_grouped_mm_ms"] / good["current"]
    return row


def tile_facts(scalings, names) -> dict:
    """The compiled facts of every tile of ``names``, per scaling, for this GPU's architecture (or the error): the
    Gluon kernel's (``kernel_facts.block_scaled_facts``) where it runs the tile block-wise, else the Triton
    kernel's (``kernel_facts.fp8_kernel_facts``); the launcher's own tile as the launcher takes it on a GPU whose
    operands suit the Gluon kernel (the sweep's configs do: K-major weights, K a multiple of 256 where block-wise)."""
    from benchmarks.diagnostics.kernel_facts import block_scaled_facts, fp8_kernel_facts
    from flashoverlap.kernels import block_scaled

    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return {"note": f"sm_{major}{minor}: the facts are read for Hopper (sm_90) only"}
    facts = {scaling: {} for scaling in scalings}
    # On sm_90 (above) the Gluon kernel runs every block-wise tile it fits (the facts of "current": its tile for K of
    # 1024 and more).
    gluon_here = block_scaled.gluon_missing() is None
    for scaling in scalings:
        applies = scaling == "block" and gluon_here
        for name in names:
            tile = tile_of(TILES[name], scaling, applies)
            gluon = applies and block_scaled.fits(tile)
            try:
                facts[scaling][name] = block_scaled_facts(tile) if gluon else fp8_kernel_facts(tile, scaling)
            except Exception as exc:  # noqa: BLE001  (a diagnostic beside the times: recorded, the sweep goes on)
                facts[scaling][name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/h200x1-fp8-grouped-tiles.json")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--only", type=config_names, default=None,
                        help="comma-separated config names (fp8_grouped.CONFIGS)")
    parser.add_argument("--tiles", type=names_of(tuple(TILES), "tile"), default=None,
                        help="comma-separated tile names (TILES; default: all)")
    parser.add_argument("--scalings", type=names_of(("block", "row"), "scaling"), default=["block", "row"],
                        help="block and/or row, comma-separated")
    args = parser.parse_args()
    require_cuda("benchmarks.diagnostics.fp8_grouped_tiles")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = results_meta("python -m benchmarks.diagnostics.fp8_grouped_tiles " + shlex.join(sys.argv[1:]),
                        chunks=CHUNKS, tiles={name: spec and list(spec) for name, spec in TILES.items()},
                        facts=tile_facts(args.scalings, args.tiles or list(TILES)))
    rows, started = [], time.monotonic()
    for name, local, k, n, count, _ in CONFIGS:
        if args.only and name not in args.only:
            continue
        for scaling in args.scalings:
            if scaling == "block" and k % 128:  # refused by the kernel (and torch's): nothing to time
                rows.append({"config": name, "scaling": scaling,
                             "skipped": f"block-wise scaling needs K a multiple of 128 (K = {k})"})
                print(f"{name} {scaling}: {rows[-1]['skipped']}", flush=True)
                continue
            try:
                row = config_row(name, local, k, n, count, scaling, args.iters,
                                 tiles=TILES if args.tiles is None else {t: TILES[t] for t in args.tiles})
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row = {"config": name, "scaling": scaling, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            rows.append(row)
            torch.cuda.empty_cache()
            print(f"[{time.monotonic() - started:6.1f}s] {name} {scaling}: bf16 {row.get('t_bf16_grouped_mm_ms')} "
                  f"best {row.get('best')} {row.get('t_best_ms')} (bf16 / best {row.get('bf16_over_best')}; bf16 / "
                  f"current {row.get('bf16_over_current')})", flush=True)
            path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {path} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
