"""The Python cost of one P2P expert call (``comm/expert/p2p.py``) on the CPU, with the CUDA layer faked: what the
library's own code costs per call, apart from what torch's kernels and the driver cost. Not a timed test: a
measurement, written to a results file.

Rows, per mode (``exact``, ``bounded``; eager, no replay), at W = 2, rank 0, the cuBLAS grouped GEMM chosen:
- ``dispatch``: the communicator's ``run`` of one dispatch (send buffer gathered, the own chunk's GEMM, the peer's
  pushes, flag waits, copies and the peer chunk's GEMM), the driver, streams and events replaced by the
  checkout's own recorders (``tests/comm/test_expert_p2p_executor.py``) and the grouped GEMM by a no-op.
- ``combine``: the same for one combine (its weighted sum at the origin included).
- ``layer``: the layer as ``ExpertParallelMLP`` runs it below the public op, per call: the layout's router weights
  in send order (``Layout.with_weights``), a dispatch, the SwiGLU activation, a combine (the layout built once,
  not timed); ``layer, a new layout each call``: the same with a layout the communicator has never seen, as a
  model's layers give it one per call (what is kept per layout serves the layer's combine, not the next layer).
The tensors are small (the rows' sizes do not change the Python); torch's own CPU kernels are in the figure, the
same before and after. ``torch_ops``: the torch operators one call issues (each costs its own host time on a GPU,
most of them a kernel launch; the CPU figure understates that), the layer rows' two clones and the activation
included.

It runs against whichever flashoverlap is importable, with that checkout's own recording fakes, so the same
script measures the commit a change starts from. Each figure is the least time per call over several windows
(other work on a shared machine only adds time):

    git worktree add --detach /tmp/fo-moe-before <commit>
    PYTHONPATH=/tmp/fo-moe-before/src python benchmarks/moe_host_python.py --label before \\
        --out benchmarks/results/cpu-moe-host-python.json
    PYTHONPATH=src python benchmarks/moe_host_python.py --label after --out benchmarks/results/cpu-moe-host-python.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
# The checkout whose flashoverlap is importable: its own recording driver and streams fit its communicator.
SOURCE = Path(importlib.util.find_spec("flashoverlap").origin).resolve().parents[2]
sys.path.insert(0, str(SOURCE))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # cpu_runs, beside this script

from cpu_runs import (  # noqa: E402
    at_least_one,
    checkout_commit,
    labelled,
    least_rows,
    operator_counts,
    per_call_us,
    results_out,
    write_run,
)

from flashoverlap.comm.expert import (  # noqa: E402
    ExpertCall,
    ExpertPlan,
    chunked_gemm,  # noqa: E402
)
from tests.comm import test_expert_p2p_executor as fakes  # noqa: E402

WORLD, RANK = 2, 0
SEND, RECV = (24, 20), (24, 16)  # rows this rank sends each rank, and receives from each (exact mode)
BOUND = 32


def rows_for(mode: str, patch) -> list[dict]:
    recorder = fakes.Recorder()
    comm = fakes._communicator(RANK, WORLD, recorder, patch)
    patch.setattr(chunked_gemm, "multiply_chunk", lambda *args, **kwargs: None)  # the grouped GEMM: a no-op
    patch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)  # a first call's kernel loading
    bounded = mode == "bounded"
    half = (BOUND // 2,) * WORLD  # bounded: half of each slot used
    layout = fakes._layout(WORLD, RANK, mode, half if bounded else SEND, half if bounded else RECV,
                           BOUND if bounded else None)
    tokens, top_k, local = layout.tokens, fakes.TOP_K, fakes.LOCAL
    hidden, ffn = fakes.HIDDEN, fakes.FFN
    bound = BOUND if bounded else None
    plan_d = ExpertPlan("dispatch", WORLD, local * WORLD, hidden, 2 * ffn, top_k, tokens, mode, bound, "cublas")
    plan_c = ExpertPlan("combine", WORLD, local * WORLD, hidden, ffn, top_k, tokens, mode, bound, "cublas")
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    w_up = torch.randn(local, 2 * ffn, hidden, dtype=torch.bfloat16).transpose(1, 2)
    w_down = torch.randn(local, hidden, ffn, dtype=torch.bfloat16).transpose(1, 2)
    act = torch.randn(layout.recv_rows, ffn, dtype=torch.bfloat16)
    weights = torch.rand(tokens, top_k)
    weighted = layout.with_weights(weights)

    def dispatch():
        recorder.trace.clear()
        comm.run(ExpertCall("moe_dispatch_gemm", plan_d, x, w_up, layout=layout))

    def combine():
        recorder.trace.clear()
        comm.run(ExpertCall("moe_gemm_combine", plan_c, act, w_down, layout=weighted))

    def layer():
        recorder.trace.clear()
        h, _ = comm.run(ExpertCall("moe_dispatch_gemm", plan_d, x, w_up, layout=layout))
        a = F.silu(h[:, :ffn]) * h[:, ffn:]
        comm.run(ExpertCall("moe_gemm_combine", plan_c, a, w_down, layout=layout.with_weights(weights)))

    def layer_new_layout():
        """As ``layer``, each call with a layout it has never seen (new tensors, same values): what a model's
        layers give the communicator (a layout per layer call), so that nothing kept per layout is reused across
        calls; the two clones are in the figure, before and after alike."""
        recorder.trace.clear()
        fresh = dataclasses.replace(layout, send_order=layout.send_order.clone(),
                                    recv_seg_ends=layout.recv_seg_ends.clone())
        h, _ = comm.run(ExpertCall("moe_dispatch_gemm", plan_d, x, w_up, layout=fresh))
        a = F.silu(h[:, :ffn]) * h[:, ffn:]
        comm.run(ExpertCall("moe_gemm_combine", plan_c, a, w_down, layout=fresh.with_weights(weights)))

    out = []
    for op, fn in (("dispatch", dispatch), ("combine", combine), ("layer", layer),
                   ("layer, a new layout each call", layer_new_layout)):
        recorder.trace.clear()
        fn()
        steps = len(recorder.trace)
        us = per_call_us(fn, windows=60, calls=100)
        out.append({"op": op, "path": "p2p", "mode": mode, "us_per_call": round(us, 2),
                    "driver_and_stream_calls": steps, "torch_ops": operator_counts(fn)[0]})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="the rows' label, e.g. before / after")
    parser.add_argument("--out", default=None, type=results_out("moe_host_python.py"),
                        help="results JSON to add (or replace) this label's rows in")
    parser.add_argument("--repeat", type=at_least_one, default=3,
                        help="measure every row this many times, keep the least")
    args = parser.parse_args()
    import pytest

    torch.set_num_threads(1)
    rows = []
    for _ in range(args.repeat):  # the least of each figure over the repeats (a shared machine only adds time)
        for mode in ("exact", "bounded"):
            with pytest.MonkeyPatch.context() as patch:
                rows += rows_for(mode, patch)
    commit = checkout_commit(SOURCE)
    rows = labelled(list(least_rows(rows, ("op", "mode")).values()), args.label, commit)
    if args.out:
        write_run(args.out, args.label, "label", rows, commit, ROOT, SOURCE, "moe_host_python.py",
                  {"world_size": WORLD, "rank": RANK, "exact_splits": {"send": list(SEND), "recv": list(RECV)},
                   "bound": BOUND,
                   "unit": "us_per_call: least over 60 windows of 100 calls, times --repeat; torch's CPU kernels on "
                           "small tensors included, the grouped GEMM a no-op, the driver and streams recorders"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
