"""Host time per call of the fp8 expert layer beside the bf16 one, on one GPU (issue 44's target: <= 1.15x bf16,
exact and bounded).

    PYTHONPATH=src python -m benchmarks.diagnostics.fp8_moe_host --out benchmarks/results

writes ``<out>/GPUx1-fp8-moe-host.json`` (``h200x1-``, ``h100x1-``: ``benchmarks/harness/gpu_tag.py``): rows {config,
mode, dtype ("bf16", "fp8-row", "fp8-block"), path, host_us, ratio_to_bf16, t_gpu_ms} and ``meta``. A one-rank NCCL
group (the NCCL expert path; one GPU cannot hold two NCCL ranks), per-rank slices of two MoE configs; one layer call =
``moe_dispatch_gemm`` (bf16 ``x``; fp8: quantised by the op), SwiGLU, ``moe_gemm_combine`` (fp8: the bf16 intermediate
quantised by the op), on a layout built once (exact mode's layout synchronises with the host, so it stays out of the
timing, as a model's layers share it). ``host_us``: the median host time to issue one call while the GPU is busy
(queued behind a GPU sleep); ``t_gpu_ms``: its GPU time (CUDA events, the median); the three dtypes of a config and
mode measured in interleaved rounds; with ``--profile`` each row keeps the cProfile of ten calls (``profile``: the 25
functions of most own time); with ``--parts`` each bounded row keeps its call's host time in parts (``parts_us``:
loops of 50 calls back to back; the layer, dispatch, SwiGLU, combine, fp8's set-up). With ``--new-routing``, rows of
mode ``exact, new routing`` too: exact mode with a new routing on every call (each routing's layout built before the
timing), as a training step's layer sees it: the experts' row counts change every call. A failing case is recorded
and the run goes on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.diagnostics.fp8_grouped import commit
from benchmarks.harness.gpu_tag import gpu_tag
from benchmarks.harness.timing import loop_host_us, profiled

FP8 = torch.float8_e4m3fn
CONFIGS = [  # (name, local experts, H, F, top-k, tokens)
    ("qwen3-30b-a3b", 64, 2048, 768, 8, 2048),
    ("mixtral-8x7b", 4, 4096, 14336, 2, 2048),
]


def fp8_weights(w: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [L, N, K]`` as the op's fp8 ``[L, K, N]`` view and its scales."""
    local, n, k = w.shape
    if scaling == "row":
        scale = (w.abs().amax(2) / 448).clamp_min(1e-12).float()
        return (w / scale[:, :, None]).to(FP8).transpose(1, 2), scale
    blocks = w.float().view(local, n // 128, 128, k // 128, 128)
    scale = (blocks.abs().amax((2, 4)) / 448).clamp_min(1e-12)
    q = (blocks / scale[:, :, None, :, None]).view(local, n, k).to(FP8)
    return q.transpose(1, 2), scale.transpose(1, 2).contiguous()


def layer_inputs(local: int, hidden: int, ffn: int, top_k: int, tokens: int, device: torch.device) -> tuple:
    """A config's layer inputs from seed 0: ``(x [T, H] bf16, routing [T, k], router weights [T, k], w13 [L, 2F, H],
    w2 [L, H, F])``, the weights nn.Linear-shaped in bf16."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, generator=gen).bfloat16()
    idx = fresh_routing(local, top_k, tokens, device, seed=0)
    weights = torch.softmax(torch.randn(tokens, top_k, device=device, generator=gen), -1)
    w13 = torch.randn(local, 2 * ffn, hidden, device=device, generator=gen).div_(hidden ** 0.5).bfloat16()
    w2 = torch.randn(local, hidden, ffn, device=device, generator=gen).div_(ffn ** 0.5).bfloat16()
    return x, idx, weights, w13, w2


def fresh_routing(local: int, top_k: int, tokens: int, device: torch.device, seed: int) -> torch.Tensor:
    """A routing ``[T, k]`` of ``seed`` (seed 0 the layer's, ``--new-routing`` one per call): each token's top-k of a
    random permutation of the local experts, so that the experts' row counts differ from one seed to the next."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(tokens, local, device=device, generator=gen).argsort(dim=1)[:, :top_k]


def layer_weights(dtype: str, w13: torch.Tensor, w2: torch.Tensor) -> tuple:
    """``(w_up, w_down, scale_up, scale_down)`` as the ops take them for ``dtype`` (``"bf16"``, ``"fp8-row"``,
    ``"fp8-block"``), from nn.Linear-shaped ``w13 [L, 2F, H]`` and ``w2 [L, H, F]``."""
    if dtype == "bf16":
        return w13.transpose(1, 2), w2.transpose(1, 2), None, None
    scaling = dtype.split("-")[1]
    (w_up, s_up), (w_down, s_down) = fp8_weights(w13, scaling), fp8_weights(w2, scaling)
    return w_up, w_down, s_up, s_down


def measure(layers: list, iters: int) -> list[tuple[float, float]]:
    """``(host_us, gpu_ms)`` of each of ``layers``, the medians of ``iters`` interleaved rounds (one sample of each
    layer per round, so that a slow spell of the host falls on all alike); a host sample is one call issued while
    the GPU is busy (queued behind a GPU sleep), a GPU sample one call timed by CUDA events."""
    for layer in layers:
        for _ in range(3):
            layer()
    torch.cuda.synchronize()
    host, gpu = [[] for _ in layers], [[] for _ in layers]
    for _ in range(iters):
        for layer, host_samples, gpu_samples in zip(layers, host, gpu):
            torch.cuda._sleep(20_000_000)  # about 10 ms: the GPU is busy while the call is issued
            start = time.perf_counter()
            layer()
            host_samples.append((time.perf_counter() - start) * 1e6)
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            layer()
            end.record()
            end.synchronize()
            gpu_samples.append(begin.elapsed_time(end))
    return [(statistics.median(h), statistics.median(g)) for h, g in zip(host, gpu)]


def loop_us(fns: dict, rounds: int = 15, calls: int = 50) -> dict:
    """Host time per call of each of ``fns`` in a loop of ``calls`` back to back (the GPU busy ahead), the median of
    ``rounds`` interleaved rounds: the parts of a layer call (``--parts``)."""
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(loop_host_us(fn, calls, 200_000_000))
    return {name: round(statistics.median(values), 1) for name, values in samples.items()}


def layer_parts(x, layout, weights, ffn: int, dtype: str, w13, w2, path: str) -> dict:
    """A bounded layer call's host time in parts (loops, ``loop_us``): the whole layer, dispatch alone, SwiGLU
    alone, combine alone; fp8: the op's own fp8 checks (``_fp8_operands``; before 2026-12-04's second session also
    the wire rows' allocation, now the call's own issued step) and the runtime's call from there."""
    from flashoverlap.ops.moe import _fp8_operands, moe_dispatch_gemm, moe_gemm_combine

    w_up, w_down, s_up, s_down = layer_weights(dtype, w13, w2)
    h = moe_dispatch_gemm(x, w_up, layout, path=path, scale_w=s_up)
    a = F.silu(h[:, :ffn]) * h[:, ffn:]
    fns = {
        "layer": lambda: moe_gemm_combine(F.silu((g := moe_dispatch_gemm(x, w_up, layout, path=path, scale_w=s_up))
                                                 [:, :ffn]) * g[:, ffn:], w_down, weights, layout, path=path,
                                          scale_w=s_down),
        "dispatch": lambda: moe_dispatch_gemm(x, w_up, layout, path=path, scale_w=s_up),
        "swiglu": lambda: F.silu(h[:, :ffn]) * h[:, ffn:],
        "combine": lambda: moe_gemm_combine(a, w_down, weights, layout, path=path, scale_w=s_down),
    }
    if s_up is not None:
        fns["dispatch's _fp8_operands"] = lambda: _fp8_operands("moe_dispatch_gemm", x, w_up, None, s_up,
                                                                ("x", "w_up", "scale_x"))
        fns["combine's _fp8_operands"] = lambda: _fp8_operands("moe_gemm_combine", a, w_down, None, s_down,
                                                               ("a", "w_down", "scale_a"))
    for fn in fns.values():
        for _ in range(3):
            fn()
    before = graph_counts()
    parts = loop_us(fns)
    after = graph_counts()
    # The loops' own graph use: a repeated call replays (captures stay 0 once warm; eager calls replay nothing).
    parts["loops' captures"] = after[0] - before[0]
    parts["loops' replays"] = after[1] - before[1]
    return parts


def graph_counts() -> tuple[int, int]:
    """The group's communicators' graph captures and replays so far (``CallGraphs``), summed."""
    from flashoverlap.runtime.context import existing_context

    context = existing_context(dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()))
    graphs = [getattr(comm, "graphs", None) for comm in (context.communicators.values() if context else ())]
    graphs = [g for g in graphs if g is not None]
    return sum(g.captures for g in graphs), sum(g.replays for g in graphs)


def main() -> None:
    import flashoverlap as fo
    from flashoverlap.ops.moe import moe_dispatch_gemm, moe_gemm_combine

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--path", default="nccl", choices=("nccl", "reference", "auto"),
                        help="the expert ops' path on the one-rank NCCL group (default nccl)")
    parser.add_argument("--parts", action="store_true",
                        help="bounded rows: the layer's host time in parts, loops of calls (parts_us)")
    parser.add_argument("--profile", action="store_true",
                        help="keep each row's cProfile (10 calls issued while the GPU is busy; top 25 by own time)")
    parser.add_argument("--new-routing", action="store_true",
                        help="also exact mode with a new routing on every call (rows mode 'exact, new routing'), as "
                             "a training step's layer sees it; each routing's layout built before the timing")
    args = parser.parse_args()
    from benchmarks.diagnostics.results_file import require_cuda

    require_cuda("benchmarks.diagnostics.fp8_moe_host")
    path = Path(args.out) / f"{gpu_tag()}x1-fp8-moe-host.json"  # named for the GPU (h200x1-, h100x1-)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.set_device(0)
    # The store's file must outlive the group: NCCL makes its communicator on the first collective, through it.
    store_dir = tempfile.TemporaryDirectory()
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(store_dir.name, 'init')}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    meta = {"gpus": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
            "command": "python -m benchmarks.diagnostics.fp8_moe_host " + shlex.join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "world_size": 1}
    rows = []
    dev = torch.device("cuda")
    for name, local, hidden, ffn, top_k, tokens in CONFIGS:
        x, idx, weights, w13, w2 = layer_inputs(local, hidden, ffn, top_k, tokens, dev)
        for mode in ("exact", "bounded") + (("exact, new routing",) if args.new_routing else ()):
            bound = tokens * top_k if mode == "bounded" else None
            if mode == "exact, new routing":  # a layout per call: the first, the warm-up, the host and GPU samples
                # (``--profile``'s ten calls come round to routings seen before)
                layouts = [fo.moe_layout(fresh_routing(local, top_k, tokens, dev, seed), local, mode="exact")
                           for seed in range(1, 5 + 2 * args.iters)]
            else:
                layouts = [fo.moe_layout(idx, local, mode=mode, bound=bound)]
            rows_here, layers = [], []
            for dtype in ("bf16", "fp8-row", "fp8-block"):
                row = {"config": name, "mode": mode, "dtype": dtype, "path": args.path, "experts": local,
                       "hidden": hidden, "ffn": ffn, "top_k": top_k, "tokens": tokens}
                try:
                    w_up, w_down, s_up, s_down = layer_weights(dtype, w13, w2)
                    turn = itertools.cycle(layouts)  # each dtype's calls walk the routings from the first

                    def layer(w_up=w_up, w_down=w_down, s_up=s_up, s_down=s_down, turn=turn, x=x, ffn=ffn,
                              weights=weights):
                        layout = next(turn)  # the same layout on every call, or (new routing) the next one
                        h = moe_dispatch_gemm(x, w_up, layout, path=args.path, scale_w=s_up)
                        a = F.silu(h[:, :ffn]) * h[:, ffn:]
                        return moe_gemm_combine(a, w_down, weights, layout, path=args.path, scale_w=s_down)

                    with torch.no_grad():
                        layer()  # a failing case is recorded here, before the interleaved rounds
                    layers.append(layer)
                except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
                    traceback.print_exc()
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows_here.append(row)
            good = [row for row in rows_here if "error" not in row]
            try:
                with torch.no_grad():
                    figures = measure(layers, args.iters)
                    for row, layer, (host_us, gpu_ms) in zip(good, layers, figures):
                        row.update(host_us=host_us, t_gpu_ms=gpu_ms)
                        if args.profile:
                            row["profile"] = profiled(layer, 10, 400_000_000)  # top 25 by own time
                        if args.parts and mode == "bounded":
                            row["parts_us"] = layer_parts(x, layouts[0], weights, ffn, row["dtype"], w13, w2,
                                                          args.path)
                            print(row["dtype"], row["parts_us"], flush=True)
            except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
                traceback.print_exc()
                for row in good:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            base = next((row.get("host_us") for row in rows_here if row["dtype"] == "bf16"), None)
            for row in rows_here:
                row["ratio_to_bf16"] = None if base is None or row.get("host_us") is None else row["host_us"] / base
                print(f"{name} {mode} {row['dtype']}: host {row.get('host_us')} us, gpu {row.get('t_gpu_ms')} ms, "
                      f"ratio {row.get('ratio_to_bf16')}", flush=True)
            rows += rows_here
            path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    dist.destroy_process_group()
    store_dir.cleanup()
    print(f"wrote {path} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
