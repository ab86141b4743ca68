"""Expert parallelism (MoE): ``moe_layout`` (a layer's routing), ``moe_dispatch_gemm`` (the tokens' all-to-all to
the ranks of their experts, then each expert's first projection) and ``moe_gemm_combine`` (each expert's last
projection, the reverse all-to-all, and the router-weighted sum at the tokens' origin).

One layer, on each rank of a group of ``W`` (``E`` experts, ``L = E / W`` on each rank, ``T`` tokens here, top-k)::

    routing = moe_layout(topk_idx, E, group)                      # topk_idx [T, k]
    h = moe_dispatch_gemm(x, w_up, routing, group)                # x [T, H], w_up [L, H, 2F] -> h [R, 2F]
    a = F.silu(h[:, :F]) * h[:, F:]                               # any row-wise activation, here SwiGLU
    y = moe_gemm_combine(a, w_down, topk_weights, routing, group) # w_down [L, F, H] -> y [T, H]

which equals the plain (unsharded) MoE: ``y[t] = sum_c topk_weights[t, c] * expert_{topk_idx[t, c]}(x[t])``. The
rows ``h`` are this rank's received (token, choice) rows grouped by (source rank, local expert): ``R`` is
data-dependent in exact mode, ``W * bound`` in bounded mode (padding rows are zero). ``comm/expert/contract.py`` has the
whole shape algebra.

Modes: ``"exact"`` (the counts exchanged once per layer, one host synchronisation) and ``"bounded"`` (at most
``bound`` rows from one rank to another, default the worst case ``T * k``; no synchronisation: capturable in a CUDA
graph, traceable with ``torch.compile(fullgraph=True)``). Dropless in both: a routing beyond the bound raises,
naming the bound, on every rank, before any token moves.

``torch.compile``: bounded mode traces whole (every shape follows from the bound). Exact mode's ``moe_layout``
is a graph break (run under ``torch.compiler.disable``): its split sizes are host integers read from the device, which a
graph cannot hold without data-dependent shapes; the graph after it takes them as inputs (Dynamo may recompile
when they change, then treats them as dynamic). Under ``fullgraph=True`` use bounded mode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm.expert import Layout, check_out
from flashoverlap.ops import moe_library
from flashoverlap.ops.library import group_name, needed
from flashoverlap.runtime import experts
from flashoverlap.runtime.calls import execute


def moe_layout(
    topk_idx: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    *,
    mode: str = "exact",
    bound: int | None = None,
) -> Layout:
    """One layer's routing on this rank, shared by its ``moe_dispatch_gemm`` and ``moe_gemm_combine`` (and their
    backward passes). Collective: every rank of ``group`` calls it.

    Args:
        topk_idx: ``[T, k]`` integer (int64 or int32), the experts each token chose (global indices in
            ``[0, num_experts)``; distinct per token, as ``torch.topk`` gives them).
        num_experts: ``E``, a multiple of the group's size; rank r holds experts ``[r * E/W, (r+1) * E/W)``.
        group: the process group (default: the world). CUDA tensors need an NCCL group.
        mode: ``"exact"`` or ``"bounded"``.
        bound: bounded mode: the most rows one rank sends to another, the same on every rank (default ``T * k``,
            the worst case, assuming every rank has ``T`` tokens).

    Returns:
        A ``Layout`` (``comm/expert/``).
    """
    if torch.compiler.is_compiling():
        if mode == "bounded":
            return moe_library.bounded_layout(topk_idx, num_experts, group_name(group), bound)
        # A graph break: the split sizes are host integers. (Wrapped here, not at import: torch.compiler.disable
        # imports Dynamo, seconds of every process's start-up.)
        return torch.compiler.disable(_exact_layout)(topk_idx, num_experts, group, bound)
    return experts.layout("moe_layout", topk_idx, num_experts, group, mode, bound)


def _exact_layout(topk_idx: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None,
                  bound: int | None) -> Layout:
    return experts.layout("moe_layout", topk_idx, num_experts, group, "exact", bound)


def _check_layout(name: str, layout: object) -> None:
    if not isinstance(layout, Layout):
        raise TypeError(f"{name}: layout must be the Layout moe_layout returns, got {type(layout).__name__}")


def moe_dispatch_gemm(
    x: torch.Tensor,
    w_up: torch.Tensor,
    layout: Layout,
    group: dist.ProcessGroup | None = None,
    *,
    path: str = "auto",
) -> torch.Tensor:
    """Send each token's row to the ranks of its k experts and multiply the rows received by their expert's
    weight: ``h[seg (s, l)] = rows from rank s for local expert l @ w_up[l]``.

    Args:
        x: ``[T, H]`` bf16, fp16 or fp32: this rank's tokens (the ``T`` of ``layout``).
        w_up: ``[L, H, N]`` in x's dtype and device: this rank's ``L = E / W`` experts' first projection (SwiGLU:
            ``N = 2F``, gate columns then up columns); any strides (``w.transpose(1, 2)`` of an ``[L, N, H]``
            weight is read in place).
        layout: this layer's ``moe_layout``.
        group: the group the layout was built on.
        path: ``"auto"`` (P2P on one NVLink node, else NCCL, on CUDA; the reference elsewhere), ``"nccl"``,
            ``"p2p"`` or ``"reference"`` (plain PyTorch, any backend).

    Returns:
        ``h: [R, N]`` in x's dtype: the received rows' products, grouped by (source rank, local expert); rows of
        no segment (bounded mode's padding) are zero.
    """
    _check_layout("moe_dispatch_gemm", layout)
    if needed("moe_dispatch_gemm", (x, w_up)):
        h, _ = torch.ops.flashoverlap.moe_dispatch(x, w_up, layout.tensors(), group_name(group),
                                                   moe_library.layout_values(layout), False, path)
        return h
    return execute(experts.EXPERT, experts.ExpertSpec("moe_dispatch_gemm", "dispatch", x, w_up, layout, group, path))[0]


def moe_gemm_combine(
    a: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    layout: Layout,
    group: dist.ProcessGroup | None = None,
    *,
    path: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multiply each received row by its expert's last projection, send it back to its token's rank, and sum
    each token's k rows there with its router weights: ``y[t] = sum_c topk_weights[t, c] * (a_{t,c} @
    w_down[e_{t,c}])``.

    Args:
        a: ``[R, F]`` in the layout's receive rows (``moe_dispatch_gemm``'s output, activated), bf16/fp16/fp32.
        w_down: ``[L, F, H]`` in a's dtype and device; any strides (``w.transpose(1, 2)`` of ``[L, H, F]``).
        topk_weights: ``[T, k]`` floating (any float dtype; summed in fp32): each token's router weights, in
            ``topk_idx``'s order.
        layout, group, path: as for ``moe_dispatch_gemm``.
        out: a preallocated ``[T, H]`` result in a's dtype and device (checked before anything is sent), written
            and returned; not where autograd records the call (as for PyTorch's ``out=``).

    Returns:
        ``y: [T, H]`` in a's dtype, in this rank's token order (``out`` where given).
    """
    _check_layout("moe_gemm_combine", layout)
    if needed("moe_gemm_combine", (a, w_down, topk_weights)):
        if out is not None:
            if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (a, w_down, topk_weights)):
                raise ValueError("moe_gemm_combine: out= does not take part in autograd and a, w_down or "
                                 "topk_weights requires grad: drop out=, or call under torch.no_grad()")
            if isinstance(a, torch.Tensor) and isinstance(w_down, torch.Tensor) and w_down.ndim == 3:
                check_out("moe_gemm_combine", out, (layout.tokens, w_down.shape[2]), a.dtype, a.device)
        y, _ = torch.ops.flashoverlap.moe_combine(a, w_down, topk_weights, layout.tensors(), group_name(group),
                                                  moe_library.layout_values(layout), path)
        return y if out is None else out.copy_(y)  # traced (torch.compile): the copy is part of the graph
    spec = experts.ExpertSpec("moe_gemm_combine", "combine", a, w_down, layout, group, path, topk_weights, out=out)
    return execute(experts.EXPERT, spec)[0]
