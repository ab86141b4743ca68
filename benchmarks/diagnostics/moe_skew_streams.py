"""Can a grouped GEMM beat ``torch._grouped_mm`` at a skewed expert load, and in which layout? (Issue 20's skewed
DeepSeek-like target: 1.1x.)

Under Zipf(1.2) routing a rank's DeepSeek-like slice (128 local experts, H 7168, F 2048, 32768 rows at W = 2: ``bench
moe_gemm``'s ``Slice``) holds a few experts with thousands of rows (compute-bound) and many with a few dozen, whose
time is spent streaming their weights (58.7 MB each for the up projection). Experts with at least ``threshold`` rows
are *heavy*, the others *light*. Forms, each first checked against ``torch._grouped_mm`` on outputs poisoned with NaN:
- ``grouped_mm``, ``loop``: ``torch._grouped_mm`` and a ``torch.mm`` per expert, on the expert-major rows (every
  source's rows of an expert together);
- ``serial``: on the expert-major rows, the heavy experts a ``torch.mm`` each, then the light ones in one Triton
  grouped launch (``kernels.grouped_gemm``);
- ``split-triton``: the same with the two parts on two streams at once, cuBLAS told to leave ``sms`` SMs free
  (``torch._C._set_sm_carveout_experimental``) to the Triton launch's ``sms`` programs; ``split-gmm``: the light
  part as ``torch._grouped_mm`` per run of consecutive light experts instead;
- on the rows as the dispatch delivers them (per source, per expert): ``path``: the heavy experts' segments of the
  own source on all SMs, then the other sources' heavy segments beside one Triton launch over every source's light
  segments; ``heavy-src+light-em``: the heavy experts per (source, expert) segment, the light ones in one Triton
  launch on expert-major rows (which rows a light expert's tile covers is what the layout changes);
  ``heavy-em+light-src``: the reverse; ``heavy-src+light-gathered``: the heavy per segment, the light rows gathered
  expert-major (``index_select``), one Triton launch, and put back (``index_copy_``); ``heavy-src+light-rowmap``:
  the heavy per segment, the light ones in one Triton launch whose tiles take each light expert's rows from every
  source through a row map (``grouped_gemm(row_map=...)``): no copy, no new layout (what a path would run).

CUDA_VISIBLE_DEVICES=0 FLASHOVERLAP_COMMIT=<sha> PYTHONPATH=src \\
    python -m benchmarks.diagnostics.moe_skew_streams [out.json]
"""

import dataclasses
import json
import sys

import torch

from benchmarks.diagnostics.results_file import require_cuda, results_meta, write_results
from benchmarks.moe_gemm import Slice
from flashoverlap.kernels.grouped_gemm import (
    TILE_MANY_EXPERTS,
    GroupedLaunch,
    Segments,
    grouped_gemm,
    workspace_size,
)
from flashoverlap.tune.timing import time_side_by_side

CARVE = getattr(torch._C, "_set_sm_carveout_experimental", None)


