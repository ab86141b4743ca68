"""Where one ``kernels.grouped_gemm`` call spends its host time, beside ``torch._grouped_mm`` on the same operands
(one process, one GPU; a diagnostic, not a results file's figure).

Per case: the host time per call of back-to-back calls issued behind a long GPU sleep (so no launch waits for the
GPU), for ``torch._grouped_mm``, the full ``grouped_gemm`` call, and its parts, timed inside the same calls by
wrapping the module's two kernels and ``TensorDescriptor.from_tensor``: the segment-table launch, the GEMM launch,
the TMA descriptors, and the rest (Python checks, tile choice, allocation); and per ``torch.mm`` of the
per-segment loop (``mm_us``). Then a cProfile of the calls, by
cumulative time. Cases: one chunk of the one-GPU MoE layer (``moe_one_gpu.py``'s host rows: 4096 rows, 8 experts,
K = N = 1024) and a DeepSeek-like chunk (16384 rows, 128 experts, K 7168, N 4096).

CUDA_VISIBLE_DEVICES=0 PYTHONPATH=src python -m benchmarks.diagnostics.grouped_gemm_host [out.json]
"""

import cProfile
import io
import json
import pstats
import time

import torch

from benchmarks.diagnostics.results_file import require_cuda, results_meta, write_results
from flashoverlap.kernels import grouped_gemm as module

CASES = [("moe-one-gpu chunk", 4096, 8, 1024, 1024), ("deepseek-like chunk", 16384, 128, 7168, 4096)]
CALLS = 50


class Timed:
    """A stand-in for a module attribute that adds the host time of each call (or launch) to ``spent[name]``."""

    def __init__(self, real, name, spent, launch):
        self.real, self.name, self.spent, self.launch = real, name, spent, launch

    def __call__(self, *args, **kwargs):  # a kernels/launch.Launcher's call: (grid, args, meta)
        t0 = time.perf_counter()
        result = self.real(*args, **kwargs)
        self.spent[self.name] += time.perf_counter() - t0
        return result

    def from_tensor(self, *args, **kwargs):
        t0 = time.perf_counter()
        result = self.real.from_tensor(*args, **kwargs)
        self.spent[self.name] += time.perf_counter() - t0
        return result


def per_call_us(fn, calls=CALLS):
    """Host microseconds per call of ``calls`` back-to-back calls behind a GPU sleep long enough to cover them."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 100 ms
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * spent / calls


def one_case(name, rows, experts, k, n):
    """The case's row (host µs per call: torch._grouped_mm, grouped_gemm, and grouped_gemm's parts); prints it and
    a cProfile of the calls."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", generator=gen, dtype=torch.bfloat16).transpose(1, 2)
    ends = torch.linspace(rows / experts, rows, experts, device="cuda").round().to(torch.int32)
    seg_expert = torch.arange(experts, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    workspace = torch.empty(module.workspace_size(experts), dtype=torch.int32, device="cuda")

    def ours():
        module.grouped_gemm(x, w, module.Segments(ends, seg_expert), out=out, workspace=workspace,
                            launch=module.GroupedLaunch(order="heavy-first", max_rows=rows))

    def cublas():
        torch._grouped_mm(x, w, offs=ends)

    host_ends = ends.tolist()

    def loop():  # the per-segment loop as comm/chunked_gemm.multiply_chunk issues it
        start = 0
        for expert, end in enumerate(host_ends):
            torch.mm(x[start:end], w[expert], out=out[start:end])
            start = end

    ours()
    torch.testing.assert_close(out.float(), torch._grouped_mm(x, w, offs=ends).float(), atol=0.5, rtol=2e-2)
    row = {"case": name, "rows": rows, "experts": experts, "K": k, "N": n,
           "grouped_mm_us": per_call_us(cublas), "grouped_gemm_us": per_call_us(ours),
           "mm_us": per_call_us(loop) / experts}  # per torch.mm of the loop
    spent = {"table launch": 0.0, "gemm launch": 0.0, "descriptors": 0.0}
    saved = module._TABLE_LAUNCH, module._GEMM_LAUNCH, module.TensorDescriptor
    module._TABLE_LAUNCH = Timed(saved[0], "table launch", spent, True)
    module._GEMM_LAUNCH = Timed(saved[1], "gemm launch", spent, True)
    module.TensorDescriptor = Timed(saved[2], "descriptors", spent, False)
    try:
        total = per_call_us(ours)
    finally:
        module._TABLE_LAUNCH, module._GEMM_LAUNCH, module.TensorDescriptor = saved
    parts = {part: 1e6 * s / (CALLS + 1) for part, s in spent.items()}  # per_call_us makes one more call
    parts["rest"] = total - sum(parts.values())
    row["parts_us"] = {part: round(v, 1) for part, v in parts.items()}
    profile = cProfile.Profile()
    torch.cuda._sleep(200_000_000)
    profile.enable()
    for _ in range(20):
        ours()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
    print(f"== {name}: {json.dumps(row)}\n== cProfile of 20 calls, by cumulative time\n" + "\n".join(
        line for line in text.getvalue().splitlines() if line.strip()), flush=True)
    return row


def main():
    require_cuda("benchmarks.diagnostics.grouped_gemm_host", path_only=True)
    rows_out = [one_case(*case) for case in CASES]
    write_results({"meta": results_meta("CUDA_VISIBLE_DEVICES=0 PYTHONPATH=src python "
                                      "-m benchmarks.diagnostics.grouped_gemm_host OUT.json"), "rows": rows_out})


if __name__ == "__main__":
    main()
