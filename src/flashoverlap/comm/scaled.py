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
scales' bytes (4 per row for tensor- and row-wise, ``4 * K/128`` block-wise), each part padded to 16 bytes so that a
kernel reads the fp8 rows through TMA and the scales as fp32 straight from the gathered buffer (``unpack_rows``: views,
no copy). Tensor-wise shards may carry
different scales: the gathered A is then row-wise in effect (each row its shard's scale), and so is its product.
The all-reduce and reduce-scatter move the partial products in the output dtype and sum them in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK = 128  # the block-wise recipe's block: 1x128 for A, 128x128 for B
ALIGN = 16  # bytes: a packed row's parts start at multiples of this (TMA and cuBLAS want 16-byte aligned rows)


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
           bias: torch.Tensor | None = None, n: int | None = None) -> Scales:
        """The scales of a call, their mode told apart by shape (the runtime checks them against the operands;
        ``n``, B's columns where known, tells block-wise scales at K = 128 from row-wise ones: ``mode_of``)."""
        return cls(scale_a, scale_b, mode_of(scale_a, scale_b, n), out_dtype, bias)

    def signature(self) -> tuple:
        """What a repeated call must share with its first for the first's checks to hold."""
        bias = self.bias
        return (self.mode, type(self.a), type(self.b), self.a.shape, self.a.dtype, self.a.device, self.b.shape,
                self.b.dtype, self.b.device, self.out_dtype,
                None if bias is None else (type(bias), bias.shape, bias.dtype, bias.device))

    def scale_columns(self, k: int) -> int:
        """A's scales per row as the all-gather moves them."""
        return k // BLOCK if self.mode == "block" else 1

    def rows_of_a(self, rows: slice, count: int) -> torch.Tensor:
        """A's scales for ``rows`` (``count`` of them) as a ``[count, columns]`` fp32 tensor (tensor-wise: the one
        scale repeated, so that shards of different scales can travel and multiply as rows)."""
        if self.mode == "tensor":
            return self.a.reshape(1, 1).float().expand(count, 1)
        return self.a[rows]

    def shard_rows(self, count: int) -> torch.Tensor:
        """``rows_of_a`` for a whole shard of ``count`` rows: A's own scales as they are, not a slice of them."""
        return self.rows_of_a(slice(0, count), count) if self.mode == "tensor" else self.a