class Split:
    """One slice's expert-major rows cut into heavy experts (a ``torch.mm`` each) and light ones."""

    def __init__(self, s: Slice, threshold: int):
        self.s = s
        per_expert = s.counts.sum(0).tolist()
        self.heavy = [(e, a, b) for e, (a, b) in enumerate(s.expert_bounds) if b - a >= threshold]
        light = [(e, a, b) for e, (a, b) in enumerate(s.expert_bounds) if 0 < b - a < threshold]
        self.light_rows = sum(b - a for _, a, b in light)
        self.heavy_rows = sum(b - a for _, a, b in self.heavy)
        dev = s.x.device
        self.starts = torch.tensor([a for _, a, _ in light], dtype=torch.int32, device=dev)
        self.ends = torch.tensor([b for _, _, b in light], dtype=torch.int32, device=dev)
        self.experts = torch.tensor([e for e, _, _ in light], dtype=torch.int32, device=dev)
        self.workspace = torch.empty(workspace_size(max(len(light), 1)), dtype=torch.int32, device=dev)
        # Runs of consecutive light experts: one torch._grouped_mm each.
        self.runs, run = [], []
        for e, size in enumerate(per_expert):
            if 0 < size < threshold or (size == 0 and run):
                run.append(e)
            elif run:
                self.runs.append(run)
                run = []
        if run:
            self.runs.append(run)
        self.run_calls = []
        for run in self.runs:
            e0, e1 = run[0], run[-1] + 1
            a, b = s.expert_bounds[e0][0], s.expert_bounds[e1 - 1][1]
            if b > a:
                offs = torch.tensor(per_expert[e0:e1], dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
                self.run_calls.append((a, b, e0, e1, offs))
        self.side = torch.cuda.Stream(dev)
        self.checking = False

    def _heavy(self, carve: int):
        s = self.s
        CARVE(carve)
        try:
            for e, a, b in self.heavy:
                torch.mm(s.x_by_expert[a:b], s.w[e], out=s.out[a:b])
        finally:
            CARVE(0)

    def triton(self, sms: int, serial: bool = False):
        """``serial``: the heavy experts on all SMs, then the light ones on ``sms`` programs, one stream."""
        s = self.s
        tile = dataclasses.replace(TILE_MANY_EXPERTS, num_programs=sms)

        def run():
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)
            self._heavy(0 if serial else sms)
            if serial:
                self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                grouped_gemm(s.x_by_expert, s.w, Segments(self.ends, self.experts, starts=self.starts), out=s.out,
                             workspace=self.workspace, launch=GroupedLaunch(max_rows=self.light_rows, tile=tile))
            main.wait_stream(self.side)
        return run

    def gmm(self, sms: int):
        """(``torch._grouped_mm`` has no ``out``: its results are copied into place only when ``checking``.)"""
        s = self.s
        total = torch.cuda.get_device_properties(s.x.device).multi_processor_count

        def run():
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)
            self._heavy(sms)
            with torch.cuda.stream(self.side):
                CARVE(total - sms)
                try:
                    for a, b, e0, e1, offs in self.run_calls:
                        y = torch._grouped_mm(s.x_by_expert[a:b], s.w[e0:e1], offs=offs)
                        if self.checking:
                            s.out[a:b] = y
                finally:
                    CARVE(0)
            main.wait_stream(self.side)
        return run


