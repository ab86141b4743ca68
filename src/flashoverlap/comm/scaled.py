"""fp8 calls' mechanics, shared by every communicator that runs them: the scales a call carries, the scaled
product of a band of rows, and the packing of fp8 rows with their scales into one buffer for the all-gather.

The scaling mode follows from the scales' shapes, as in ``torch._scaled_mm`` (``M, N, K`` of the call; all-gather:
the shard's rows):

| mode | ``scale_a`` | ``scale_b`` |
| --- | --- | --- |
| ``"tensor"`` | one fp32 value | one fp32 value |
| ``"row"`` | ``[M, 1]`` | ``[1, N]`` |
| ``"block"`` (DeepSeek-V3) | ``[M, K/128]``, per 1x128 block of A | ``[K/128, ceil(N/128)]``, per 128x128 block of B |

The all-gather moves each shard's fp8 rows and their scales in one buffer (``pack_rows``): a row's K bytes, then its
scales' bytes (4 per row for tensor- and row-wise, ``4 * K/128`` block-wise). Tensor-wise shards may carry
different scales: the gathered A is then row-wise in effect (each row its shard's scale), and so is its product.
The all-reduce and reduce-scatter move the partial products in the output dtype and sum them in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

BLOCK = 128  # the block-wise recipe's block: 1x128 for A, 128x128 for B


@dataclass(slots=True, eq=False)
class Scales:
    """An fp8 call's scales (``a``: A's, ``b``: B's, fp32), its ``mode`` (``MODES``), output dtype and bias."""

    MODES: ClassVar[tuple[str, ...]] = ("tensor", "row", "block")

    a: torch.Tensor
    b: torch.Tensor
    mode: str
    out_dtype: torch.dtype = torch.bfloat16
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
           bias: torch.Tensor | None = None) -> Scales:
        """The scales of a call, their mode told apart by shape (the runtime checks them against the operands)."""
        return cls(scale_a, scale_b, mode_of(scale_a, scale_b), out_dtype, bias)

    def signature(self) -> tuple:
        """What a repeated call must share with its first for the first's checks to hold."""
        bias = self.bias
        return (self.mode, type(self.a), type(self.b), self.a.shape, self.a.dtype, self.b.shape, self.b.dtype,
                self.out_dtype, None if bias is None else (type(bias), bias.shape, bias.dtype, bias.device))

    def scale_columns(self, k: int) -> int:
        """A's scales per row as the all-gather moves them."""
        return k // BLOCK if self.mode == "block" else 1

    def rows_of_a(self, rows: slice, count: int) -> torch.Tensor:
        """A's scales for ``rows`` (``count`` of them) as a ``[count, columns]`` fp32 tensor (tensor-wise: the one
        scale repeated, so that shards of different scales can travel and multiply as rows)."""
        if self.mode == "tensor":
            return self.a.reshape(1, 1).float().expand(count, 1)
        return self.a[rows]


def mode_of(scale_a: object, scale_b: object) -> str:
    """The mode the scales' shapes say (``"?"`` where they fit none: the runtime's check names the problem)."""
    if not isinstance(scale_a, torch.Tensor) or not isinstance(scale_b, torch.Tensor):
        return "?"
    if scale_a.numel() == 1 and scale_b.numel() == 1 and scale_a.ndim <= 2 and scale_b.ndim <= 2:
        return "tensor"
    if scale_a.ndim == 2 and scale_b.ndim == 2:
        if scale_a.shape[1] == 1 and scale_b.shape[0] == 1:
            return "row"
        return "block"
    return "?"


def dequantised_a(a: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``a [rows, K]`` fp8 times its scales (``[rows or 1, 1]``, or ``[rows, K/128]`` per 1x128 block), fp32."""
    scale = scale.float()
    if scale.shape[1] > 1:
        scale = scale.repeat_interleave(BLOCK, dim=1)[:, : a.shape[1]]
    return a.float() * scale


def dequantised_b(b: torch.Tensor, scales: Scales) -> torch.Tensor:
    """``b [K, N]`` fp8 times its scales, fp32."""
    scale = scales.b.float()
    if scales.mode == "block":
        scale = scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[: b.shape[0], : b.shape[1]]
    elif scales.mode == "tensor":
        scale = scale.reshape(1, 1)
    return b.float() * scale


def product(a: torch.Tensor, scale_a: torch.Tensor, b_deq: torch.Tensor, scales: Scales) -> torch.Tensor:
    """One band's scaled product in fp32 with the bias added (``a [rows, K]`` fp8, ``scale_a`` its rows' scales,
    ``b_deq`` B dequantised once per call): what ``torch._scaled_mm`` computes before it rounds to the output
    dtype."""
    c = dequantised_a(a, scale_a) @ b_deq
    return c if scales.bias is None else c + scales.bias.float()


def row_bytes(k: int, dtype: torch.dtype, scales: Scales | None) -> int:
    """The bytes one row of A puts on the wire in an all-gather: its elements, and its scales where fp8."""
    return k * dtype.itemsize + (0 if scales is None else 4 * scales.scale_columns(k))


def pack_rows(a: torch.Tensor, scale_rows: torch.Tensor) -> torch.Tensor:
    """``a [rows, K]`` fp8 and its scales ``[rows, S]`` fp32 as one ``[rows, K + 4 S]`` byte buffer."""
    return torch.cat([a.view(torch.uint8), scale_rows.float().contiguous().view(torch.uint8)], dim=1)


def unpack_rows(packed: torch.Tensor, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_rows``' inverse: ``(a [rows, K] in dtype, scales [rows, S] fp32)``."""
    return packed[:, :k].contiguous().view(dtype), packed[:, k:].contiguous().view(torch.float32)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scales: Scales, scale_a: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` scaled, in the output dtype, as one ``torch._scaled_mm`` (``scale_a``: A's scales where they are
    not ``scales.a``, as ``[rows, S]``). cuBLAS's scaled matmul on CUDA for the tensor- and row-wise modes (a
    row-wise A with a tensor-wise B, the gathered tensor-wise case, takes B's scale as a row); the dequantised fp32
    product elsewhere (block-wise, the CPU)."""
    scale_a = scales.a if scale_a is None else scale_a
    if a.is_cuda and scales.mode != "block":
        scale_b = scales.b
        if scale_a.numel() > 1 and scale_b.numel() == 1:
            scale_a, scale_b = scale_a.reshape(-1, 1), scale_b.reshape(1, 1).expand(1, b.shape[1]).contiguous()
        return torch._scaled_mm(a, b, scale_a.float(), scale_b.float(), bias=scales.bias, out_dtype=scales.out_dtype)
    if scale_a.ndim < 2:
        scale_a = scale_a.reshape(1, 1)
    return product(a, scale_a, dequantised_b(b, scales), scales).to(scales.out_dtype)
