"""fp8 expert calls' mechanics, shared by every expert path (reference, NCCL, P2P): the scales a call carries
(``ExpertScales``), quantising bf16 rows (``quantise``), the packed wire rows (fp8 row and its scales in one byte row,
``comm/scaled.pack_rows``, as the tensor-parallel fp8 all-gather moves them), and the scaled product of one expert's
rows (``expert_product``) and of a chunk's segments (``scaled_multiply``: the loop, ``torch._scaled_grouped_mm`` or
the Triton kernel).

Scaling modes (the mode follows from the weights' scales' shape):

| mode | rows' scales (``x`` / ``a``) | weights' scales (``w [L, K, N]``) |
| --- | --- | --- |
| ``"row"`` | ``[rows, 1]``: one per row | ``[L, N]``: one per expert and output column |
| ``"block"`` (DeepSeek-V3) | ``[rows, K/128]``: per 1x128 block | ``[L, K/128, ceil(N/128)]``: per 128x128 |

The weights' scales follow the ``[L, K, N]`` orientation the op is given (for ``nn.Linear``-shaped ``[L, N, K]``
weights passed as ``w.transpose(1, 2)``, pass their ``[L, N/128, K/128]`` block scales as ``s.transpose(1, 2)``;
row-wise ``[L, N]`` is the same either way). Rows and weights are ``float8_e4m3fn`` (e5m2 raises: torch's grouped
fp8 kernel multiplies e4m3 only). ``y = (x * sx) @ (w[l] * sw[l])`` in fp32, rounded to the output dtype (bf16 by
default, or fp32). What crosses the wire: dispatch moves each routed row packed (its K fp8 bytes padded to 16, then
its scales' fp32 bytes padded to 16: at K = 7168 block-wise, 7168 + 224 bytes, 0.516x the bf16 row); combine returns
rows of the output dtype (bf16 unless fp32 is asked for).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flashoverlap.comm.scaled import BLOCK, FP8, Scales, _aligned, pack_rows, packed_width, scaled_mm, unpack_rows

MODES = ("row", "block")
E4M3_MAX = 448.0


@dataclass(slots=True, eq=False)
class ExpertScales:
    """An fp8 expert call's scales (``comm/expert/scaled.py``): ``mode`` (``"row"`` or ``"block"``), ``b`` the
    weights' scales, ``a`` the rows' scales (dispatch: the given rows', ``[T, S]`` or ``[T*k, S]`` per choice; combine:
    ``a``'s ``[R, S]``), the output dtype and the rows' fp8 dtype. ``a`` None: the call's rows came in bf16/fp16/fp32
    and are quantised into a wire buffer of the call's own as its first issued step (``wired``): so that a replayed
    call's graph holds the buffer and the quantisation, and a repeated call's host allocates and slices nothing
    for them."""

    mode: str
    b: torch.Tensor
    a: torch.Tensor | None
    out_dtype: torch.dtype = torch.bfloat16
    dtype: torch.dtype = torch.float8_e4m3fn  # the rows' fp8 dtype

    def columns(self, k: int) -> int:
        """Scales per row of ``k`` channels: 1 row-wise, ``k / 128`` block-wise."""
        return k // BLOCK if self.mode == "block" else 1

    def signature(self) -> tuple:
        return (self.mode, None if self.a is None else self.a.shape[1:], self.b.shape, self.out_dtype, self.dtype)


def mode_of_weight_scales(scale_w: object) -> str | None:
    """``"row"`` for a 2-D ``[L, N]``, ``"block"`` for a 3-D ``[L, K/128, N/128]``, None otherwise."""
    if not isinstance(scale_w, torch.Tensor):
        return None
    return {2: "row", 3: "block"}.get(scale_w.ndim)


def wire_width(k: int, mode: str) -> int:
    """Bytes of one packed dispatch row of ``k`` fp8 channels in ``mode``."""
    return packed_width(k, k // BLOCK if mode == "block" else 1)


def quantise(x: torch.Tensor, mode: str, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, K]`` (any float) as fp8 and its fp32 scales (``[rows, 1]`` row-wise, ``[rows, K/128]`` block-wise):
    each row (or 1x128 block) scaled so that its largest magnitude is the fp8 dtype's largest, ``x ~ q * scale``
    (``scale = max(amax * (1 / fp8_max), 1e-12)``, ``q = x / scale`` in fp32, rounded to fp8).

    Both are views of one wire buffer (``pack``'s layout: the fp8 row then its scales, a row stride of
    ``wire_width(K, mode)`` bytes), so that ``pack`` of the pair is that buffer, no copy; ``.contiguous()`` where a
    consumer wants dense tensors (traced by ``torch.compile``: dense tensors, the same values). One kernel on a GPU
    (``kernels/quantise.py``; torch's where Triton is missing or ``x``'s columns are strided), five torch kernels
    elsewhere (the largest magnitudes, the scale's two steps, the
    quotient, the cast into place), the same bytes: ``x / scale`` never exceeds the fp8 maximum by more than a
    rounding of the scale (far under half a step of fp8 at its top), which the round to nearest takes to the
    maximum: no clamp is needed (a NaN row stays NaN, its sign aside)."""
    rows, k = x.shape
    if torch.compiler.is_compiling():  # traced: the same values, functionally (the compiler fuses them anyway)
        xf, inverse, columns = x.float(), 1 / torch.finfo(dtype).max, k // BLOCK if mode == "block" else 1
        if mode == "block":
            blocks = xf.reshape(rows, columns, BLOCK)
            scale = (blocks.abs().amax(2) * inverse).clamp_min(1e-12)
            return (blocks / scale[:, :, None]).to(dtype).reshape(rows, k), scale
        scale = (xf.abs().amax(1, keepdim=True) * inverse).clamp_min(1e-12)
        return (xf / scale).to(dtype), scale
    q, scale = wire_rows(rows, k, mode, dtype, x.device)
    quantise_into(x, q, scale, mode)
    return q, scale


def wire_rows(rows: int, k: int, mode: str, dtype: torch.dtype, device: torch.device,
              new=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unwritten fp8 rows ``[rows, k]`` and their fp32 scales (``[rows, 1]`` or ``[rows, k/128]``): views of one fresh
    wire buffer in ``pack``'s layout (``quantise_into`` writes them), from ``new(shape, dtype)`` where given (a
    communicator's allocator)."""
    columns = k // BLOCK if mode == "block" else 1
    shape = (rows, packed_width(k, columns))
    packed = torch.empty(shape, dtype=torch.uint8, device=device) if new is None else new(shape, torch.uint8)
    return unpack_rows(packed, k, dtype, columns)


_QUANTISE = None  # kernels.quantise, imported on the first GPU quantisation (Triton: where a kernel runs)


def quantise_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mode: str) -> None:
    """``quantise``'s kernels: ``x [rows, K]`` into ``q`` (fp8) and ``scale`` (``wire_rows``' views). On a GPU one
    Triton kernel (``kernels/quantise.py``: the same bytes, one launch instead of five); elsewhere torch's."""
    if x.is_cuda and x.stride(1) == 1:
        global _QUANTISE
        if _QUANTISE is None:
            from flashoverlap.kernels import quantise as _QUANTISE  # Triton: imported where a kernel runs
        if _QUANTISE.available():
            _QUANTISE.quantise_rows(x, q, scale, mode == "block")
            return
    quantise_with_torch(x, q, scale, mode)


def quantise_with_torch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mode: str) -> None:
    """``quantise_into`` in torch operators (the CPU's, and the GPU kernel's oracle)."""
    rows, k = x.shape
    columns = scale.shape[1]
    rows_in = x.reshape(rows, columns, BLOCK) if mode == "block" else x.unsqueeze(1)  # [rows, S, K/S]
    if x.is_cuda:  # one kernel: the low-precision rows read as fp32 in the reduction itself
        torch.linalg.vector_norm(rows_in, float("inf"), dim=2, dtype=torch.float32, out=scale)
    else:  # the CPU's infinity norm is a slow loop (and it casts first): the plain largest magnitude
        torch.amax(rows_in.float().abs(), 2, out=scale)
    # Times the reciprocal, not a division: what torch's CUDA kernel computes for a division by a number (its CPU
    # one divides), so that the scales are the same on both and the GPU kernel's.
    scale.mul_(1 / torch.finfo(q.dtype).max).clamp_min_(1e-12)
    q.view(rows, columns, k // columns).copy_(torch.div(rows_in, scale[:, :, None]))


def wired(call, a: torch.Tensor, new=None) -> tuple:
    """The first step of an fp8 call's issued work (every expert communicator's, before anything reads the rows):
    where its rows ``a`` came in bf16/fp16/fp32 (``ExpertScales.a`` None), quantise them into fresh wire rows
    (``wire_rows``, from ``new``, the communicator's allocator, where given) and return the call with those fp8 rows
    and their scales, and the rows; otherwise ``(call, a)``. Inside a capture the buffer comes from the graph's pool,
    so a replay allocates nothing for it."""
    scales = call.scales
    if scales is None or scales.a is not None:
        return call, a
    q, scale = wire_rows(a.shape[0], a.shape[1], scales.mode, scales.dtype, a.device, new)
    quantise_into(a, q, scale, scales.mode)
    return dataclasses.replace(call, a=q, scales=dataclasses.replace(scales, a=scale)), q


def rows_dtype(a: torch.Tensor, scales: ExpertScales | None) -> torch.dtype:
    """The dtype a call's rows are multiplied (and, dispatch, sent) in: their own where they came in fp8 (or the call
    is not fp8), the fp8 dtype they are quantised to where the call quantises them (``wired``)."""
    return a.dtype if scales is None or scales.a is not None else scales.dtype


def pack(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The wire rows: ``x [rows, K]`` fp8 and its scales ``[rows, S]`` in one ``[rows, wire_width]`` uint8 tensor; where
    the pair lie in one such buffer already (``quantise``'s views), a view of it: no copy."""
    rows, k = x.shape
    width = packed_width(k, scale.shape[1])
    if (x.stride() == (width, 1) and scale.stride() == (width // 4, 1) and scale.dtype == torch.float32
            and scale.data_ptr() == x.data_ptr() + _aligned(k) and x.element_size() == 1):
        storage = x.untyped_storage()
        if (storage.data_ptr() == scale.untyped_storage().data_ptr()
                and storage.nbytes() >= x.storage_offset() + rows * width):
            return x.view(torch.uint8).as_strided((rows, width), (width, 1))
    return pack_rows(x, scale.float())


def unpack(packed: torch.Tensor, k: int, dtype: torch.dtype, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack``'s inverse as views (``comm/scaled.unpack_rows``)."""
    return unpack_rows(packed, k, dtype, columns)


def dequantised_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [rows, K]`` fp8 times its scales ``[rows, S]`` (``S`` 1, or ``K/128``), fp32."""
    scale = scale.float()
    if scale.shape[1] > 1:
        scale = scale.repeat_interleave(BLOCK, dim=1)[:, : x.shape[1]]
    return x.float() * scale


def dequantised_weight(w: torch.Tensor, scale: torch.Tensor, mode: str) -> torch.Tensor:
    """One expert's ``w [K, N]`` fp8 times its scales (``[N]`` row-wise, ``[ceil(K/128), ceil(N/128)]``), fp32."""
    if mode == "block":
        scale = scale.float().repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
        return w.float() * scale[: w.shape[0], : w.shape[1]]
    return w.float() * scale.float().reshape(1, -1)


def expert_product(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, mode: str,
                   out: torch.Tensor) -> None:
    """``out = (x * x_scale) @ (w * w_scale)`` for one expert's rows (``x [rows, K]`` fp8, ``w [K, N]`` fp8), fp32
    accumulation, rounded to ``out``'s dtype: one ``torch._scaled_mm`` where it runs (row-wise: the CPU, and CUDA
    where cuBLAS takes the operands), the dequantised product elsewhere."""
    if x.device.type == "cuda":  # comm/scaled.scaled_mm: one _scaled_mm where cuBLAS takes it, else dequantised
        row = mode == "row"
        scale_a = x_scale.float().reshape(-1, 1) if row else x_scale.float()
        scale_b = w_scale.float().reshape(1, -1) if row else w_scale.float()
        scaled_mm(x, w, Scales(scale_a, scale_b, mode, out.dtype), out=out)
        return
    if mode == "row":  # the CPU's _scaled_mm runs row-wise
        scale_a = x_scale.float().reshape(-1, 1).contiguous()
        scale_b = w_scale.float().reshape(1, -1).contiguous()
        out.copy_(torch._scaled_mm(x.contiguous(), w, scale_a, scale_b, out_dtype=out.dtype))
        return
    out.copy_(dequantised_rows(x, x_scale) @ dequantised_weight(w, w_scale, mode))


def segment_rows(x: torch.Tensor, scales: ExpertScales, k: int, start: int, rows: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[start, start + rows)`` of a call's fp8 rows with their scales: ``x`` packed (uint8, dispatch's send or
    received rows) or fp8 (combine's ``a``, its scales ``scales.a``)."""
    if x.dtype == torch.uint8:
        return unpack(x[start : start + rows], k, scales.dtype, scales.columns(k))
    return x[start : start + rows], scales.a[start : start + rows]


_TRITON_GEMM = None  # kernels.grouped_gemm, imported on the first Triton call (Triton: where a kernel runs)


def scaled_multiply(kind: str, x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, scales: ExpertScales,
                    ends: torch.Tensor, out: torch.Tensor, host_ends: list[int] | None = None, *,
                    seg_expert: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> None:
    """``out[rows of l] = x[rows of l] @ w[l]`` scaled, for the ``L`` segments of one chunk (``ends``: int32 ``[L]``
    relative to ``x``'s first row, on the device; ``host_ends`` the same on the host), the way ``kind`` says:
    ``"loop"`` (``expert_product`` per segment), ``"cublas"`` (``torch._scaled_grouped_mm``, row-wise; rows past the
    last segment written zero) or ``"triton"`` (``kernels.grouped_gemm.scaled_grouped_gemm``; ``seg_expert``: int32
    ``arange(L)`` on the device, made here where not given; ``workspace``: its table, int32 of
    ``grouped_gemm.workspace_size(L)``, made per call where not given). Rows past ``ends[-1]`` are not written (but by
    cuBLAS, which writes them zero)."""
    rows = x.shape[0]
    if rows == 0:
        return
    if kind == "cublas":
        product = torch._scaled_grouped_mm(x.contiguous(), w, x_scale.float().reshape(-1).contiguous(),
                                           scales.b.float(), offs=ends, out_dtype=out.dtype)
        product.masked_fill_(torch.arange(rows, dtype=ends.dtype, device=x.device)[:, None] >= ends[-1:], 0)
        out.copy_(product)
        return
    if kind == "triton":
        global _TRITON_GEMM
        if _TRITON_GEMM is None:
            from flashoverlap.kernels import grouped_gemm as _TRITON_GEMM  # Triton: imported where a kernel runs
        if seg_expert is None:
            seg_expert = torch.arange(w.shape[0], dtype=torch.int32, device=x.device)
        _TRITON_GEMM.scaled_grouped_gemm(x, x_scale, w, scales.b, _TRITON_GEMM.Segments(
            ends if ends.dtype == torch.int32 else ends.to(torch.int32), seg_expert), out=out, mode=scales.mode,
            workspace=workspace)
        return
    if host_ends is None:
        if x.device.type == "cuda":
            raise ValueError("scaled_multiply: the loop GEMM needs the segment ends on the host (host_ends)")
        host_ends = ends.tolist()
    start = 0
    for expert, end in enumerate(host_ends):
        if end > start:
            expert_product(x[start:end], x_scale[start:end], w[expert], scales.b[expert], scales.mode,
                           out[start:end])
        start = max(start, end)


__all__ = ["FP8", "MODES", "ExpertScales", "dequantised_rows", "dequantised_weight", "expert_product",
           "mode_of_weight_scales", "pack", "quantise", "scaled_multiply", "segment_rows", "unpack", "wire_width"]
