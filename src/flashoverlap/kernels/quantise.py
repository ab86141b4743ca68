"""Quantising rows to fp8 in one kernel: ``x [rows, K]`` (bf16, fp16 or fp32) into fp8 rows ``q`` and fp32 scales,
one per row (``[rows, 1]``) or one per 1x128 block (``[rows, K/128]``), the values ``comm/expert/scaled.quantise``
defines: ``scale = max(amax * (1 / fp8_max), 1e-12)`` and ``q = fp8(x / scale)`` in fp32, rounded to nearest even.

The torch form of the same is five kernels (the largest magnitudes, the scale's two steps, the quotient, the cast
into place), each a launch and each reading or writing the rows again; an fp8 expert call quantises its rows as the
first step of its issued work, so on a call that is not replayed those launches are host time (issue 44's target:
the fp8 layer's host time within 1.15x bf16's). Here one program quantises one row: its largest magnitude (a pass
over the row), then the quotient and the cast (a second pass), writing the scales and the fp8 bytes where the
caller's views lie (the packed wire rows: a row stride past K). The scale is the largest magnitude times the fp32
reciprocal of the fp8 maximum (what torch's CUDA division by a number computes), the quotient correctly rounded
(``div_rn``, as torch's division of two tensors), so the bytes match the torch form's. A row (block) holding a NaN
gets a NaN scale and NaN bytes (torch's largest magnitude propagates it; Triton's maximum would drop it).
"""

from __future__ import annotations

import functools
import math

import torch

from flashoverlap.kernels.launch import Launcher

_TRITON_MISSING: ModuleNotFoundError | None = None
try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ModuleNotFoundError as exc:  # a CPU install without the gpu extra: the torch form serves
    _TRITON_MISSING = exc

    def _jit(fn):
        return fn

BLOCK = 128  # channels per block-wise scale
_MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}  # stored mantissa bits
CHUNK = 1024  # channels a program reads at a time (row-wise); block-wise, CHUNK // BLOCK scales at a time


@_jit
def _to_grid(v, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    # v rounded to nearest even onto the fp8 grid, in fp32: add and take away 1.5 * 2^(e + 23 - MANTISSA), where
    # 2^e is v's binade (at least the fp8 dtype's smallest normal one), so that the sum's last bit is the fp8
    # spacing there; a carry into the next binade (124.5 -> 128 in e4m3) falls out of the addition. Sign kept
    # (-0.0 stays -0.0), NaN kept.
    bits = v.to(tl.int32, bitcast=True)
    binade = tl.maximum((bits >> 23) & 0xFF, 127 + MIN_EXPONENT)
    magic = (((binade - MANTISSA + 23) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = ((tl.abs(v) + magic) - magic).to(tl.int32, bitcast=True) | (bits & -2147483648)
    return tl.where(v != v, v, rounded.to(tl.float32, bitcast=True))


@_jit
def quantise_kernel(x_ptr, q_ptr, scale_ptr, k, x_stride, q_stride, scale_stride, INV_FP8_MAX: tl.constexpr,
                    MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr, BLOCKWISE: tl.constexpr, CHUNK: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row, s_row = x_ptr + row * x_stride, q_ptr + row * q_stride, scale_ptr + row * scale_stride
    if BLOCKWISE:  # K % BLOCK == 0: each chunk is CHUNK // BLOCK whole blocks, each with its own scale
        blocks: tl.constexpr = CHUNK // BLOCK
        cols = tl.arange(0, blocks)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        for start in range(0, k, CHUNK):
            mask = start + cols < k
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            nans = tl.sum((x != x).to(tl.int32), axis=1)
            top = tl.max(tl.abs(x), axis=1)
            scale = tl.maximum(top * INV_FP8_MAX, 1e-12)
            scale = tl.where(nans > 0, float("nan"), scale)
            firsts = start + tl.arange(0, blocks) * BLOCK  # each block's first channel
            tl.store(s_row + firsts // BLOCK, scale, mask=firsts < k)
            q = _to_grid(tl.math.div_rn(x, scale[:, None]), MANTISSA, MIN_EXPONENT)
            tl.store(q_row + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        cols = tl.arange(0, CHUNK)
        top = tl.zeros((CHUNK,), dtype=tl.float32)
        nans = tl.zeros((CHUNK,), dtype=tl.int32)
        for start in range(0, k, CHUNK):
            x = tl.load(x_row + start + cols, mask=start + cols < k, other=0.0).to(tl.float32)
            nans += (x != x).to(tl.int32)
            top = tl.maximum(top, tl.abs(x))
        scale = tl.maximum(tl.max(top, axis=0) * INV_FP8_MAX, 1e-12)
        scale = tl.where(tl.sum(nans, axis=0) > 0, float("nan"), scale)
        tl.store(s_row, scale)
        for start in range(0, k, CHUNK):
            mask = start + cols < k
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            q = _to_grid(tl.math.div_rn(x, scale), MANTISSA, MIN_EXPONENT)
            tl.store(q_row + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


_LAUNCH = Launcher(quantise_kernel)


def available() -> bool:
    """Whether Triton is installed (a CPU install without the gpu extra quantises with torch)."""
    return _TRITON_MISSING is None


def quantise_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, blockwise: bool) -> None:
    """On the current stream: ``x [rows, K]`` (unit column stride) into ``q [rows, K]`` (fp8, unit column stride) and
    ``scale`` (fp32, ``[rows, 1]`` or, ``blockwise``, ``[rows, K/128]``, unit column stride): the module docstring's
    values. The views may lie in one packed buffer (any row strides)."""
    if _TRITON_MISSING is not None:
        raise _TRITON_MISSING
    rows, k = x.shape
    if rows == 0 or k == 0:
        return
    _LAUNCH(rows, (x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0)), _constants(q.dtype, blockwise))


@functools.cache
def _constants(dtype: torch.dtype, blockwise: bool) -> dict:
    """The kernel's constexprs and launch options for an fp8 ``dtype`` and scaling mode: made once per pair
    (``torch.finfo`` and the logarithm on every call were host time). Shared by every launch: never written."""
    info = torch.finfo(dtype)
    return {"INV_FP8_MAX": 1 / info.max, "MANTISSA": _MANTISSA[dtype],
            "MIN_EXPONENT": round(math.log2(info.smallest_normal)), "BLOCKWISE": blockwise, "CHUNK": CHUNK,
            "BLOCK": BLOCK, "num_warps": 4}
