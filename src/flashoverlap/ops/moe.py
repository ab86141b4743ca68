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

fp8 (``comm/expert/scaled.py``): fp8 (``float8_e4m3fn``; e5m2 raises) expert weights with their scales
(``scale_w``: row-wise ``[L, N]``, or block-wise ``[L, K/128, ceil(N/128)]``, one per 128x128 block of ``w[l]`` as
given ``[K, N]``: DeepSeek-V3's checkpoint scales ``[L, N/128, K/128]`` of its ``[L, N, K]`` weights passed as
``s.transpose(1, 2)``) make the call fp8, and ``scale_w``'s shape sets the mode. ``moe_dispatch_gemm`` takes fp8
``x`` with ``scale_x`` in that mode (``[T, 1]`` row-wise, ``[T, H/128]`` block-wise, DeepEP's and DeepSeek-V3's
token layout) or a bf16/fp16/fp32 ``x``, which it quantises itself in the weights' mode; the rows cross the wire as
fp8 packed with their scales (at H = 7168 block-wise 0.516x the bf16 bytes); ``h`` is ``out_dtype``, bf16 by default
or fp32 (not on the P2P path). ``moe_gemm_combine`` takes the fp8 ``a`` with ``scale_a`` or a bf16/fp16/fp32 ``a``
(quantised here) and returns ``out_dtype`` likewise (bf16 by default). Mixed dtypes and scales of the wrong shape
raise, naming the argument, before anything is sent. The fp8 calls record no
autograd themselves (``flashoverlap.nn``'s fp8 experts define the backward)::

    h = moe_dispatch_gemm(x_fp8, w_up_fp8, routing, scale_x=sx, scale_w=sw_up)        # h [R, 2F] bf16
    y = moe_gemm_combine(a, w_down_fp8, topk_weights, routing, scale_w=sw_down)       # a bf16: quantised here

``torch.compile``: bounded mode traces whole (every shape follows from the bound). Exact mode's ``moe_layout``
is a graph break (run under ``torch.compiler.disable``): its split sizes are host integers read from the device, which a
graph cannot hold without data-dependent shapes; the graph after it takes them as inputs (Dynamo may recompile
when they change, then treats them as dynamic). Under ``fullgraph=True`` use bounded mode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm.expert import Layout, check_out
from flashoverlap.comm.expert.scaled import FP8, ExpertScales, mode_of_weight_scales, quantise
from flashoverlap.ops import moe_library
from flashoverlap.ops.library import group_name, needed, refuse_grad
from flashoverlap.runtime import experts
from flashoverlap.runtime.calls import execute
from flashoverlap.runtime.checks import DTYPES


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
        topk_idx: ``[T, k]`` int64, int32, int16, int8 or uint8 (``torch.topk`` gives int64), the experts each
            token chose (global indices in ``[0, num_experts)``; a token that names one expert twice sends it two
            rows, each weighted).
        num_experts: ``E``, a multiple of the group's size; rank r holds experts ``[r * E/W, (r+1) * E/W)``.
        group: the process group (default: the world). CUDA tensors: an NCCL group, or for the P2P path any group
            (ranks sharing one GPU over gloo: ``flashoverlap.testing.spawn_on_one_gpu``).
        mode: ``"exact"`` or ``"bounded"``.
        bound: bounded mode: the most rows one rank sends to another, the same on every rank (default ``T * k``,
            the worst case, assuming every rank has ``T`` tokens).

    Returns:
        A ``Layout`` (``comm/expert/``).
    """
    if torch.compiler.is_compiling():
        if mode == "bounded":
            return moe_library.bounded_layout(topk_idx, num_experts, group_name(group, "moe_layout"), bound)
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
    scale_x: torch.Tensor | None = None,
    scale_w: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Send each token's row to the ranks of its k experts and multiply the rows received by their expert's
    weight: ``h[seg (s, l)] = rows from rank s for local expert l @ w_up[l]``.

    Args:
        x: ``[T, H]`` bf16, fp16 or fp32 (or ``float8_e4m3fn`` with ``scale_x``): this rank's tokens (the ``T`` of
            ``layout``).
        w_up: ``[L, H, N]`` on x's device, in x's dtype (fp8 call: ``float8_e4m3fn`` with ``scale_w``, whatever
            x's dtype): this rank's ``L = E / W`` experts' first projection (SwiGLU: ``N = 2F``, gate columns then
            up columns); any strides (``w.transpose(1, 2)`` of an ``[L, N, H]`` weight is read in place).
        layout: this layer's ``moe_layout``.
        group: the group the layout was built on.
        path: ``"auto"`` (P2P on one NVLink node, else NCCL, on CUDA; the reference elsewhere), ``"nccl"``,
            ``"p2p"`` or ``"reference"`` (plain PyTorch, any backend).
        scale_x: fp8 ``x``'s fp32 scales in ``scale_w``'s mode, ``[T, 1]`` (row-wise) or ``[T, H/128]``
            (block-wise); None for a bf16/fp16/fp32 ``x`` (quantised here where the weights are fp8).
        scale_w: fp8 ``w_up``'s fp32 scales: ``[L, N]`` (row-wise) or ``[L, H/128, ceil(N/128)]`` (block-wise:
            DeepSeek-V3's ``[L, N/128, H/128]`` transposed); its shape sets the call's mode.
        out_dtype: fp8 calls' output dtype, ``torch.bfloat16`` (default) or ``torch.float32`` (not on the P2P path);
            a bf16/fp16/fp32 call returns x's dtype (another ``out_dtype`` raises).

    Returns:
        ``h: [R, N]`` in x's dtype; in an fp8 call (fp8 weights) ``out_dtype``, whatever x's dtype: the received
        rows' products, grouped by (source rank, local
        expert); rows of no segment (bounded mode's padding) are zero.
    """
    _check_layout("moe_dispatch_gemm", layout)
    fp8 = _fp8_operands("moe_dispatch_gemm", x, w_up, scale_x, scale_w, ("x", "w_up", "scale_x"), ())
    if fp8 is not None:
        x, scale_x, mode = fp8
        scales = ExpertScales(mode, scale_w, scale_x, out_dtype, x.dtype if scale_x is not None else E4M3)
        if needed("moe_dispatch_gemm", (x, w_up)):
            if scale_x is None:  # the custom op takes fp8 rows: bf16 ones quantised now
                x, scale_x = quantise(x.detach(), mode)
            return torch.ops.flashoverlap.moe_dispatch_scaled(x, scale_x, w_up, scale_w, layout.tensors(),
                                                              group_name(group, "moe_dispatch_gemm"),
                                                              moe_library.layout_values(layout),
                                                              False, path, out_dtype)[0]
        return execute(experts.EXPERT, experts.ExpertSpec("moe_dispatch_gemm", "dispatch", x, w_up, layout, group,
                                                          path, scales=scales))[0]
    _check_plain_out_dtype("moe_dispatch_gemm", "x", x, out_dtype)
    if needed("moe_dispatch_gemm", (x, w_up)):
        h, _ = torch.ops.flashoverlap.moe_dispatch(x, w_up, layout.tensors(), group_name(group, "moe_dispatch_gemm"),
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
    scale_a: torch.Tensor | None = None,
    scale_w: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Multiply each received row by its expert's last projection, send it back to its token's rank, and sum
    each token's k rows there with its router weights: ``y[t] = sum_c topk_weights[t, c] * (a_{t,c} @
    w_down[e_{t,c}])``.

    Args:
        a: ``[R, F]`` in the layout's receive rows (``moe_dispatch_gemm``'s output, activated), bf16/fp16/fp32 (or
            ``float8_e4m3fn`` with ``scale_a``).
        w_down: ``[L, F, H]`` on a's device, in a's dtype (fp8 call: ``float8_e4m3fn`` with ``scale_w``); any
            strides (``w.transpose(1, 2)`` of ``[L, H, F]``).
        topk_weights: ``[T, k]`` floating (any float dtype; summed in fp32): each token's router weights, in
            ``topk_idx``'s order.
        layout, group, path: as for ``moe_dispatch_gemm``.
        out: a preallocated ``[T, H]`` result in a's dtype (fp8: ``out_dtype``) and device (checked before anything
            is sent), written and returned; not where autograd records the call (as for PyTorch's ``out=``).
        scale_a: fp8 ``a``'s fp32 scales, ``[R, 1]`` or ``[R, F/128]``; None for a bf16/fp16/fp32 ``a`` (quantised
            here where the weights are fp8).
        scale_w: fp8 ``w_down``'s fp32 scales: ``[L, H]`` (row-wise) or ``[L, F/128, ceil(H/128)]`` (block-wise).
        out_dtype: fp8 calls' output dtype, ``torch.bfloat16`` (default) or ``torch.float32`` (not on the P2P path);
            a bf16/fp16/fp32 call returns a's dtype (another ``out_dtype`` raises).

    Returns:
        ``y: [T, H]`` in a's dtype (fp8: ``out_dtype``), in this rank's token order (``out`` where given).
    """
    _check_layout("moe_gemm_combine", layout)
    fp8 = _fp8_operands("moe_gemm_combine", a, w_down, scale_a, scale_w, ("a", "w_down", "scale_a"),
                        (("topk_weights", topk_weights),))
    if fp8 is not None:
        a, scale_a, mode = fp8
        scales = ExpertScales(mode, scale_w, scale_a, out_dtype, a.dtype if scale_a is not None else E4M3)
        if needed("moe_gemm_combine", (a, w_down, topk_weights)):
            if out is not None:
                raise ValueError("moe_gemm_combine: out= does not take part in autograd or torch.compile's fp8 "
                                 "custom op; drop out=")
            if scale_a is None:  # the custom op takes fp8 rows: bf16 ones quantised now
                a, scale_a = quantise(a.detach(), mode)
            return torch.ops.flashoverlap.moe_combine_scaled(a, scale_a, w_down, scale_w, topk_weights,
                                                             layout.tensors(), group_name(group, "moe_gemm_combine"),
                                                             moe_library.layout_values(layout), path, out_dtype)[0]
        spec = experts.ExpertSpec("moe_gemm_combine", "combine", a, w_down, layout, group, path, topk_weights,
                                  out=out, scales=scales)
        return execute(experts.EXPERT, spec)[0]
    _check_plain_out_dtype("moe_gemm_combine", "a", a, out_dtype)
    if needed("moe_gemm_combine", (a, w_down, topk_weights)):
        if out is not None:
            if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (a, w_down, topk_weights)):
                raise ValueError("moe_gemm_combine: out= does not take part in autograd and a, w_down or "
                                 "topk_weights requires grad: drop out=, or call under torch.no_grad()")
            if isinstance(a, torch.Tensor) and isinstance(w_down, torch.Tensor) and w_down.ndim == 3:
                check_out("moe_gemm_combine", out, (layout.tokens, w_down.shape[2]), a.dtype, a.device)
        y, _ = torch.ops.flashoverlap.moe_combine(a, w_down, topk_weights, layout.tensors(),
                                                  group_name(group, "moe_gemm_combine"),
                                                  moe_library.layout_values(layout), path)
        return y if out is None else out.copy_(y)  # traced (torch.compile): the copy is part of the graph
    spec = experts.ExpertSpec("moe_gemm_combine", "combine", a, w_down, layout, group, path, topk_weights, out=out)
    return execute(experts.EXPERT, spec)[0]


E4M3 = torch.float8_e4m3fn  # the dtype bf16/fp16/fp32 rows are quantised to


def _check_plain_out_dtype(name: str, rows_name: str, rows: object, out_dtype: object) -> None:
    """A bf16/fp16/fp32 call returns its rows' dtype: an ``out_dtype`` other than the default (bf16) or that dtype
    raises, naming it, where it would otherwise be ignored (``out_dtype=torch.float32`` on bf16 operands returned
    bf16)."""
    if isinstance(rows, torch.Tensor) and out_dtype is not torch.bfloat16 and out_dtype != rows.dtype:
        raise ValueError(f"{name}: out_dtype={out_dtype} applies to fp8 calls (fp8 weights with scale_w); this call's "
                         f"{rows_name} is {rows.dtype} and its result is too: drop out_dtype, or cast the operands")


def _fp8_operands(name: str, rows: object, w: object, scale_rows: object, scale_w: object,
                  names: tuple[str, str, str],
                  others: tuple = ()) -> tuple[torch.Tensor, torch.Tensor | None, str] | None:
    """None for a bf16/fp16/fp32 call (no fp8 operand, no scales); otherwise the rows, their scales and the mode
    (``"row"``/``"block"``, from ``scale_w``'s shape). fp8 rows come with their scales; bf16/fp16/fp32 rows come back
    as they are with scales None: the call quantises them as its first issued step, into a wire buffer of its own
    (``comm/expert/scaled.wired``: a replayed call's graph holds both), or the caller now where the call goes through
    its custom op; traced by ``torch.compile``, quantised here. Mixed dtypes, missing or misshapen scales, and an
    operand that requires grad (``others``: the call's other tensors, by name; the fp8 ops record no autograd, so
    its gradient would silently never come) raise here, naming the argument, before anything is sent (the runtime
    checks the scales' full shapes against the operands)."""
    rows_name, w_name, scale_name = names
    fp8_rows = isinstance(rows, torch.Tensor) and rows.dtype in FP8
    fp8_w = isinstance(w, torch.Tensor) and w.dtype in FP8
    if not (fp8_rows or fp8_w or scale_rows is not None or scale_w is not None):
        return None
    if not fp8_w:
        what = getattr(w, "dtype", type(w).__name__)
        raise ValueError(f"{name}: {w_name} is {what} but the call is fp8 ({rows_name} fp8 or scales given): pass "
                         f"fp8 {w_name} with scale_w, or bf16 operands without scales (mixed dtypes)")
    if scale_w is None:
        raise ValueError(f"{name}: fp8 {w_name} needs scale_w (float32 [L, N] row-wise, or [L, K/128, ceil(N/128)] "
                         "block-wise)")
    mode = mode_of_weight_scales(scale_w)
    if mode is None:
        raise ValueError(f"{name}: scale_w must be a float32 tensor [L, N] (row-wise) or [L, K/128, ceil(N/128)] "
                         f"(block-wise), got {getattr(scale_w, 'dtype', type(scale_w).__name__)} of shape "
                         f"{list(getattr(scale_w, 'shape', []))}")
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{name}: {rows_name} must be a torch.Tensor, got {type(rows).__name__}")
    refuse_grad(name, ((rows_name, rows), (w_name, w), (scale_name, scale_rows), ("scale_w", scale_w), *others),
                "call under torch.no_grad() for inference, or train with "
                "flashoverlap.nn.ExpertParallelMLP(fp8='row'), which defines the backward")
    if fp8_rows:
        if scale_rows is None:
            raise ValueError(f"{name}: fp8 {rows_name} needs {scale_name} (float32 [rows, 1] row-wise, or "
                             "[rows, K/128] block-wise)")
        return rows, scale_rows, mode
    if scale_rows is not None:
        raise ValueError(f"{name}: {scale_name} is given but {rows_name} is {rows.dtype}, not fp8: pass fp8 "
                         f"{rows_name} with it, or leave {scale_name} unset ({rows_name} is then quantised here)")
    if rows.ndim != 2 or rows.dtype not in DTYPES:  # the runtime's: what an fp8 call quantises
        raise ValueError(f"{name}: {rows_name} must be a 2-D bfloat16, float16 or float32 tensor (quantised to fp8 "
                         f"here) or fp8 with {scale_name}, got {rows.dtype} of shape {list(rows.shape)}")
    if mode == "block" and rows.shape[1] % 128:
        raise ValueError(f"{name}: block-wise scales need {rows_name}'s width {rows.shape[1]} to be a multiple of 128")
    if torch.compiler.is_compiling():
        data, scale = quantise(rows.detach(), mode)
        return data, scale, mode
    return rows, None, mode  # no operand requires grad where autograd records (above): nothing to detach

