"""Where an eager fp8 NCCL-path call's extra host time goes (issue 41: the 250 µs eager target holds for bf16 at every
Llama-3-70B TP = 8 shape, not for fp8 row-wise at q,k,v and the grid's all-reduce). On a one-rank NCCL group, per
shape, bf16 beside fp8 row-wise under the overlapped plans ``host_bound.py`` times (``allow_sequential=False``, fp8
with its tiles), issued eagerly (``FLASHOVERLAP_REPLAY=0``) with the GPU busy ahead:

- ``parts_us``: the whole call and its parts timed alone, interleaved (``host_us_interleaved``): the pipeline before
  the communicator (signature, registry lookup, the ``Call``), the signalling GEMM's launch as the communicator makes
  it (``kernels.gemm.gemm``: its checks, arguments and launch), its ``launch_arguments`` alone, and ``Scales.of``;
- ``fast_launches``: the kernel launcher's direct launches over a loop of calls (a call whose launch misses the
  launcher's cache pays the JIT's launch: kernels/launch.py);
- ``own_us``: cProfile over ``CALLS`` calls, each function's own time per call in µs, the functions whose fp8 own
  time exceeds bf16's most (a profile's absolute times are inflated; its differences say where to look).

PYTHONPATH=src python -m benchmarks.diagnostics.fp8_eager_parts [out.json]
"""

from __future__ import annotations

import pstats
import shlex
import sys

import torch

from benchmarks.diagnostics.results_file import one_gpu_setup, one_rank_nccl_diagnostic, results_meta
from benchmarks.harness.timing import host_us_interleaved, profile_of
from benchmarks.host_bound import LLAMA, _row_scaled

SHAPES = ("q,k,v", "o", "grid")
CALLS = 200
ROUNDS = 40
SLEEP_CYCLES = 1_000_000_000  # GPU sleep ahead of a profiled loop: longer than its issue


def _own_us(fn, calls: int) -> dict[str, float]:
    """cProfile's own time per call (µs) of each function over ``calls`` calls of ``fn``, GPU busy ahead."""
    stats = pstats.Stats(profile_of(fn, calls, SLEEP_CYCLES)).stats
    return {f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({name})": own / calls * 1e6
            for (file, line, name), (_, _, own, _, _) in stats.items()}


def main() -> dict:
    device, sms, gen = one_gpu_setup(replay=False)
    out = {"meta": results_meta("python -m benchmarks.diagnostics.fp8_eager_parts " + shlex.join(sys.argv[1:])),
           "rows": [_shape_row(shape, op, m, n, k, device, sms, gen) for shape, op, m, n, k in LLAMA
                    if shape in SHAPES]}
    return out


def _shape_row(shape: str, op: str, m: int, n: int, k: int, device, sms: int, gen) -> dict:
    import flashoverlap as fo
    from flashoverlap import settings
    from flashoverlap.comm.scaled import Scales
    from flashoverlap.kernels import gemm as gemm_module
    from flashoverlap.runtime.calls import GEMM, GemmSpec
    from flashoverlap.runtime.context import REGISTRY
    from flashoverlap.tune.fp8 import fp8_tiles

    x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16()
    a8, sa = _row_scaled(m, k, device, gen)
    w8, sw = _row_scaled(n, k, device, gen)
    b8, sb = w8.t(), sw.reshape(1, n)
    plans = {"bf16": fo.default_plan(op, m, n, k, 1, num_sms=sms, allow_sequential=False),
             "fp8": fo.default_plan(op, m, n, k, 1, num_sms=sms, allow_sequential=False,
                                    tile=fp8_tiles(m, n, k, "row", op).tile_config())}
    bf16_op, fp8_op = fo.ops.GEMM_OPS[op], fo.ops.SCALED_OPS[op]
    calls = {"bf16": lambda: bf16_op(x, w.t(), path="nccl", plan=plans["bf16"]),
             "fp8": lambda: fp8_op(a8, b8, sa, sb, path="nccl", plan=plans["fp8"])}
    specs = {"bf16": GemmSpec(bf16_op.__name__, op, x, w.t(), None, plans["bf16"], "nccl"),
             "fp8": GemmSpec(fp8_op.__name__, op, a8, b8, None, plans["fp8"], "nccl", scales=Scales.of(sa, sb, n=n))}
    for fn in calls.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    env = settings.current()
    fns = {f"{dtype} call": fn for dtype, fn in calls.items()}
    for dtype, spec in specs.items():
        fns[f"{dtype} pipeline before the communicator"] = (
            lambda spec=spec: GEMM.call(spec, REGISTRY.lookup(GEMM.signature(spec, env)), env))
    fns["fp8 Scales.of"] = lambda: Scales.of(sa, sb, n=n)
    if op == "all_reduce":  # the signalling GEMM alone, as the communicator launches it
        counters = torch.zeros(64, dtype=torch.int32, device=device)
        c16 = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        scaling = gemm_module.Scaling(sa, sb, torch.bfloat16, None)
        bf16_args = (x, w.t(), plans["bf16"])
        fp8_args = (a8, b8, plans["fp8"])

        def bf16_gemm():
            gemm_module.gemm(*bf16_args, out=c16, counters=counters)
            counters.zero_()

        def fp8_gemm():
            gemm_module.gemm(*fp8_args, out=c16, counters=counters, scaling=scaling)
            counters.zero_()
        fns.update({"bf16 gemm launch + zero_": bf16_gemm, "fp8 gemm launch + zero_": fp8_gemm,
                    "bf16 launch_arguments": lambda: gemm_module.launch_arguments(*bf16_args, out=c16,
                                                                                  counters=counters),
                    "fp8 launch_arguments": lambda: gemm_module.launch_arguments(*fp8_args, out=c16,
                                                                                 counters=counters, scaling=scaling)})
    parts = host_us_interleaved(fns, calls=ROUNDS, pairs=(("fp8 call", "bf16 call"),))
    row = {"shape": shape, "op": op, "M": m, "N": n, "K": k,
           "groups": {d: p.num_groups for d, p in plans.items()}, "gemm": {d: p.gemm for d, p in plans.items()},
           "parts_us": {key: round(v, 1) for key, v in parts.items()}, "fast_launches": {}}
    for dtype, fn in calls.items():
        before = gemm_module._LAUNCH.fast_launches
        for _ in range(20):
            fn()
        row["fast_launches"][dtype] = f"{gemm_module._LAUNCH.fast_launches - before} of 20"
    torch.cuda.synchronize()
    own = {dtype: _own_us(fn, CALLS) for dtype, fn in calls.items()}
    names = own["fp8"].keys() | own["bf16"].keys()
    top = sorted(names, key=lambda name: own["bf16"].get(name, 0.0) - own["fp8"].get(name, 0.0))[:25]
    row["own_us"] = {name: {dtype: round(own[dtype].get(name, 0.0), 2) for dtype in own} for name in top}
    row["own_us_total"] = {dtype: round(sum(values.values()), 1) for dtype, values in own.items()}
    print(shape, op, row["parts_us"], row["fast_launches"], row["own_us_total"], flush=True)
    for name in top[:15]:
        print(f"   fp8 {row['own_us'][name]['fp8']:8.2f}  bf16 {row['own_us'][name]['bf16']:8.2f}  {name}", flush=True)
    return row


if __name__ == "__main__":
    one_rank_nccl_diagnostic("benchmarks.diagnostics.fp8_eager_parts", main)
