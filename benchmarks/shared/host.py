"""Host time per call at W ranks on one GPU: each tensor-parallel op (bf16; fp8 row-wise) through the public op on
the P2P path, eager and replayed, beside ``torch.mm`` alone (fp8: and ``torch._scaled_mm``) on the op's whole GEMM
(``[M, K] @ [K, N]``; all-gather: the gathered ``M``), interleaved in one run (``host_us_interleaved``: each round
one call of each, in a balanced order, the GPU busy ahead of every call, the ranks aligned before it).

The plan is the P2P path's default overlapped plan for the shape (``default_plan(path="p2p",
allow_sequential=False)``, passed as ``plan=``). Eager and replayed calls alternate within a round: the runtime's
settings object is swapped before each call (``settings._current``: eager with replay off, as
``FLASHOVERLAP_REPLAY=0`` gives it), which costs a Python assignment, where re-reading the environment
(``settings.refresh()``) would cost microseconds inside the timed call. A replayed call's share of actual replays is
counted (``replay_share``: 1.0 when every timed replayed call ran from its graph).

``bands``: the call's own matmul launches without the library, as the P2P executor issues them: per matmul step of
the plan's schedule, ``torch.mm(..., out=)`` or ``addmm_`` on that many rows (fp8: ``torch._scaled_mm(..., out=)``,
an accumulating step's product added in a second kernel), the operands' row blocks and outputs made once
(``bands_us``, and ``eager_over_bands``, paired): about the floor of an eager call's host time.

Targets (issue 42): replayed <= 1.5x ``torch.mm`` at W = 8; eager <= 3x at W = 2 and <= 4x at W = 8.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.shared import calls as tc
from benchmarks.shared.runs import device_of, go_on, guarded

HOST_SHAPE = (2048, 4096, 4096)  # (M, N, K) of each rank's GEMM (all-gather: the gathered M)
ROUNDS = 40
TARGETS = {("replayed", 8): 1.5, ("eager", 2): 3.0, ("eager", 8): 4.0}


def rank_main(rank: int, world: int, options: dict) -> list[dict]:
    import flashoverlap as fo
    from benchmarks.harness.timing import cycle_rounds, host_us_interleaved
    from benchmarks.shared.mechanics import forced_graph_waits, replays
    from flashoverlap import settings
    from flashoverlap.comm import steps
    from flashoverlap.comm.tp import ring_schedule as rs

    device = device_of(options.get("device", "cuda"))
    forced_graph_waits(options)
    m, n, k = options.get("shape", HOST_SHAPE)
    rounds = options.get("rounds", ROUNDS)
    settings.refresh()
    base = settings.current()
    modes = {"eager": dataclasses.replace(base, replay=False), "replayed": dataclasses.replace(base, replay=True)}
    rows = []
    for op in options.get("ops") or tc.TP_OPS:
        if not go_on(options["deadline"]):
            rows += [{"op": op, "mode": mode, "error": "budget spent before this op"} for mode in modes]
            continue
        fp8 = op in tc.FP8_OPS
        call = tc.TpCall(op, "row" if fp8 else "bf16", m, n, k, True, "bf16", False, "default", 1, False, seed=5)

        def body(op=op, fp8=fp8, call=call):
            ops = tc.operands(call, world, rank, 0, device)
            plan = fo.default_plan(call.kind, m, n, k, world, path="p2p", allow_sequential=False)
            gen = tc.generator(device, 5, rank, 99)
            full16 = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            w16 = (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(torch.bfloat16).t()
            fns = {"torch.mm": lambda: torch.mm(full16, w16)}
            bands = [(item.rows, item.accumulate) for item in rs.schedule(plan, rank) if isinstance(item, steps.Mm)]
            outs = [torch.zeros(rows, n, dtype=torch.bfloat16, device=device) for rows, _ in bands]
            if fp8:
                full8, scale_full = tc.quantise(full16.float(), "row", "a")
                fns["torch._scaled_mm"] = lambda: torch._scaled_mm(full8, ops.b, scale_full, ops.scale_b,
                                                                   out_dtype=torch.bfloat16)
                parts = [(full8[:rows], scale_full[:rows], out, accumulate)
                         for (rows, accumulate), out in zip(bands, outs)]

                def band_launches():
                    for src, scale, out, accumulate in parts:
                        if accumulate:
                            out.add_(torch._scaled_mm(src, ops.b, scale, ops.scale_b, out_dtype=torch.bfloat16))
                        else:
                            torch._scaled_mm(src, ops.b, scale, ops.scale_b, out_dtype=torch.bfloat16, out=out)
            else:
                parts = [(full16[:rows], out, accumulate) for (rows, accumulate), out in zip(bands, outs)]

                def band_launches():
                    for src, out, accumulate in parts:
                        if accumulate:
                            out.addmm_(src, w16)
                        else:
                            torch.mm(src, w16, out=out)
            fns["bands"] = band_launches

            def ours(mode):
                def fn():
                    settings._current = modes[mode]  # noqa: SLF001 -- see the module docstring
                    return tc.invoke(call, ops, None, plan, "p2p")[0]
                return fn

            fns["eager"], fns["replayed"] = ours("eager"), ours("replayed")
            for _ in range(3):  # kernels loaded, the replayed call's graph captured
                for fn in fns.values():
                    fn()
            torch.cuda.synchronize()
            before = replays(dist.group.WORLD, device)
            start = time.perf_counter()
            us = host_us_interleaved(fns, calls=rounds, pairs=(("eager", "torch.mm"), ("replayed", "torch.mm"),
                                                               ("eager", "bands")))
            cycle = cycle_rounds(len(fns))
            timed_rounds = -(-rounds // cycle) * cycle  # host_us_interleaved's whole cycles
            share = (replays(dist.group.WORLD, device) - before) / timed_rounds
            settings._current = base  # noqa: SLF001
            out = []
            for mode in ("eager", "replayed"):
                ratio = us[f"{mode} / torch.mm"]
                target = TARGETS.get((mode, world))
                out.append({"op": op, "dtype": call.dtype if fp8 else "bf16", "mode": mode, "M": m, "N": n, "K": k,
                            "host_us": round(us[mode], 1), "torch_mm_us": round(us["torch.mm"], 1),
                            "scaled_mm_us": round(us["torch._scaled_mm"], 1) if fp8 else None,
                            "paired_ratio": round(ratio, 2), "target_ratio": target,
                            "meets_target": None if target is None else ratio <= target,
                            "replay_share": round(share, 2) if mode == "replayed" else None,
                            "bands": len(bands), "bands_us": round(us["bands"], 1),
                            "eager_over_bands": round(us["eager / bands"], 2) if mode == "eager" else None,
                            "rounds": timed_rounds, "seconds": round(time.perf_counter() - start, 1)})
            if rank == 0:
                print(f"host W={world} {op}: " + ", ".join(f"{name} {value:.1f} us" for name, value in us.items()
                                                         if "/" not in name and "-" not in name)
                      + f", replay share {share:.2f}", flush=True)
            return out

        result, error = guarded(body)
        settings._current = base  # noqa: SLF001
        rows += result if result else [{"op": op, "mode": mode, "error": error} for mode in modes]
    try:
        torch.cuda.synchronize()
        fo.release()
    except Exception:  # noqa: BLE001
        pass
    return rows


def aggregate(per_rank: list[list[dict]], world: int) -> list[dict]:
    """One row per (op, mode): rank 0's figures, with the median and the largest over ranks."""
    rows = []
    for rank_rows in zip(*per_rank):
        row = {"W": world, **rank_rows[0]}
        if row.get("host_us") is not None:
            values = [r["host_us"] for r in rank_rows if r.get("host_us") is not None]
            ratios = [r["paired_ratio"] for r in rank_rows if r.get("paired_ratio") is not None]
            row["host_us_median_over_ranks"] = round(statistics.median(values), 1)
            row["host_us_max_over_ranks"] = round(max(values), 1)
            row["paired_ratio_max_over_ranks"] = round(max(ratios), 2) if ratios else None
            shares = [r["replay_share"] for r in rank_rows if r.get("replay_share") is not None]
            row["replay_share"] = min(shares) if shares else row.get("replay_share")
        errors = {rank: r["error"] for rank, r in enumerate(rank_rows) if r.get("error")}
        if errors:
            row["error"] = " | ".join(f"rank {rank}: {text}" for rank, text in errors.items())
        rows.append(row)
    return rows
