"""The host cost of one fp8 expert layer call beside the bf16 one, on the CPU (issue 44's target: fp8 host time per
call <= 1.15x bf16's, exact and bounded): the CPU counterpart of ``benchmarks/diagnostics/fp8_moe_host.py`` (which
times it on one GPU), so that a change is measured before and after without a GPU. Not a timed test: a measurement,
written to a results file.

One layer call, as the GPU diagnostic issues it: ``moe_dispatch_gemm`` (bf16 ``x``; fp8: quantised by the op),
SwiGLU, ``moe_gemm_combine`` (fp8: the bf16 intermediate quantised by the op), through the public ops and the runtime,
on the NCCL expert path of a one-rank group (a gloo group; the CUDA streams run on the host,
``tests/comm/fake_cuda.py``), on a layout built once. The GEMMs are the ones the runtime picks on an H200 for the
real config's shapes (the tune rules asked with sm90 and the real widths and rows): the Triton kernels are stubbed
by launch counters (their launchers' Python runs; the kernels do not), and so are ``torch._grouped_mm`` and
``torch._scaled_grouped_mm`` (an empty result; the CPU's bf16 grouped GEMM would dominate the figure); the per-expert
loops' ``torch.mm`` run as they are. The tensors are small (H 384,
F 128, 32 tokens, the config's experts and top-k): the Python and the number of torch operators do not depend on
the widths.

Rows {config, mode, dtype ("bf16", "fp8-row", "fp8-block"), gemm (the GEMM kinds the calls ran), us_per_call (the
least time per call over windows, torch's CPU kernels on small tensors included), torch_ops (aten operators the call
issues from Python, the profiler's top-level ``aten::`` events: on a GPU each costs a dispatch and most a launch),
kernels (those of them that would launch a GPU kernel: not views, not ``empty``; torch's grouped GEMMs, stubbed,
counted here), triton_launches, ratio_to_bf16
(us), label, commit}. Run it against a checkout (``PYTHONPATH=<checkout>/src``) to measure that checkout:

    git worktree add --detach /tmp/fo-fp8-before <commit>
    PYTHONPATH=/tmp/fo-fp8-before/src python benchmarks/fp8_moe_host_python.py --label before \\
        --out benchmarks/results/cpu-fp8-moe-host-python.json
    PYTHONPATH=src python benchmarks/fp8_moe_host_python.py --label after \\
        --out benchmarks/results/cpu-fp8-moe-host-python.json
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path(importlib.util.find_spec("flashoverlap").origin).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.comm.fake_cuda: this checkout's (it fakes torch.cuda, not flashoverlap)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # cpu_runs, beside this script

import cpu_runs  # noqa: E402
from cpu_runs import checkout_commit, labelled, least_rows, per_call_us, write_run  # noqa: E402

from benchmarks.diagnostics.fp8_moe_host import layer_weights  # noqa: E402  (the GPU diagnostic's weights)

CONFIGS = [  # (name, local experts, H, F, top-k, tokens): the GPU diagnostic's
    ("qwen3-30b-a3b", 64, 2048, 768, 8, 2048),
    ("mixtral-8x7b", 4, 4096, 14336, 2, 2048),
]
HIDDEN, FFN, TOKENS = 384, 128, 32  # the small stand-ins (H, 2F and F distinct: the GEMM choice maps them back)


class Launches:
    """A stand-in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` counts a launch and does nothing (but the
    signalling GEMM's flags, set as the kernel leaves them); and for a kernel's direct launcher
    (``kernels/launch.Launcher``, called ``launch(grid, args, meta)``), the same."""

    count = 0
    library = 0  # torch's grouped GEMMs, stubbed alike

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            Launches.count += 1
            if kwargs.get("SIGNAL") and "MIX" in kwargs:  # the signalling GEMM: every flag set, as it leaves them
                args[6].fill_(1)

        return launch

    def __call__(self, grid, args, meta):
        self[grid](*args, **meta)


def _install(patch, real: dict[int, int], rows_scale: int) -> None:
    """The H200's choices for the real shapes, the Triton kernels stubbed, the NCCL path on CPU tensors."""
    from flashoverlap import guards
    from flashoverlap.kernels import grouped_gemm as kernels
    from flashoverlap.kernels.launch import Launcher
    from flashoverlap.runtime import experts
    from flashoverlap.tune import grouped, grouped_fp8

    patch.setattr(guards, "triton_interpreted", lambda: True)  # the paths take the Triton kernels (stubbed below)
    # Each kernel, and each direct launcher (which holds its kernel: stubbing the kernel alone leaves the launcher
    # launching the real one, which has no driver on the CPU).
    for module in (kernels, sys.modules.get("flashoverlap.kernels.quantise")):
        for name in dir(module) if module is not None else ():
            value = getattr(module, name)
            if isinstance(value, Launcher) or (name.endswith("_kernel") and hasattr(value, "run")):
                patch.setattr(module, name, Launches())
    patch.setattr(experts, "_expert_path", lambda *args, **kwargs: "nccl")
    # torch's grouped GEMMs have no fast CPU kernel: stubbed too (an empty result of the right shape), counted.

    def grouped_mm(a, b, *args, offs=None, out_dtype=None, **kwargs):
        Launches.library += 1
        return torch.empty((a.shape[0], b.shape[-1]), dtype=out_dtype or a.dtype)

    patch.setattr(torch, "_grouped_mm", grouped_mm)
    patch.setattr(torch, "_scaled_grouped_mm", grouped_mm)
    patch.setattr(experts, "_triton_available", lambda: True)

    def on_h200(fn):
        def choose(call, *args, **kwargs):
            call = grouped.GroupedCall(tuple(r * rows_scale for r in call.rows_per_expert), real[call.k],
                                       real[call.n], call.itemsize, call.chunks)
            kwargs["device_capability"] = (9, 0)
            return fn(call, *args, **kwargs)

        return choose

    patch.setattr(grouped, "expert_gemm", on_h200(grouped.expert_gemm))
    patch.setattr(grouped_fp8, "expert_gemm_fp8", on_h200(grouped_fp8.expert_gemm_fp8))
    experts._gemm_for_rows.cache_clear()


def _replay_on_the_host(device: torch.device, patch) -> None:
    """From here on the group's expert communicators find every bounded call's graph (``comm/replay.py``), and a
    replay costs nothing: what is timed is what a replayed call's host does before its graph launch (the op's
    set-up, the runtime, the outputs, the signature and its lookup), whatever addresses the CPU's allocator gives.
    Undone by ``patch`` (the case's own monkeypatch): the communicators outlive the case."""
    import types

    from flashoverlap.runtime.context import existing_context

    def replay(signature):
        hash(signature)  # the lookup's own work
        return True

    def run(signature, issue):
        return replay(signature)

    for comm in existing_context(dist.group.WORLD, device).communicators.values():
        if hasattr(comm, "_graphed"):
            patch.setattr(comm, "_graphed", True)
            # ``replay``: the replay lane's lookup (a checkout with one builds its lane on the next call)
            patch.setattr(comm, "graphs", types.SimpleNamespace(run=run, replay=replay, clear=lambda: None))


def rows_for(config, mode: str, windows: int, calls: int, verbose: bool, replayed: bool = False) -> list[dict]:
    import pytest

    import flashoverlap as fo
    from flashoverlap.ops.moe import moe_dispatch_gemm, moe_gemm_combine
    from flashoverlap.runtime import experts

    name, local, hidden, ffn, top_k, tokens = config
    real = {HIDDEN: hidden, 2 * FFN: 2 * ffn, FFN: ffn}
    out = []
    with pytest.MonkeyPatch.context() as patch:
        _install(patch, real, tokens // TOKENS)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
        idx = torch.stack([torch.randperm(local, generator=gen)[:top_k] for _ in range(TOKENS)])
        weights = torch.softmax(torch.randn(TOKENS, top_k, generator=gen), -1)
        w13 = torch.randn(local, 2 * FFN, HIDDEN, generator=gen).div_(HIDDEN ** 0.5).bfloat16()
        w2 = torch.randn(local, HIDDEN, FFN, generator=gen).div_(FFN ** 0.5).bfloat16()
        bound = TOKENS * top_k if mode == "bounded" else None
        layout = fo.moe_layout(idx, local, mode=mode, bound=bound)
        base = None
        for dtype in ("bf16", "fp8-row", "fp8-block"):
            w_up, w_down, s_up, s_down = layer_weights(dtype, w13, w2)
            kinds = []
            original_call = experts.ExpertKind.call

            def recording(self, spec, entry, env, kinds=kinds, original_call=original_call):
                call = original_call(self, spec, entry, env)
                kinds.append(call.plan.gemm)
                return call

            finite = {}  # SwiGLU's input: h's shape and dtype, fixed finite values (see below)

            def layer(w_up=w_up, w_down=w_down, s_up=s_up, s_down=s_down, finite=finite):
                h = moe_dispatch_gemm(x, w_up, layout, path="nccl", scale_w=s_up)
                # h holds what the stubbed GEMMs and a replayed call's unwritten outputs leave: the CPU's SwiGLU on
                # such bytes took 11-85 us per call depending on them (denormals, infinities), more than the library's
                # whole difference between the dtypes. It runs on fixed finite values of h's shape instead: the same
                # operators, a steady time.
                v = finite.get(h.shape)
                if v is None:
                    v = finite[h.shape] = torch.randn(h.shape, generator=torch.Generator().manual_seed(1)).to(h.dtype)
                    finite[h.shape, "a"] = torch.empty((h.shape[0], FFN), dtype=h.dtype)
                # into one buffer: a GPU's caching allocator hands a layer's activation the same address call after
                # call (what lets the combine replay), the CPU's need not
                a = torch.mul(F.silu(v[:, :FFN]), v[:, FFN:], out=finite[h.shape, "a"])
                return moe_gemm_combine(a, w_down, weights, layout, path="nccl", scale_w=s_down)

            with torch.no_grad():
                patch.setattr(experts.ExpertKind, "call", recording)
                layer()
                patch.setattr(experts.ExpertKind, "call", original_call)
                if replayed:
                    _replay_on_the_host(x.device, patch)
                Launches.count = Launches.library = 0
                layer()
                launches, library = Launches.count, Launches.library
                ops, kernels, names = cpu_runs.operator_counts(layer)
                us = per_call_us(layer, windows=windows, calls=calls)
            if verbose:
                print(name, mode, dtype, names, file=sys.stderr)
            if dtype == "bf16":
                base = us
            out.append({"config": name, "mode": mode, "calls": "replayed" if replayed else "eager", "dtype": dtype,
                        "gemm": "/".join(map(str, kinds)),
                        "us_per_call": round(us, 1), "torch_ops": ops, "kernels": kernels + library,
                        "triton_launches": launches, "ratio_to_bf16": round(us / base, 3)})
    return out


def main() -> int:
    parser = cpu_runs.labelled_parser(__doc__, "fp8_moe_host_python.py")
    parser.add_argument("--replayed", action="store_true",
                        help="also bounded calls replayed (rows calls='replayed'): the host's work before the graph "
                             "launch, every call taken as found in the graphs, the replay itself costing nothing")
    args = parser.parse_args()
    with cpu_runs.one_rank_on_the_host(ROOT):
        measure(args)
    return 0


def measure(args) -> None:
    cases = [(mode, False) for mode in ("exact", "bounded")] + ([("bounded", True)] if args.replayed else [])
    measured = [row for _ in range(args.repeat) for config in CONFIGS for mode, replayed in cases
                for row in rows_for(config, mode, args.windows, args.calls, args.verbose, replayed)]
    least = least_rows(measured, ("config", "mode", "calls", "dtype"))  # the least of each figure over the repeats
    rows = list(least.values())
    for row in rows:  # the ratio of the least figures
        bf16 = least[(row["config"], row["mode"], row["calls"], "bf16")]["us_per_call"]
        row["ratio_to_bf16"] = round(row["us_per_call"] / bf16, 3)
    commit = checkout_commit(SOURCE)
    labelled(rows, args.label, commit)
    if args.out:
        write_run(args.out, args.label, "label", rows, commit, ROOT, SOURCE, "fp8_moe_host_python.py",
                  {"world_size": 1, "path": "nccl", "small_shapes": {"hidden": HIDDEN, "ffn": FFN, "tokens": TOKENS},
                   "unit": "us_per_call: least over --windows windows of --calls layer calls, times --repeat; "
                           "torch's CPU kernels on small tensors included, the Triton kernels stubbed (launch "
                           "counted), the CUDA streams the host's (tests/comm/fake_cuda.py)"})


if __name__ == "__main__":
    sys.exit(main())