class PathSplit:
    """The same cut as the dispatch would run it on the rows as they land (``Slice.x``: per source, per expert):
    the heavy experts' rows of source 0 (the own chunk) as a ``torch.mm`` each on all SMs; then, once every chunk
    is in, the heavy experts' rows of the other sources (cuBLAS leaving ``sms`` SMs free) beside one Triton launch
    of ``sms`` programs over every source's rows of the light experts (their segments side by side: each light
    expert's weights streamed once, not once per source)."""

    def __init__(self, s: Slice, threshold: int):
        self.s = s
        per_expert = s.counts.sum(0).tolist()
        heavy = {e for e, size in enumerate(per_expert) if size >= threshold}
        self.own = [(a, b, e) for a, b, e in s.segments[: s.experts] if e in heavy and b > a]
        self.rest = [(a, b, e) for a, b, e in s.segments[s.experts :] if e in heavy and b > a]
        light = [(a, b, e) for a, b, e in s.segments if e not in heavy and b > a]
        self.light_rows = sum(b - a for a, b, _ in light)
        dev = s.x.device
        self.starts = torch.tensor([a for a, _, _ in light], dtype=torch.int32, device=dev)
        self.ends = torch.tensor([b for _, b, _ in light], dtype=torch.int32, device=dev)
        self.experts = torch.tensor([e for _, _, e in light], dtype=torch.int32, device=dev)
        self.workspace = torch.empty(workspace_size(max(len(light), 1)), dtype=torch.int32, device=dev)
        self.side = torch.cuda.Stream(dev)
        self.out2 = torch.empty_like(s.out)

    def mixed(self, split: "Split", heavy_by_source: bool):
        """One stream, all SMs: the heavy experts as a ``torch.mm`` per (source, expert) segment as they land
        (``heavy_by_source``) or per expert on the expert-major rows, then the light experts by one Triton launch on
        the other layout (expert-major where the heavy ones ran per source): which of the two parts the layout
        matters for. Writes the dispatch layout's rows of the heavy part and the expert-major rows of the light
        part, or the reverse; checked part by part by ``check_mixed``."""
        s = self.s

        def run():
            if heavy_by_source:
                for a, b, e in self.own + self.rest:
                    torch.mm(s.x[a:b], s.w[e], out=s.out[a:b])
                grouped_gemm(s.x_by_expert, s.w, Segments(split.ends, split.experts, starts=split.starts),
                             out=self.out2, workspace=self.workspace, launch=GroupedLaunch(max_rows=split.light_rows))
            else:
                for e, a, b in split.heavy:
                    torch.mm(s.x_by_expert[a:b], s.w[e], out=self.out2[a:b])
                grouped_gemm(s.x, s.w, Segments(self.ends, self.experts, starts=self.starts), out=s.out,
                             workspace=self.workspace, launch=GroupedLaunch(max_rows=self.light_rows))
        return run

    def gathered(self, split: "Split"):
        """What a path could run on the rows as they land without a new kernel: the heavy experts per (source,
        expert) segment as in ``mixed``, then the light experts' rows of every source gathered expert-major
        (``index_select``), one Triton launch over them, and their results put back in place (``index_copy_``):
        the dispatch layout's rows throughout."""
        s = self.s
        dev = s.x.device
        light = {int(e) for e in split.experts.tolist()}
        order = [(a, b, e) for e in sorted(light) for a, b, ee in s.segments if ee == e and b > a]
        idx = torch.cat([torch.arange(a, b) for a, b, _ in order] or [torch.empty(0, dtype=torch.int64)]).to(dev)
        sizes = [sum(b - a for a, b, ee in order if ee == e) for e in sorted(light)]
        ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
        experts = torch.tensor(sorted(light), dtype=torch.int32, device=dev)
        y = torch.empty(idx.numel(), s.n, dtype=s.out.dtype, device=dev)

        def run():
            for a, b, e in self.own + self.rest:
                torch.mm(s.x[a:b], s.w[e], out=s.out[a:b])
            if not order:
                return
            xl = s.x.index_select(0, idx)
            grouped_gemm(xl, s.w, Segments(ends, experts), out=y, workspace=self.workspace,
                         launch=GroupedLaunch(max_rows=idx.numel()))
            s.out.index_copy_(0, idx, y)
        return run

    def row_mapped(self, split: "Split"):
        """The hybrid as the paths run it, on the rows as they land: the heavy experts per (source, expert)
        segment (``torch.mm``), then one Triton launch over the light experts with each expert's rows from every
        source taken as one segment through a row map (``grouped_gemm(row_map=...)``): no copy, no new layout."""
        s = self.s
        dev = s.x.device
        light = sorted(int(e) for e in split.experts.tolist())
        pieces = [(a, b) for e in light for a, b, ee in s.segments if ee == e and b > a]
        row_map = torch.cat([torch.arange(a, b) for a, b in pieces] or [torch.empty(0, dtype=torch.int64)])
        row_map = row_map.to(torch.int32).to(dev)
        sizes = [sum(b - a for a, b, ee in s.segments if ee == e) for e in light]
        ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
        experts = torch.tensor(light, dtype=torch.int32, device=dev)
        workspace = torch.empty(workspace_size(max(len(light), 1)), dtype=torch.int32, device=dev)

        def run():
            for a, b, e in self.own + self.rest:
                torch.mm(s.x[a:b], s.w[e], out=s.out[a:b])
            if light:
                grouped_gemm(s.x, s.w, Segments(ends, experts, row_map=row_map), out=s.out, workspace=workspace,
                             launch=GroupedLaunch(max_rows=row_map.numel()))
        return run

    def check_mixed(self, split: "Split", fn, heavy_by_source: bool) -> float:
        s = self.s
        s.out.fill_(float("nan"))
        self.out2.fill_(float("nan"))
        fn()
        want = torch._grouped_mm(s.x_by_expert, s.w, offs=s.offs).float()
        inv = torch.empty_like(s.perm)
        inv[s.perm] = torch.arange(s.perm.numel(), device=s.perm.device)  # dispatch row -> expert-major row
        err = 0.0
        segs_dispatch = self.own + self.rest if heavy_by_source else [
            (a, b, e) for a, b, e in s.segments if b > a and int(self.experts.eq(e).any())]
        for a, b, _ in segs_dispatch:
            got = s.out[a:b].float()
            ref = want[inv[a:b]]
            err = max(err, float((got - ref).norm() / ref.norm().clamp_min(1e-30)))
        em = ([(a, b) for _, a, b in split.heavy] if not heavy_by_source
              else list(zip(split.starts.tolist(), split.ends.tolist())))
        for a, b in em:
            got = self.out2[a:b].float()
            err = max(err, float((got - want[a:b]).norm() / want[a:b].norm().clamp_min(1e-30)))
        if err != err:
            raise AssertionError("mixed form: NaN in a written row")
        return err

    def run(self, sms: int):
        s = self.s
        tile = dataclasses.replace(TILE_MANY_EXPERTS, num_programs=sms)

        def run():
            for a, b, e in self.own:
                torch.mm(s.x[a:b], s.w[e], out=s.out[a:b])
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)
            CARVE(sms)
            try:
                for a, b, e in self.rest:
                    torch.mm(s.x[a:b], s.w[e], out=s.out[a:b])
            finally:
                CARVE(0)
            with torch.cuda.stream(self.side):
                grouped_gemm(s.x, s.w, Segments(self.ends, self.experts, starts=self.starts), out=s.out,
                             workspace=self.workspace, launch=GroupedLaunch(max_rows=self.light_rows, tile=tile))
            main.wait_stream(self.side)
        return run


