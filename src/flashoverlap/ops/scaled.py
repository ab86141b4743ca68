"""The fp8 ops: ``scaled_gemm_all_reduce``, ``scaled_gemm_reduce_scatter``, ``all_gather_scaled_gemm``, each
returning what ``torch._scaled_mm`` followed by the collective returns (``comm/scaled.py`` has the scaling modes and
what crosses the wire), on the one call pipeline (``runtime/calls.py``) as the bf16 ops are, and overlapped on the
paths ``runtime.policy.FP8_PATHS`` lists (P2P and NCCL).

Operands ``float8_e4m3fn`` (``float8_e5m2`` beside an e4m3 operand, as ``torch._scaled_mm`` allows), fp32 scales
whose shapes say the mode (tensor-wise, row-wise, block-wise 1x128 / 128x128), output bf16 (default) or fp32, an
optional bias ``[N]`` in the output dtype, added by each rank's product as ``_scaled_mm(..., bias=bias)`` would
(for a row-parallel layer pass it on one rank). Registered as ``torch.ops.flashoverlap.scaled_*`` with fake
implementations, so that ``torch.compile`` traces them; they take no part in autograd themselves (the fp8 styles,
``flashoverlap.nn.Float8*``, define the backward): with grad enabled, an operand that requires grad raises, naming
it (``ops/library.refuse_grad``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm.scaled import BLOCK, Scales
from flashoverlap.ops.library import _group, _world, group_name, refuse_grad
from flashoverlap.plan import Plan
from flashoverlap.runtime.calls import GEMM, GemmSpec, execute


def scaled_gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                           group: dist.ProcessGroup | None = None, *, out_dtype: torch.dtype = torch.bfloat16,
                           bias: torch.Tensor | None = None, path: str = "auto",
                           plan: Plan | None = None) -> torch.Tensor:
    """``c = torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype); dist.all_reduce(c)``: the
    partial products summed in fp32.

    Args:
        a: ``[M, K]`` fp8, this rank's K-shard of the input; ``b``: ``[K, N]`` fp8 (``w.t()`` of an ``[N, K]``
            weight, as ``_scaled_mm`` wants it).
        scale_a, scale_b: fp32; tensor-wise one value each, row-wise ``[M, 1]`` and ``[1, N]``, block-wise
            ``[M, K/128]`` and ``[K/128, ceil(N/128)]`` (K a multiple of 128).
        group, path, plan: as for :func:`flashoverlap.gemm_all_reduce`. CPU tensors run the reference path; on
            CUDA fp8 is overlapped on the P2P path (scaled cuBLAS sub-bands, copy engines; ``path="auto"`` takes it
            on one node with peer access, as for bf16) and the NCCL path (elsewhere: the signalling fp8 GEMM, whose
            plan's GEMM is the fp8 kernel, block-wise with ``tile.block_k`` 128, or with ``gemm="cublas"`` bands of
            ``torch._scaled_mm``); a call too small to overlap runs the scaled matmul then the collective.
        out_dtype: ``torch.bfloat16`` or ``torch.float32``; bias: ``[N]`` in ``out_dtype``, or None.

    Returns:
        ``[M, N]`` in ``out_dtype``, identical on every rank.
    """
    return _run("scaled_gemm_all_reduce", "all_reduce", (a, b, scale_a, scale_b, group), out_dtype, bias, path,
                plan=plan)[0]


def scaled_gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                               group: dist.ProcessGroup | None = None, *, out_dtype: torch.dtype = torch.bfloat16,
                               bias: torch.Tensor | None = None, path: str = "auto",
                               plan: Plan | None = None) -> torch.Tensor:
    """``torch._scaled_mm(a, b, ...)`` reduce-scattered by rows: rank r gets rows ``[r*M/W, (r+1)*M/W)`` of the
    sum, ``[M/W, N]`` in ``out_dtype`` (``M % W == 0``). Arguments as :func:`scaled_gemm_all_reduce`."""
    return _run("scaled_gemm_reduce_scatter", "reduce_scatter", (a, b, scale_a, scale_b, group), out_dtype, bias,
                path, plan=plan)[0]


def all_gather_scaled_gemm(a_shard: torch.Tensor, b: torch.Tensor, scale_a_shard: torch.Tensor,
                           scale_b: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                           out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
                           path: str = "auto", plan: Plan | None = None) -> torch.Tensor:
    """``torch._scaled_mm(all_gather(a_shard), b, all_gather(scale_a_shard), scale_b, ...)``: ``[M, N]`` with
    ``M = W * a_shard.shape[0]``. Each shard's fp8 rows travel with their scales; tensor-wise shards may carry
    different scales (each row is multiplied by its own shard's).

    The gathered input too (a backward's weight gradient needs it): ``all_gather_scaled_gemm_gathered``."""
    return _run("all_gather_scaled_gemm", "all_gather", (a_shard, b, scale_a_shard, scale_b, group), out_dtype,
                bias, path, plan=plan)[0]


def all_gather_scaled_gemm_gathered(a_shard: torch.Tensor, b: torch.Tensor, scales: Scales,
                                    group: dist.ProcessGroup | None = None,
                                    path: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``all_gather_scaled_gemm`` with the gathered input: ``(c, a_full, scale_a_full)``, the gathered fp8
    ``[M, K]`` in rank order and its scales ``[M, S]`` fp32 (``S`` 1, per row, tensor- and row-wise; ``K/128``
    block-wise). ``scales``: ``comm.scaled.Scales.of(scale_a_shard, scale_b, out_dtype, bias)``."""
    c, gathered = _run("all_gather_scaled_gemm", "all_gather", (a_shard, b, scales.a, scales.b, group),
                       scales.out_dtype, scales.bias, path, True)
    return c, *gathered


def _run(name: str, op: str, operands: tuple, out_dtype: torch.dtype, bias: torch.Tensor | None, path: str,
         return_gathered: bool = False, plan: Plan | None = None) -> tuple:
    """Every fp8 call's body, public op and custom op alike: traced, the custom op; else the one call pipeline."""
    a, b, scale_a, scale_b, group = operands
    if torch.compiler.is_compiling():  # traced: the custom op (its fake gives the shapes)
        if plan is not None:
            raise ValueError(f"{name}: plan= is not traced by torch.compile (the custom op takes none): leave it "
                             "unset in compiled code (fp8 calls take the library's fp8 plan; `flashoverlap tune "
                             "plan` tunes bf16 and fp16 only)")
        ops = torch.ops.flashoverlap
        if op == "all_gather":
            c, a_full, scale_full = ops.all_gather_scaled_gemm(a, b, scale_a, scale_b, group_name(group, name),
                                                               out_dtype, bias, path)
            return c, (a_full, scale_full)
        custom = ops.scaled_gemm_all_reduce if op == "all_reduce" else ops.scaled_gemm_reduce_scatter
        return custom(a, b, scale_a, scale_b, group_name(group, name), out_dtype, bias, path), None
    refuse_grad(name, (("a_shard" if op == "all_gather" else "a", a), ("b", b),
                       ("scale_a_shard" if op == "all_gather" else "scale_a", scale_a), ("scale_b", scale_b),
                       ("bias", bias)),
                "call under torch.no_grad(), or train with the fp8 styles (flashoverlap.nn.Float8*), which define "
                "the backward")
    spec = GemmSpec(name, op, a, b, group, plan, path, return_gathered,
                    scales=Scales.of(scale_a, scale_b, out_dtype, bias, b.shape[-1] if isinstance(b, torch.Tensor)
                                     and b.ndim == 2 else None))
    return execute(GEMM, spec)


# -- custom ops (``torch.compile``) ----------------------------------------------------------------------------------


@torch.library.custom_op("flashoverlap::scaled_gemm_all_reduce", mutates_args=())
def _scaled_all_reduce(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group: str,
                       out_dtype: torch.dtype, bias: torch.Tensor | None, path: str) -> torch.Tensor:
    return _run("scaled_gemm_all_reduce", "all_reduce", (a, b, scale_a, scale_b, _group(group)), out_dtype, bias,
                path)[0]


@_scaled_all_reduce.register_fake
def _(a, b, scale_a, scale_b, group, out_dtype, bias, path):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("flashoverlap::scaled_gemm_reduce_scatter", mutates_args=())
def _scaled_reduce_scatter(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                           group: str, out_dtype: torch.dtype, bias: torch.Tensor | None, path: str) -> torch.Tensor:
    return _run("scaled_gemm_reduce_scatter", "reduce_scatter", (a, b, scale_a, scale_b, _group(group)), out_dtype,
                bias, path)[0]


@_scaled_reduce_scatter.register_fake
def _(a, b, scale_a, scale_b, group, out_dtype, bias, path):
    return a.new_empty((a.shape[0] // _world(group), b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("flashoverlap::all_gather_scaled_gemm", mutates_args=())
def _all_gather_scaled(a_shard: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       group: str, out_dtype: torch.dtype, bias: torch.Tensor | None,
                       path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    operands = (a_shard, b, scale_a, scale_b, _group(group))
    c, (a_full, scale_full) = _run("all_gather_scaled_gemm", "all_gather", operands, out_dtype, bias, path, True)
    return c, a_full, scale_full


@_all_gather_scaled.register_fake
def _(a_shard, b, scale_a, scale_b, group, out_dtype, bias, path):
    rows = a_shard.shape[0] * _world(group)
    columns = a_shard.shape[1] // BLOCK if scale_a.ndim == 2 and scale_a.shape[1] > 1 else 1
    return (a_shard.new_empty((rows, b.shape[1]), dtype=out_dtype), a_shard.new_empty((rows, a_shard.shape[1])),
            a_shard.new_empty((rows, columns), dtype=torch.float32))
