"""Host-bound or not: the loop a model runs (docs/benchmarks.md, "Host-bound or not"). For each shape, op and path,
``LOOP`` calls back to back on the same tensors:

- ``host_us``: the time to issue one call (no synchronisation inside the loop), per call;
- ``wall_us``: issue plus the final synchronisation, per call: what a model's loop of such calls takes (started,
  like the GPU-time loop, after the same GPU sleep, so that both loops find the GPU in the same state);
- ``gpu_us``: the same loop queued behind a long ``torch.cuda._sleep``, timed by CUDA events from the sleep's end,
  per call: the GPU's own time, with the host never what the GPU waits on (the sleep outlasts the issue).

A path is host-bound where ``host_us`` > ``gpu_us``; there ``wall_us`` follows the host. Paths (one H200, a
one-rank NCCL group): ``torch.mm`` (bf16) or ``torch._scaled_mm`` (fp8 row-wise) alone; the sequential plan (the
library's matmul-then-collective communicator); the NCCL path under its overlapped plan (``allow_sequential=False``)
eager (``FLASHOVERLAP_REPLAY=0``) and replayed (the default: a repeated call is one graph launch). The P2P path's
host figures with ranks sharing the GPU are ``benchmarks/shared_ranks.py``'s.

``auto``: ``path="auto"`` with no plan, replayed (what a user's call gets). Under ``torchrun`` with W ranks (one GPU
each) the same rows at W, and the P2P path's, eager and replayed; the shapes are per-rank (all-gather: M gathered).

Run (one GPU; rows {shape, op, path, mode, dtype, W, M, N, K, host_us, gpu_us, wall_us}):

    PYTHONPATH=src python -m benchmarks.host_bound benchmarks/results/h200x1-host-bound.json [--quick]
        [--shapes=llama|grid] [--dtypes=bfloat16,fp8-row] [--ops=all_reduce,reduce_scatter,all_gather]
    PYTHONPATH=src torchrun --nproc-per-node 2 -m benchmarks.host_bound benchmarks/results/h200x2-nvlink-host-bound.json
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time

import torch
import torch.distributed as dist

LOOP = 50
ROUNDS = 7  # each figure: the median over rounds, the entries of a case interleaved in each
SLEEP_CYCLES = 400_000_000  # about 0.2 s of GPU sleep ahead of the GPU-time loop: longer than any loop's issue
# Per-rank shapes of Llama-3-70B at TP = 8 (M, N, K; all-gather: M gathered), then the benchmark grid.
LLAMA = [("q,k,v", "all_gather", 8192, 1280, 8192), ("o", "reduce_scatter", 8192, 8192, 1024),
         ("up", "all_gather", 8192, 7168, 8192), ("down", "reduce_scatter", 8192, 8192, 3584),
         ("grid", "all_reduce", 4096, 8192, 8192)]
GRID = [(op, m, n, k) for op in ("all_reduce", "reduce_scatter")
        for m, n, k in ((4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 4096), (8192, 8192, 14336),
                        (2048, 8192, 14336))] + \
       [("all_gather", m, n, k) for m, n, k in ((4096, 8192, 8192), (8192, 14336, 8192), (16384, 8192, 8192),
                                                (8192, 28672, 8192))]


def _median(values):
    values = sorted(values)
    return values[len(values) // 2]


def loop_figures(fns: list) -> list[tuple[float, float, float]]:
    """``(host_us, gpu_us, wall_us)`` per call of ``LOOP`` calls of each of ``fns`` (see the module docstring),
    measured in interleaved rounds (one loop of each per round), so that a slow spell of the host falls on all."""
    samples = [([], [], []) for _ in fns]
    for _ in range(ROUNDS):
        for fn, (host, gpu, wall) in zip(fns, samples):
            _one_round(fn, host, gpu, wall)
    return [(1e6 * _median(h), 1e6 * _median(g), 1e6 * _median(w)) for h, g, w in samples]


def _one_round(fn, host, gpu, wall) -> None:
    getattr(fn, "begin", lambda: None)()
    # Both loops start after the same GPU rest (the sleep): the GPU-time loop always follows one, and a wall loop
    # that followed the last loop's GEMMs instead ran on a GPU nearer its power limit (torch.mm's own wall was up to
    # 1.10x its GPU time at the up projection on an H100, c294418c93: not the host, which issued it in 18 us a call).
    torch.cuda._sleep(SLEEP_CYCLES)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(LOOP):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    host.append((t1 - t0) / LOOP)
    wall.append((t2 - t0) / LOOP)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    t0 = time.perf_counter()
    for _ in range(LOOP):
        fn()
    issued = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    gpu.append(start.elapsed_time(end) / 1e3 / LOOP)
    if issued > 0.15:  # the sleep may have ended before the loop was issued: GPU time then includes host time
        print(f"  warning: the loop took {issued * 1e3:.0f} ms to issue, near the sleep's length", flush=True)


def _row_scaled(m, k, device, gen):
    """Row-wise fp8 operands: ``(a [M, K] e4m3, scale_a [M, 1])`` from fresh random values."""
    x = torch.randn(m, k, device=device, generator=gen)
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
    return (x / scale).to(torch.float8_e4m3fn), scale.float()


def _with_replay(fn, replay: bool, settings):
    """``fn`` run under ``FLASHOVERLAP_REPLAY`` on or off (``fn.begin()``, called before each timed loop, outside the
    timing: the switch is read when the settings are refreshed), so that the entries can be interleaved."""
    value = "1" if replay else "0"

    def begin():
        if os.environ.get("FLASHOVERLAP_REPLAY") != value:
            os.environ["FLASHOVERLAP_REPLAY"] = value
            settings.refresh()

    fn.begin = begin
    return fn


OPS = ("all_reduce", "reduce_scatter", "all_gather")


def cases(quick: bool, shapes: str = "all", ops: tuple[str, ...] = OPS):
    """The Llama shapes (with one grid shape), then the rest of the grid unless ``quick``; ``shapes``: ``"llama"``
    or ``"grid"`` for one set alone; ``ops``: the ops kept."""
    rows = [(name, op, m, n, k) for name, op, m, n, k in LLAMA] if shapes != "grid" else []
    if not quick and shapes != "llama":
        rows += [("grid", op, m, n, k) for op, m, n, k in GRID
                 if shapes == "grid" or (op, m, n, k) != ("all_reduce", 4096, 8192, 8192)]
    return [row for row in rows if row[1] in ops]


def measure(quick: bool, device: torch.device, world: int, shapes: str = "all",
            dtypes: tuple[str, ...] = ("bfloat16", "fp8-row"), done=None, ops: tuple[str, ...] = OPS) -> list[dict]:
    """Every case's rows; ``done(rows)`` after each case with the rows so far (the caller writes them: a run
    cut short keeps what it measured)."""
    import flashoverlap as fo
    from flashoverlap import settings
    from flashoverlap.tune.fp8 import fp8_tiles

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    bf16_ops, fp8_ops = fo.ops.GEMM_OPS, fo.ops.SCALED_OPS
    results = []
    for name, op, m, n, k in cases(quick, shapes, ops):
        rows_a = m // world if op == "all_gather" else m  # all-gather: M is the gathered size
        for dtype in dtypes:
            fp8 = dtype != "bfloat16"
            if fp8:
                a, sa = _row_scaled(rows_a, k, device, gen)
                w, sw = _row_scaled(n, k, device, gen)
                b, sb = w.t(), sw.reshape(1, n)
                tile = fp8_tiles(m, n, k, "row", op).tile_config()
                overlapped = fo.default_plan(op, m, n, k, world, num_sms=sms, tile=tile, allow_sequential=False)

                def call(plan, path="nccl", fn=fp8_ops[op], a=a, b=b, sa=sa, sb=sb):
                    return lambda: fn(a, b, sa, sb, path=path, plan=plan)

                def alone(a=a, b=b, sa=sa, sb=sb):
                    return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
                alone_name = "scaled_mm"
            else:
                a = torch.randn(rows_a, k, dtype=torch.bfloat16, device=device, generator=gen)
                b = (torch.randn(n, k, dtype=torch.bfloat16, device=device, generator=gen) / k**0.5).t()
                overlapped = fo.default_plan(op, m, n, k, world, num_sms=sms, allow_sequential=False)

                def call(plan, path="nccl", fn=bf16_ops[op], a=a, b=b):
                    return lambda: fn(a, b, path=path, plan=plan)

                def alone(a=a, b=b):
                    return torch.mm(a, b)
                alone_name = "mm"
            sequential = fo.default_plan(op, m, n, k, world, num_sms=sms, comm_ratio=0.0)
            assert sequential.sequential and not overlapped.sequential, (sequential, overlapped)
            entries = [(alone_name, "eager", alone), ("sequential", "eager", call(sequential)),
                       ("nccl", "eager", call(overlapped)), ("nccl", "replayed", call(overlapped)),
                       ("auto", "replayed", call(None, "auto"))]
            if world > 1:  # the P2P path needs peers (on one GPU: benchmarks/shared_ranks.py)
                p2p = fo.default_plan(op, m, n, k, world, num_sms=sms, path="p2p", allow_sequential=False)
                entries += [("p2p", "eager", call(p2p, "p2p")), ("p2p", "replayed", call(p2p, "p2p"))]
            # Each entry sets the replay switch itself (it is read per call), so the entries can be interleaved.
            timed = [(path, mode, _with_replay(fn, mode == "replayed", settings)) for path, mode, fn in entries]
            base = {"shape": name, "op": op, "dtype": dtype, "W": world, "M": m, "N": n, "K": k}
            try:
                for _, _, fn in timed:
                    fn.begin()
                    for _ in range(3):  # warm: compile, NCCL state, plan tables; replay: capture
                        fn()
                torch.cuda.synchronize()
                figures = loop_figures([fn for _, _, fn in timed])
                rows = [{**base, "path": path, "mode": mode, "host_us": round(host, 1), "gpu_us": round(gpu, 1),
                         "wall_us": round(wall, 1)} for (path, mode, _), (host, gpu, wall) in zip(timed, figures)]
            except Exception as exc:  # one case's failure must not lose the others' rows
                rows = [{**base, "error": f"{type(exc).__name__}: {exc}"[:500]}]
            for row in rows if dist.get_rank() == 0 else ():
                print(row, flush=True)
            results.extend(rows)
            if done is not None:
                done(results)
    os.environ.pop("FLASHOVERLAP_REPLAY", None)
    settings.refresh()
    return results


def replay_counts(device: torch.device) -> dict:
    from flashoverlap.runtime.context import existing_context

    context = existing_context(dist.group.WORLD, device)
    counts = {}
    for path in ("nccl", "p2p"):
        comm = None if context is None else context.communicators.get(("gemm", path))
        graphs = getattr(comm, "graphs", None)
        if graphs is not None:
            counts[path] = {"captures": graphs.captures, "replays": graphs.replays}
    return counts


def parse_args(argv: list[str] | None = None):
    """The command line, checked before the GPU is looked for: a misspelt option or value is a usage error (the
    options were read by hand, and a misspelt one ran every case)."""
    import argparse

    from flashoverlap.cli import names_of

    p = argparse.ArgumentParser(prog="python -m benchmarks.host_bound", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("out", nargs="?", default=None, help="results JSON (none: the rows are printed only)")
    p.add_argument("--quick", action="store_true", help="one shape per op")
    p.add_argument("--shapes", choices=("all", "llama", "grid"), default="all")
    p.add_argument("--dtypes", type=names_of(("bfloat16", "fp8-row"), "dtype"), default=("bfloat16", "fp8-row"),
                   help="bfloat16 and/or fp8-row, comma-separated")
    p.add_argument("--ops", type=names_of(OPS, "op"), default=OPS, help="some of " + ",".join(OPS))
    return p.parse_args(argv)


def main() -> None:
    from benchmarks.diagnostics.results_file import require_cuda, results_meta

    parsed = parse_args()
    require_cuda("benchmarks.host_bound", per_rank="LOCAL_RANK" in os.environ)
    args = [parsed.out] if parsed.out else []
    quick, shapes, dtypes, ops = parsed.quick, parsed.shapes, tuple(parsed.dtypes), tuple(parsed.ops)
    launched = "LOCAL_RANK" in os.environ  # under torchrun: W ranks, one GPU each
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        if launched:
            dist.init_process_group("nccl", device_id=device)
        else:  # one process: a one-rank NCCL group
            dist.init_process_group("nccl", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1,
                                    device_id=device)
        world = dist.get_world_size()
        launcher = f"torchrun --nproc-per-node {world} -m benchmarks.host_bound" if launched else \
            "python -m benchmarks.host_bound"
        command = f"PYTHONPATH=src {launcher} " + shlex.join(sys.argv[1:])

        def write(rows, counts=None):
            if not args or local != 0:
                return
            import json

            results = {"meta": results_meta(command, gpus=f"{world}x {torch.cuda.get_device_name(device)}",
                                            loop=LOOP, rounds=ROUNDS, graphs=counts), "rows": rows}
            with open(args[0], "w") as f:
                json.dump(results, f, indent=1)

        try:
            rows = measure(quick, device, world, shapes, dtypes, done=write, ops=ops)
            write(rows, replay_counts(device))
        finally:
            dist.destroy_process_group()

if __name__ == "__main__":
    main()
