"""The signalling GEMM in loop forms the ops never run, for the benchmark's GEMM sweep: the tile loop flattened
with the K loop (three times slower with signalling, DESIGN.md), and Triton's warp specialization of the K loop.
A wrapper around the library's launcher (``kernels/gemm.launch_arguments``): the hot path carries no such switch."""

from __future__ import annotations

import torch

from flashoverlap.kernels.gemm import launch_arguments, signalling_gemm_kernel
from flashoverlap.plan import Plan

FORMS = frozenset({"tma_store", "flatten", "warp_specialize"})


def gemm_form(a: torch.Tensor, b: torch.Tensor, plan: Plan, counters: torch.Tensor, form: dict) -> torch.Tensor:
    """``kernels.gemm.gemm(a, b, plan, counters=counters)`` in the loop form ``form`` (keys of ``FORMS``)."""
    unknown = set(form) - FORMS
    if unknown:
        raise ValueError(f"gemm_form: unknown switches {sorted(unknown)}; known: {sorted(FORMS)}")
    out, args, meta = launch_arguments(a, b, plan, counters=counters, tma_store=bool(form.get("tma_store")))
    meta.update(FLATTEN=bool(form.get("flatten")),
                WARP_SPECIALIZE=bool(form.get("warp_specialize")) and meta["USE_TMA"])
    signalling_gemm_kernel[(plan.grid_size,)](*args, **meta)
    return out