def mode_of(scale_a: object, scale_b: object, n: int | None = None) -> str:
    """The mode the scales' shapes say (``"?"`` where they fit none: the runtime's check names the problem). At
    K = 128 block-wise A scales ``[M, 1]`` look row-wise; B's tell them apart where ``n`` (B's columns) is given:
    row-wise ``[1, N]``, block-wise ``[1, ceil(N / 128)]``."""
    if not isinstance(scale_a, torch.Tensor) or not isinstance(scale_b, torch.Tensor):
        return "?"
    if scale_a.numel() == 1 and scale_b.numel() == 1 and scale_a.ndim <= 2 and scale_b.ndim <= 2:
        return "tensor"
    if scale_a.ndim == 2 and scale_b.ndim == 2:
        if scale_a.shape[1] == 1 and scale_b.shape[0] == 1 and (n is None or scale_b.shape[1] == n
                                                                 or scale_b.shape[1] != -(-n // BLOCK)):
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


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def row_bytes(k: int, dtype: torch.dtype, scales: Scales | None) -> int:
    """The bytes one row of A puts on the wire in an all-gather: its elements; fp8, its packed row (``pack_rows``)."""
    return k * dtype.itemsize if scales is None else _aligned(k) + _aligned(4 * scales.scale_columns(k))


def packed_width(k: int, columns: int) -> int:
    """Bytes of one ``pack_rows`` row: ``k`` fp8 bytes and ``columns`` fp32 scales, each part padded to ``ALIGN``."""
    return _aligned(k) + _aligned(4 * columns)


def pack_rows(a: torch.Tensor, scale_rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a [rows, K]`` fp8 and its scales ``[rows, S]`` fp32 written into one ``[rows, width]`` byte buffer (``out``,
    any row-sliced view of one, or a new one): A's bytes from column 0, the scales' from ``_aligned(K)``; the padding
    is never read. (An all-gather's own slots of every band take the rows straight, through ``PackedRows.slots``.)"""
    rows, k = a.shape
    columns = scale_rows.shape[1]
    width = _aligned(k) + _aligned(4 * columns)
    if out is None:
        out = torch.empty((rows, width), dtype=torch.uint8, device=a.device)
    elif tuple(out.shape) != (rows, width) or out.dtype != torch.uint8:
        raise ValueError(f"pack_rows: out must be [{rows}, {width}] uint8, got {list(out.shape)} {out.dtype}")
    a_view, scale_view = unpack_rows(out, k, a.dtype, columns)
    a_view.copy_(a)
    scale_view.copy_(scale_rows)
    return out


def unpack_rows(packed: torch.Tensor, k: int, dtype: torch.dtype,
                columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_rows``' inverse, as views of ``packed`` (no copy): ``(a [rows, K] in dtype, scales [rows, columns]
    fp32)``, both with ``packed``'s row stride (``.contiguous()`` where a consumer wants dense tensors); leading
    dimensions kept."""
    offset = _aligned(k)
    return packed[..., :k].view(dtype), packed[..., offset : offset + 4 * columns].view(torch.float32)


class PackedRows:
    """A dense ``[rows, width]`` buffer of ``pack_rows``' layout (an all-gather's gathered rows) read as its parts:
    ``a`` ``[rows, K]`` and ``scales`` ``[rows, S]``, and ``slots`` of it, as strided views of two views of its whole
    storage (one in A's dtype, one in fp32), where ``unpack_rows`` slices and re-views for each: the host issues one
    operator per view (an eager fp8 all-gather's host time)."""

    __slots__ = ("width", "k", "columns", "base", "_as_a", "_as_scales", "a", "scales")

    def __init__(self, packed: torch.Tensor, k: int, dtype: torch.dtype, columns: int) -> None:
        rows, width = packed.shape
        if (packed.dtype != torch.uint8 or dtype.itemsize != 1 or not packed.is_contiguous() or width % 4
                or packed.storage_offset() % 4 or width < _aligned(k) + 4 * columns):
            raise ValueError(f"PackedRows: a dense uint8 [rows, width] buffer (width and offset multiples of 4, room "
                             f"for {k} one-byte elements and {columns} scales a row) read as {dtype}, got "
                             f"{list(packed.shape)} {packed.dtype} strides {packed.stride()} offset "
                             f"{packed.storage_offset()}")
        self.width, self.k, self.columns, self.base = width, k, columns, packed.storage_offset()
        self._as_a, self._as_scales = packed.view(dtype), packed.view(torch.float32)
        self.a = self._as_a.as_strided((rows, k), (width, 1), self.base)
        self.scales = self._as_scales.as_strided((rows, columns), (width // 4, 1), (self.base + _aligned(k)) // 4)

    def slots(self, bands: int, world: int, rows: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rank``'s slot of every band (``bands`` bands of ``world`` slots of ``rows`` rows each, in order: the
        all-gather's ``[group][W][rows]`` layout with even bands, ``collectives.even_band_rows``) as ``([bands, rows, K]
        in A's dtype, [bands, rows, S] fp32)``."""
        start, band = self.base + rank * rows * self.width, world * rows * self.width
        return (self._as_a.as_strided((bands, rows, self.k), (band, self.width, 1), start),
                self._as_scales.as_strided((bands, rows, self.columns), (band // 4, self.width // 4, 1),
                                           (start + _aligned(self.k)) // 4))


def gathered_input(packed: torch.Tensor, k: int, dtype: torch.dtype, scales: Scales,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An all-gather's packed rows as a call returns its gathered input: ``(a [rows, K], scales [rows, S])``, dense
    copies of ``unpack_rows``' views (into ``out``'s two dense tensors where given)."""
    a, scale_rows = unpack_rows(packed, k, dtype, scales.scale_columns(k))
    if out is None:
        return a.contiguous(), scale_rows.contiguous()
    out[0].copy_(a)
    out[1].copy_(scale_rows)
    return out


def cublas_takes(a: torch.Tensor, b: torch.Tensor, mode: str) -> bool:
    """Whether ``torch._scaled_mm`` multiplies this CUDA product in ``mode``: rows of A 16-byte multiples, B
    column-major (``w.t()``) with N a multiple of 16; block-wise, on a Hopper GPU, K a multiple of 512 (torch 2.11's
    block-wise kernel returned zeros on an H200 where ``K/128`` was not a multiple of 4) and A's rows a multiple of 4
    (cuBLAS refused 501, 502, 1001 and 1002 rows and took 504 and 512: benchmarks/diagnostics/scaled_mm_probe.py,
    logs/issue35); A and B starting on 16-byte boundaries, their rows (columns) 16-byte multiples apart."""
    if not a.is_cuda or a.shape[1] % 16 or b.shape[1] % 16 or b.stride(0) != 1 or a.stride(1) != 1:
        return False
    if (a.data_ptr() % ALIGN or b.data_ptr() % ALIGN or (a.shape[0] > 1 and a.stride(0) % ALIGN)
            or (b.shape[1] > 1 and b.stride(1) % ALIGN)):
        return False  # cuBLASLt's fp8 kernels read whole 16-byte rows from 16-byte aligned starts
    return mode != "block" or (a.shape[1] % (4 * BLOCK) == 0 and a.shape[0] % 4 == 0 and _hopper(a.device.index))


@functools.cache
def _hopper(index: int) -> bool:
    """Whether CUDA device ``index`` (a tensor's: never None) is an sm90 GPU, asked once per device:
    ``torch.cuda.get_device_capability`` cost a block-wise call a quarter of a ``torch.mm``'s host time
    (logs/issue35, fp8 host time in parts)."""
    return torch.cuda.get_device_capability(index) == (9, 0)


def _aligned_start(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where its first element is not ``ALIGN``-byte aligned: a band's row slice of a scale
    vector starts mid-tensor (rows 501.. of a ``[1002, 1]`` scale: 2004 bytes in), and cuBLASLt refuses such a scale
    pointer (``CUBLAS_STATUS_NOT_SUPPORTED`` on an H200, logs/issue35)."""
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scales: Scales, scale_a: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` scaled, in the output dtype (into ``out`` where given), as one ``torch._scaled_mm`` where cuBLAS takes
    it (``cublas_takes``); the dequantised fp32 product elsewhere (the CPU, odd shapes). ``scale_a``: A's scales where
    they are not ``scales.a``, as ``[rows, S]``, any strides. A row-wise A with a tensor-wise B (the gathered
    tensor-wise case) takes B's scale as a row; block-wise scales are laid out outer-dim-major, the only layout
    torch 2.11 took. A bias with fp32 output, which torch 2.11 refuses, is added after the product (in fp32, as
    ``_scaled_mm`` adds it)."""
    scale_a = scales.a if scale_a is None else scale_a
    if cublas_takes(a, b, scales.mode):
        scale_b = scales.b
        if scales.mode == "block":
            scale_a, scale_b = scale_a.t().contiguous().t(), scale_b.t().contiguous().t()
        else:
            if scale_a.numel() > 1 and scale_b.numel() == 1:
                scale_a, scale_b = scale_a.reshape(-1, 1), scale_b.reshape(1, 1).expand(1, b.shape[1])
            scale_a, scale_b = scale_a.contiguous(), scale_b.contiguous()
        scale_a, scale_b = _aligned_start(scale_a), _aligned_start(scale_b)
        bias = scales.bias
        late = bias is not None and scales.out_dtype == torch.float32
        if out is None:
            out = torch._scaled_mm(a, b, scale_a, scale_b, bias=None if late else bias, out_dtype=scales.out_dtype)
        else:
            torch._scaled_mm(a, b, scale_a, scale_b, bias=None if late else bias, out_dtype=scales.out_dtype, out=out)
        return out.add_(bias) if late else out
    if scale_a.ndim < 2:
        scale_a = scale_a.reshape(1, 1)
    c = product(a, scale_a, dequantised_b(b, scales), scales)
    return c.to(scales.out_dtype) if out is None else out.copy_(c)
