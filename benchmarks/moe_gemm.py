"""The expert GEMMs on one GPU: our grouped GEMM as the MoE paths run it, against ``torch._grouped_mm`` and a
per-expert ``torch.mm`` loop, at the per-rank slices (W = 2) of issue 20's three configs.

A rank's slice at W = 2 holds ``experts`` local experts and ``rows`` received rows (tokens x top-k), laid out as
the dispatch delivers them: per source rank, per local expert (``2 * experts`` segments). Routing: balanced (every
(source, expert) the same rows) or Zipf(1.2) (expert popularity ``i^-1.2`` over the local experts in a seeded
random order, each row's source uniform). Projections: ``up`` ``[rows, H] x [H, 2F]`` (gate and up fused) and
``down`` ``[rows, F] x [F, H]``; weights ``[E, K, N]`` row-major, fresh random bf16 inputs.

Per row, timed side by side (CUDA events, median, each call queued behind a GPU sleep, warm-up first):
- ``t_chunks_ms``: ``grouped_gemm`` once per source chunk, as the dispatch of both fast paths and the P2P combine
  run it (``comm/expert_nccl.py``'s ``multiply_chunk``: heavy-first, no signals, the default tile of a chunk);
- ``t_signal_ms``: one launch over every chunk with one signal group per source and the sources in the NCCL
  path's round order (own last), one program per tile, as the NCCL combine's signalling GEMM runs it (exact mode);
- ``t_triton_ms``: one launch over every chunk with signals, heavy-first, the default tile: what a path could run
  once every chunk has landed (no priorities);
- ``t_grouped_mm_ms``: one ``torch._grouped_mm`` on the rows regrouped by expert (the plain path's anchor);
  ``t_cublas_path_ms``: one ``torch._grouped_mm`` per source chunk, as the paths run cuBLAS;
- ``t_loop_ms``: ``torch.mm`` per expert on the regrouped rows; ``t_loop_path_ms``: per non-empty segment;
- ``t_hybrid_ms``: the exact mode's hybrid (``comm/expert_nccl.py``'s functions): the heavy experts a ``torch.mm``
  per segment chunk by chunk, the light ones in one row-mapped launch over every chunk (``Slice.hybrid``).
``path`` is the way the runtime runs the exact mode at the slice (``runtime.experts.choose_gemm``: the hybrid where
``tune.grouped.hybrid_pays``, many experts of few rows each, else the cost model's choice per chunk),
``path_bounded`` the bounded mode's; ``t_ms`` that way's time,
``tflops`` at ``t_ms``. Every timed way is first checked against ``torch._grouped_mm`` on an output poisoned with NaN
(flags included).

``python -m benchmarks.moe_gemm --out FILE`` writes ``{"meta", "rows"}``; ``--sweep FILE`` times tile
variants of ours in the three forms instead (the measurements behind ``kernels.grouped_gemm``'s tile rule);
``--expert-groups FILE`` times the per-source form beside launches per group of experts over every source's rows
(``Slice.triton_expert_groups``, ``cublas_expert_groups``): what a dispatch chunked by expert groups would run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import shlex
import sys
from collections.abc import Callable

import torch

from benchmarks.harness.run import commit
from benchmarks.harness.timing import host_us
from flashoverlap.cli import names_of
from flashoverlap.comm.expert import ExpertPlan, Layout
from flashoverlap.comm.expert.chunked_gemm import chunk_multiplier, light_multiplier
from flashoverlap.kernels.grouped_gemm import (
    TILE_FLAT,
    TILE_MANY_EXPERTS,
    GroupedLaunch,
    GroupedTile,
    Segments,
    default_tile,
    grouped_gemm,
    workspace_size,
)
from flashoverlap.tune.grouped import HYBRID_CUT
from flashoverlap.tune.timing import time_side_by_side

WORLD = 2
# name: (local experts at W = 2, hidden H, expert FFN F, rows per rank = tokens x top-k)
CONFIGS = {
    "mixtral": (4, 4096, 14336, 16384),
    "qwen3-30b-a3b": (64, 2048, 768, 65536),
    "deepseek-v3": (128, 7168, 2048, 32768),
}
TOY_CONFIGS = {"toy": (3, 32, 24, 200)}  # for a dry run of the bench's plumbing on the CPU
ROUTINGS = ("balanced", "zipf")
PROJS = ("up", "down")

# Tile variants the sweep times (kernels/grouped_gemm.py's default_tile comes from these), each in the forms named
# in SWEEP_FORMS. Suffix: -np one program per tile of the bound, -p one persistent program per SM taking tiles by
# stride, -pd the same taking tiles from an atomic counter, -flat the same (by stride) in one flattened loop
# (no signals: chunks only); -h half-height tail tiles, -s32 transposed tail tiles of <= 32 rows, -mix light
# tiles spread among heavy ones. (Earlier sweeps, with more shapes, are in benchmarks/results/logs/moe-gemm/.)
_T = GroupedTile
SWEEP_TILES = {
    "s3-np-h": _T(128, 256, 64, 8, 3, 8, None, half_tail=True),
    "s3-np-h-s32-mix": _T(128, 256, 64, 8, 3, 8, None, half_tail=True, swap_rows=32, mix=True),
    "s4-np-h-s32-mix": _T(128, 256, 64, 8, 4, 8, None, half_tail=True, swap_rows=32, mix=True),
    "s4-p-h": _T(128, 256, 64, 8, 4, 8, 0, half_tail=True),
    "s4-pd-h": _T(128, 256, 64, 8, 4, 8, 0, dynamic=True, half_tail=True),
    "s4-pd-h-mix": _T(128, 256, 64, 8, 4, 8, 0, dynamic=True, half_tail=True, mix=True),
    "s4-pd-h-s32": _T(128, 256, 64, 8, 4, 8, 0, dynamic=True, half_tail=True, swap_rows=32),
    "s4-pd-h-s32-mix": _T(128, 256, 64, 8, 4, 8, 0, dynamic=True, half_tail=True, swap_rows=32, mix=True),
    "s4-flat": _T(128, 256, 64, 8, 4, 8, 0, flat=True),
    "s3-flat-mix": _T(128, 256, 64, 8, 3, 8, 0, flat=True, mix=True),
}
# Forms: "one" (one launch, signals per source, heavy-first: t_triton_ms), "chunks" (per source chunk, no signals:
# t_chunks_ms), "signal" (one launch, one program per tile, sources in round order: t_signal_ms; the tile's
# launch shape is replaced, so only its tail options count).
SWEEP_FORMS = {
    "s3-np-h": ("one", "chunks", "signal"),
    "s3-np-h-s32-mix": ("one", "chunks", "signal"),
    "s4-np-h-s32-mix": ("one", "chunks"),
    "s4-p-h": ("one", "chunks"),
    "s4-pd-h": ("one", "chunks"),
    "s4-pd-h-mix": ("one", "chunks"),
    "s4-pd-h-s32": ("one", "chunks"),
    "s4-pd-h-s32-mix": ("one", "chunks"),
    "s4-flat": ("chunks",),
    "s3-flat-mix": ("chunks",),
}


def routing_counts(rows: int, experts: int, routing: str, seed: int = 0) -> torch.Tensor:
    """Rows per (source rank, local expert), ``[WORLD, experts]`` int64, summing to ``rows``."""
    if routing == "balanced":
        flat = torch.full((WORLD * experts,), rows // (WORLD * experts), dtype=torch.int64)
        flat[: rows - int(flat.sum())] += 1
        return flat.view(WORLD, experts)
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.arange(1, experts + 1, dtype=torch.float64) ** -1.2
    popularity = popularity[torch.randperm(experts, generator=gen)]
    expert = torch.multinomial(popularity, rows, replacement=True, generator=gen)
    source = torch.randint(0, WORLD, (rows,), generator=gen)
    return torch.bincount(source * experts + expert, minlength=WORLD * experts).view(WORLD, experts)


class Slice:
    """One rank's operands at one (config, routing, proj), in the dispatch layout and regrouped by expert."""

    def __init__(self, config: str, routing: str, proj: str, seed: int = 0, device: str = "cuda"):
        experts, hidden, ffn, rows = CONFIGS[config] if config in CONFIGS else TOY_CONFIGS[config]
        self.k, self.n = (hidden, 2 * ffn) if proj == "up" else (ffn, hidden)
        self.experts, self.rows = experts, rows
        self.counts = routing_counts(rows, experts, routing, seed)  # [WORLD, experts], dispatch order
        dev = torch.device(device)
        gen = torch.Generator(device=dev).manual_seed(seed + 1)
        self.x = torch.randn(rows, self.k, dtype=torch.bfloat16, device=dev, generator=gen)
        self.w = torch.randn(experts, self.k, self.n, dtype=torch.bfloat16, device=dev, generator=gen)
        self.w /= self.k**0.5
        flat = self.counts.flatten()
        self.seg_ends = flat.cumsum(0).to(torch.int32).to(dev)
        self.seg_expert = torch.arange(experts, dtype=torch.int32).repeat(WORLD).to(dev)
        self.seg_source = torch.arange(WORLD, dtype=torch.int32).repeat_interleave(experts).to(dev)
        # The NCCL combine's priorities on rank 0: the peers in their rounds (comm/expert_nccl.py), the own last.
        self.seg_round = torch.tensor([1] * experts + [0] * experts, dtype=torch.int32, device=dev)
        self.flags = torch.zeros(WORLD, dtype=torch.int32, device=dev)
        # Host-side segment bounds (the loops need them; the Triton and _grouped_mm calls do not).
        ends = flat.cumsum(0).tolist()
        self.segments = list(zip([0, *ends[:-1]], ends, [e for _ in range(WORLD) for e in range(experts)]))
        # Expert-major regrouping: rows of expert e from every source, sources in order.
        order = sorted(range(len(self.segments)), key=lambda i: (self.segments[i][2], i))
        perm = torch.cat([torch.arange(self.segments[i][0], self.segments[i][1]) for i in order])
        self.perm = perm.to(dev)
        self.x_by_expert = self.x[self.perm].contiguous()
        per_expert = self.counts.sum(0)
        self.offs = per_expert.cumsum(0).to(torch.int32).to(dev)
        expert_ends = per_expert.cumsum(0).tolist()
        self.expert_bounds = list(zip([0, *expert_ends[:-1]], expert_ends))
        chunk_ends = self.counts.sum(1).cumsum(0).tolist()
        # Per source chunk: first row, end row, segment ends relative to the chunk (multiply_chunk's ``ends``).
        self.chunks = [(a, b, self.counts[s].cumsum(0).to(torch.int32).to(dev))
                       for s, (a, b) in enumerate(zip([0, *chunk_ends[:-1]], chunk_ends))]
        self.local_experts = torch.arange(experts, dtype=torch.int32, device=dev)
        self.workspace = torch.empty(workspace_size(experts), dtype=torch.int32, device=dev)
        self.out = torch.empty(rows, self.n, dtype=torch.bfloat16, device=dev)

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.k * self.n

    def default_tile(self) -> GroupedTile:
        return default_tile(self.rows, self.experts, self.k, self.n)

    def chunk_tile(self, a: int, b: int) -> GroupedTile:
        return default_tile(b - a, self.experts, self.k, self.n)

    def triton(self, tile: GroupedTile | None = None, order: str = "heavy-first", signals: bool = True):
        """One launch over every chunk, one signal group per source (``t_triton_ms``)."""
        signal, flags = (self.seg_source, self.flags) if signals else (None, None)
        return lambda: grouped_gemm(self.x, self.w, Segments(self.seg_ends, self.seg_expert, signal=signal),
                                    out=self.out, flags=flags, launch=GroupedLaunch(order=order, tile=tile))

    def triton_signal(self, tile: GroupedTile | None = None):
        """As the NCCL combine's signalling GEMM: sources in round order, one program per tile (``t_signal_ms``)."""
        tile = dataclasses.replace(tile or self.default_tile(), num_programs=None, dynamic=False)
        segments = Segments(self.seg_ends, self.seg_expert, signal=self.seg_source, priority=self.seg_round)
        launch = GroupedLaunch(order="heavy-first", max_rows=self.rows, tile=tile)
        return lambda: grouped_gemm(self.x, self.w, segments, out=self.out, flags=self.flags, launch=launch)

    def triton_chunks(self, tile: GroupedTile | None = None):
        """One launch per source chunk, as ``multiply_chunk`` runs it (``t_chunks_ms``)."""
        def run():
            for a, b, ends in self.chunks:
                if b > a:
                    grouped_gemm(self.x[a:b], self.w, Segments(ends, self.local_experts), out=self.out[a:b],
                                 workspace=self.workspace,
                                 launch=GroupedLaunch(max_rows=b - a, tile=tile or self.chunk_tile(a, b)))
        return run

    def triton_expert_groups(self, groups: int, tile: GroupedTile | None = None):
        """One launch per group of ``experts / groups`` consecutive local experts, over every source's rows of those
        experts where the dispatch layout holds them (segment starts and ends, no regrouping): what a dispatch that
        sent each destination its rows expert group by expert group would run once a group's rows from every
        source had landed (each expert's weights streamed once, not once per source)."""
        per = -(-self.experts // groups)
        launches = []
        for g in range(-(-self.experts // per)):  # no empty group where groups exceed the experts
            picked = [(a, b, e) for a, b, e in self.segments if g * per <= e < (g + 1) * per]
            starts, ends, experts = (torch.tensor(col, dtype=torch.int32, device=self.x.device) for col in zip(*picked))
            rows = sum(b - a for a, b, _ in picked)
            launches.append((starts, ends, experts, rows))

        def run():
            for starts, ends, experts, rows in launches:
                if rows:
                    launch = GroupedLaunch(max_rows=rows, tile=tile or default_tile(rows, per, self.k, self.n))
                    grouped_gemm(self.x, self.w, Segments(ends, experts, starts=starts), out=self.out,
                                 workspace=self.workspace, launch=launch)
        return run

    def cublas_expert_groups(self, groups: int):
        """``torch._grouped_mm`` once per expert group on its rows regrouped by expert (a receive layout that is
        expert-major within each group): the cuBLAS form of ``triton_expert_groups``."""
        per = -(-self.experts // groups)
        per_expert = self.counts.sum(0).tolist()
        launches, row = [], 0
        for g in range(-(-self.experts // per)):
            sizes = per_expert[g * per : (g + 1) * per]
            offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(self.x.device)
            launches.append((row, row + sum(sizes), g * per, g * per + len(sizes), offs))
            row += sum(sizes)

        def run():
            for a, b, e0, e1, offs in launches:
                if b > a:
                    torch._grouped_mm(self.x_by_expert[a:b], self.w[e0:e1], offs=offs)
        return run

    def exact_layout(self) -> Layout:
        """This slice's receive side as an exact-mode layout (the send side unused): what the paths' GEMM helpers
        read."""
        recv = self.counts.to(torch.int64).to(self.x.device)
        ends = recv.reshape(-1).cumsum(0)
        splits = tuple(int(v) for v in self.counts.sum(1))
        return Layout(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), recv, recv,
                      (ends - recv.reshape(-1)).to(torch.int32), ends.to(torch.int32), mode="exact", bound=None,
                      top_k=1, tokens=0, experts=WORLD * self.experts, send_splits=splits, recv_splits=splits,
                      max_pair_rows=max(splits))

    def hybrid(self):
        """The hybrid GEMM as the expert paths run it in exact mode (``comm/expert_nccl.py``, the same functions):
        each source chunk's heavy experts as it lands (a ``torch.mm`` per segment), then the light experts in one
        row-mapped Triton launch over every chunk (``t_hybrid_ms``)."""
        layout = self.exact_layout()
        splits = layout.recv_splits
        plan = ExpertPlan("dispatch", WORLD, WORLD * self.experts, self.k, self.n, 1, 0, gemm="hybrid",
                          hybrid=HYBRID_CUT)
        multiply = chunk_multiplier("hybrid", plan, layout, self.w, self.local_experts)
        light = light_multiplier("hybrid", plan, layout, self.w)
        at = [a for a, _, _ in self.chunks]

        def run():
            for chunk, rows in enumerate(splits):
                multiply(chunk, self.x, at[chunk], self.out, at[chunk], rows)
            if light is not None:
                light(self.x, self.out)
        return run

    def grouped_mm(self):
        return lambda: torch._grouped_mm(self.x_by_expert, self.w, offs=self.offs)

    def cublas_path(self):
        def run():
            for a, b, offs in self.chunks:
                torch._grouped_mm(self.x[a:b], self.w, offs=offs)
        return run

    def loop(self):
        def run():
            for e, (a, b) in enumerate(self.expert_bounds):
                if b > a:
                    torch.mm(self.x_by_expert[a:b], self.w[e], out=self.out[a:b])
        return run

    def loop_path(self):
        def run():
            for a, b, e in self.segments:
                if b > a:
                    torch.mm(self.x[a:b], self.w[e], out=self.out[a:b])
        return run

    def check(self, fn: Callable[[], object], what: str, signals: bool = False) -> float:
        """Relative error of ``fn``'s output (poisoned first) against ``torch._grouped_mm``; with ``signals``, every
        flag must read exactly 1 afterwards."""
        self.out.fill_(float("nan"))
        self.flags.zero_()
        fn()
        want = torch._grouped_mm(self.x_by_expert, self.w, offs=self.offs).float()
        got = self.out[self.perm].float()
        if torch.isnan(got).any():
            raise AssertionError(f"{what}: NaN in the output (a row was never written)")
        if signals and self.flags.tolist() != [1] * WORLD:
            raise AssertionError(f"{what}: flags {self.flags.tolist()} after the call, expected all 1")
        err = float((got - want).norm() / want.norm())
        if err > 1e-2:
            raise AssertionError(f"{what}: relative error {err:.2e} against torch._grouped_mm")
        return err


def _meta(argv: list[str]) -> dict:
    return {
        "gpu": torch.cuda.get_device_name(),
        "world_size_sliced": WORLD,
        "torch": torch.__version__,
        "triton": importlib.metadata.version("triton"),
        "commit": commit(),
        "command": os.environ.get("FLASHOVERLAP_COMMAND", "python -m benchmarks.moe_gemm " + shlex.join(argv)),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def bench_row(config: str, routing: str, proj: str, iters: int, warmup: int) -> dict:
    s = Slice(config, routing, proj)
    tile = s.default_tile()
    fns = {"chunks": s.triton_chunks(), "signal": s.triton_signal(), "triton": s.triton(tile),
           "grouped_mm": s.grouped_mm(), "cublas_path": s.cublas_path(), "loop": s.loop(),
           "loop_path": s.loop_path(), "hybrid": s.hybrid()}
    errs = {name: s.check(fns[name], name, signals=name in ("signal", "triton"))
            for name in ("chunks", "signal", "triton", "loop_path", "hybrid")}
    t = time_side_by_side(fns, warmup=warmup, iters=iters)  # flags need no reset: each call rewrites them
    a, b, _ = s.chunks[0]
    return {
        "config": config, "routing": routing, "proj": proj, "path": None, "experts": s.experts, "rows": s.rows,
        "K": s.k, "N": s.n, "max_expert_rows": int(s.counts.sum(0).max()), "t_ms": None,
        "t_grouped_mm_ms": t["grouped_mm"], "t_loop_ms": t["loop"], "tflops": None, "flops": s.flops,
        "t_chunks_ms": t["chunks"], "t_signal_ms": t["signal"], "t_triton_ms": t["triton"],
        "t_cublas_path_ms": t["cublas_path"], "t_loop_path_ms": t["loop_path"], "t_hybrid_ms": t["hybrid"],
        "chunks_vs_grouped_mm": t["grouped_mm"] / t["chunks"],
        "signal_vs_grouped_mm": t["grouped_mm"] / t["signal"],
        "triton_vs_grouped_mm": t["grouped_mm"] / t["triton"],
        "tile": dataclasses.asdict(tile), "tile_chunks": dataclasses.asdict(s.chunk_tile(a, b)),
        "host_us": {"chunks": host_us(fns["chunks"]), "triton": host_us(fns["triton"]),
                    "grouped_mm": host_us(fns["grouped_mm"])},
        "rel_err": errs,
    }


def sweep_row(config: str, routing: str, proj: str, iters: int, warmup: int) -> dict:
    s = Slice(config, routing, proj)
    fns: dict[str, Callable[[], object]] = {}
    failed = {}
    for name, tile in SWEEP_TILES.items():
        for form in SWEEP_FORMS[name]:
            make = {"one": s.triton, "chunks": s.triton_chunks, "signal": s.triton_signal}[form]
            try:
                s.check(make(tile), f"{form} {name}", signals=form != "chunks")
            except Exception as exc:  # a variant that does not compile, fit or check out is reported, not fatal
                failed[f"{form} {name}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"  {config} {routing} {proj} {form} {name}: {failed[f'{form} {name}']}", flush=True)
                continue
            fns[f"{form} {name}"] = make(tile)
    fns["grouped_mm"] = s.grouped_mm()
    fns["cublas_path"] = s.cublas_path()
    fns["loop"] = s.loop()
    t = time_side_by_side(fns, warmup=warmup, iters=iters)
    return {"config": config, "routing": routing, "proj": proj, "experts": s.experts, "rows": s.rows, "K": s.k,
            "N": s.n, "flops": s.flops, "t_ms": t, "failed": failed}


EXPERT_GROUPS = (2, 4, 8)


def expert_group_row(config: str, routing: str, proj: str, iters: int, warmup: int) -> dict:
    """Today's per-source form beside per-expert-group forms (``Slice.triton_expert_groups`` and
    ``cublas_expert_groups`` at each of ``EXPERT_GROUPS``; Triton with the default tile, the flattened persistent
    loop (``TILE_FLAT``) and the persistent dynamic tile (``TILE_MANY_EXPERTS``), each checked first; the cuBLAS
    ones are ``torch._grouped_mm`` itself on slices of its operands), timed side by side with
    ``torch._grouped_mm``: what a dispatch chunked by expert groups instead of by source would gain."""
    s = Slice(config, routing, proj)
    fns = {"grouped_mm": s.grouped_mm(), "chunks": s.triton_chunks()}
    for groups in EXPERT_GROUPS:
        for label, tile in (("triton", None), ("triton-flat", TILE_FLAT), ("triton-dynamic", TILE_MANY_EXPERTS)):
            fns[f"{label}/{groups} groups"] = s.triton_expert_groups(groups, tile)
            s.check(fns[f"{label}/{groups} groups"], f"{label}/{groups} groups")
        fns[f"cublas/{groups} groups"] = s.cublas_expert_groups(groups)
    t = time_side_by_side(fns, warmup=warmup, iters=iters)
    return {"config": config, "routing": routing, "proj": proj, "experts": s.experts, "rows": s.rows,
            "t_ms": t, "vs_grouped_mm": {name: t["grouped_mm"] / v for name, v in t.items()}}


def assign_paths(rows: list[dict]) -> None:
    """``path``, ``path_bounded``: the grouped GEMM the runtime runs at each slice in exact and bounded mode
    (``runtime.experts.choose_gemm``: the hybrid where ``hybrid_pays``, else the measured policy over Triton and
    cuBLAS per chunk), so that the table shows what a user's call runs. ``t_ms``, ``tflops``: at ``path``, from
    these rows' own times as the paths run it."""
    from flashoverlap.runtime.experts import choose_gemm

    key = {"triton": "t_chunks_ms", "cublas": "t_cublas_path_ms", "loop": "t_loop_path_ms", "hybrid": "t_hybrid_ms"}
    for r in rows:
        args = (r["experts"], r["rows"], r["K"], r["N"], torch.bfloat16, (9, 0))
        r["path"], r["path_bounded"] = (choose_gemm("exact", *args, chunks=WORLD),
                                        choose_gemm("bounded", *args, chunks=WORLD))
        r["t_ms"], r["t_bounded_ms"] = r[key[r["path"]]], r[key[r["path_bounded"]]]
        r["tflops"] = r["flops"] / r["t_ms"] / 1e9


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_gemm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="results JSON, e.g. benchmarks/results/h200x1-moe-gemm.json (default: none, "
                                      "the table printed only)")
    parser.add_argument("--sweep", help="time SWEEP_TILES instead and write them to this JSON")
    parser.add_argument("--expert-groups", help="time the per-expert-group forms (EXPERT_GROUPS) instead and write "
                        "them to this JSON")
    # Known names only: a misspelt routing or projection ran the other one under the misspelt label.
    parser.add_argument("--configs", default=list(CONFIGS), type=names_of(tuple(CONFIGS), "config"))
    parser.add_argument("--routings", default=list(ROUTINGS), type=names_of(ROUTINGS, "routing"))
    parser.add_argument("--projs", default=list(PROJS), type=names_of(PROJS, "projection"))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.moe_gemm: needs a CUDA GPU, found none: run it on a GPU machine, as its docstring shows",
              file=sys.stderr)
        return 1
    rows = []
    for config in args.configs:
        for routing in args.routings:
            for proj in args.projs:
                fn = expert_group_row if args.expert_groups else sweep_row if args.sweep else bench_row
                row = fn(config, routing, proj, args.iters, args.warmup)
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    if not (args.sweep or args.expert_groups):
        assign_paths(rows)
    if args.sweep:
        for r in rows:  # the fastest variants of each form, as a fraction of torch._grouped_mm's time
            g = r["t_ms"]["grouped_mm"]
            print(f"{r['config']} {r['routing']} {r['proj']}: g_mm {g:.3f} ms, cublas/chunk "
                  f"{g / r['t_ms']['cublas_path']:.3f}, loop {g / r['t_ms']['loop']:.3f}")
            for form in ("one", "chunks", "signal"):
                ranked = sorted(((name, v) for name, v in r["t_ms"].items() if name.startswith(form + " ")),
                                key=lambda kv: kv[1])
                print(f"    {form:6}: " + ", ".join(f"{name.split(' ', 1)[1]} {g / v:.3f}" for name, v in ranked))
    elif args.expert_groups:
        for r in rows:
            print(f"{r['config']} {r['routing']} {r['proj']}: vs torch._grouped_mm " + ", ".join(
                f"{name} {ratio:.3f}" for name, ratio in r["vs_grouped_mm"].items() if name != "grouped_mm"))
    else:
        print(f"{'config':14} {'routing':8} {'proj':4} {'path':6} {'bounded':7} {'g_mm':>7} {'chunks':>7} "
              f"{'g_mm/ch':>7} {'loop/s':>7} {'signal':>7} {'one':>7} {'loop':>7} {'t_ms':>7} {'ratio':>6} "
              f"{'one/gmm':>7}")
        for r in rows:
            print(f"{r['config']:14} {r['routing']:8} {r['proj']:4} {r['path']:6} {r['path_bounded']:7} "
                  f"{r['t_grouped_mm_ms']:7.3f} {r['t_chunks_ms']:7.3f} {r['t_cublas_path_ms']:7.3f} "
                  f"{r['t_loop_path_ms']:7.3f} {r['t_signal_ms']:7.3f} {r['t_triton_ms']:7.3f} "
                  f"{r['t_loop_ms']:7.3f} {r['t_ms']:7.3f} {r['t_grouped_mm_ms'] / r['t_ms']:6.3f} "
                  f"{r['triton_vs_grouped_mm']:7.3f}")
    target = args.sweep or args.expert_groups or args.out
    if target:
        with open(target, "w") as f:
            json.dump({"meta": _meta(argv), "rows": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