def check(s: Slice, fn, what: str, dispatch_layout: bool = False) -> float:
    s.out.fill_(float("nan"))
    fn()
    want = torch._grouped_mm(s.x_by_expert, s.w, offs=s.offs).float()
    got = (s.out[s.perm] if dispatch_layout else s.out).float()
    if torch.isnan(got).any():
        raise AssertionError(f"{what}: NaN in the output (a row was never written)")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def main() -> int:
    require_cuda("benchmarks.diagnostics.moe_skew_streams", path_only=True)
    if CARVE is None:
        print("this torch has no torch._C._set_sm_carveout_experimental", flush=True)
        return 1
    rows = []
    for routing in ("zipf", "balanced"):
        for proj in ("up", "down"):
            s = Slice("deepseek-v3", routing, proj)
            fns = {"grouped_mm": lambda s=s: torch._grouped_mm(s.x_by_expert, s.w, offs=s.offs), "loop": s.loop()}
            meta, splits = {}, []
            path_forms, mixed = set(), {}
            for threshold in (256, 512, 1024):
                split = Split(s, threshold)
                splits.append(split)
                meta[threshold] = {"heavy_experts": len(split.heavy), "heavy_rows": split.heavy_rows,
                                   "light_rows": split.light_rows, "light_runs": len(split.run_calls)}
                path = PathSplit(s, threshold)
                fns[f"heavy-src+light-rowmap t{threshold}"] = path.row_mapped(split)
                path_forms.add(f"heavy-src+light-rowmap t{threshold}")
                if not split.heavy:
                    continue
                fns[f"serial t{threshold} sms132"] = split.triton(132, serial=True)
                fns[f"split-gmm t{threshold} sms56"] = split.gmm(56)
                fns[f"heavy-src+light-gathered t{threshold}"] = path.gathered(split)
                path_forms.add(f"heavy-src+light-gathered t{threshold}")
                for by_source in (True, False):
                    name = f"heavy-{'src' if by_source else 'em'}+light-{'em' if by_source else 'src'} t{threshold}"
                    fns[name] = path.mixed(split, by_source)
                    mixed[name] = (path, split, by_source)
                for sms in (80, 96):
                    fns[f"split-triton t{threshold} sms{sms}"] = split.triton(sms)
                    fns[f"path t{threshold} sms{sms}"] = path.run(sms)
                    path_forms.add(f"path t{threshold} sms{sms}")
            errors = {}
            for split in splits:
                split.checking = True
            for name, fn in fns.items():
                if name in mixed:
                    path, split, by_source = mixed[name]
                    errors[name] = path.check_mixed(split, fn, by_source)
                elif name != "grouped_mm":
                    errors[name] = check(s, fn, name, dispatch_layout=name in path_forms)
            for split in splits:
                split.checking = False
            torch.cuda.synchronize()
            t = time_side_by_side(fns, warmup=3, iters=12)
            base = t["grouped_mm"]
            row = {"config": "deepseek-v3", "routing": routing, "proj": proj, "split": meta,
                   "t_ms": {k: round(v, 4) for k, v in t.items()},
                   "vs_grouped_mm": {k: round(base / v, 3) for k, v in t.items()},
                   "rel_err": {k: round(v, 6) for k, v in errors.items()}}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del s
            torch.cuda.empty_cache()
    write_results({"meta": results_meta("PYTHONPATH=src python -m benchmarks.diagnostics.moe_skew_streams OUT.json"),
                  "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
